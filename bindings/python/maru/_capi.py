"""Typed wrappers of libmaru's C functions: with :mod:`maru._lib` (the library and its
prototypes), the C-call layer of the package. Every other module calls C only through
these functions (``test_only_the_c_layer_calls_libmaru`` checks it).

Each wrapper takes Python values (``bytes`` keys, ``int`` handles, addresses and ids,
lists of them), builds the ctypes arguments, calls the C function once, turns a failed
status into the package's exception (:func:`maru.errors.error_for`, with this thread's
``maru_last_error()`` message) and returns Python values. A handle ``h`` is the
``maru_handler_t *`` as an int; an operation ``op`` is the ``maru_op_t *`` as an int.
Keys and route keys are UTF-8 ``bytes`` without NUL (``None`` for no route key).

Callbacks handed to libmaru (memory hook, log callback) are kept alive here for as
long as libmaru may call them.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import os
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ._lib import (
    CHUNK_KEY_SIZE,
    LOG_FN,
    MEM_REGISTER_FN,
    MEM_UNREGISTER_FN,
    last_error,
    lib,
    maru_copy_t,
    maru_page_t,
    maru_piece_t,
    maru_region_t,
    maru_slot_t,
    maru_staging_t,
    maru_view_t,
    status_str,
)
from .errors import BufferTooSmallError, MaruError, Status, error_for

Key = bytes
RouteKey = Optional[bytes]

# A valid address for a zero-length buffer: libmaru refuses NULL data pointers even for
# zero bytes, and then reports the length itself as the problem.
_EMPTY = (ctypes.c_char * 1)()
EMPTY_ADDR: int = ctypes.addressof(_EMPTY)


def _error(status: int) -> MaruError:
    """The exception for a failed call's status (with this thread's last error message)."""
    return error_for(status, last_error() or status_str(status))


def _check(status: int) -> None:
    """Raises the exception for any status but OK (PENDING too: ``error_for`` refuses it)."""
    if status != Status.OK:
        raise _error(status)


def _keys(keys: Sequence[Key]) -> "ctypes.Array[ctypes.c_char_p]":
    return (ctypes.c_char_p * len(keys))(*keys)


def _ids(ids: Sequence[int]) -> "ctypes.Array[ctypes.c_uint64]":
    return (ctypes.c_uint64 * len(ids))(*ids)


def _sizes(ns: Sequence[int]) -> "ctypes.Array[ctypes.c_size_t]":
    return (ctypes.c_size_t * len(ns))(*ns)


# Handler ----------------------------------------------------------------------------


def handler_open(config_json: str) -> int:
    """``maru_handler_open``: the new handler's handle."""
    h = ctypes.c_void_p()
    _check(lib.maru_handler_open(config_json.encode("utf-8"), ctypes.byref(h)))
    return int(h.value or 0)


def handler_shutdown(h: int) -> None:
    """``maru_handler_shutdown``: new calls on ``h`` answer CLOSED, waiters wake; returns
    once the calls in flight left libmaru (at most the handler's ``timeout_ms``)."""
    _check(lib.maru_handler_shutdown(h))


def handler_close(h: int) -> None:
    """``maru_handler_close``: the handle is invalid afterwards, even when it raises."""
    _check(lib.maru_handler_close(h))


def chunk_size(h: int) -> int:
    """``maru_chunk_size``: the largest chunk a store takes, in bytes."""
    out = ctypes.c_uint64()
    _check(lib.maru_chunk_size(h, ctypes.byref(out)))
    return out.value


def stats_json(h: int) -> str:
    """``maru_stats_json``: the handler's counters as JSON text (asks for the size, then
    reads; retried while the text grows)."""
    need = ctypes.c_size_t(0)
    for _ in range(3):
        buf = ctypes.create_string_buffer(need.value + 1) if need.value else None
        st = lib.maru_stats_json(h, buf, len(buf) if buf else 0, ctypes.byref(need))
        if st == Status.OK and buf is not None:
            return buf.value.decode("utf-8")
        if st != Status.BUFFER_TOO_SMALL:
            _check(st)
    raise error_for(Status.INTERNAL, "the statistics kept growing while they were read")


# Copying store and load ---------------------------------------------------------------


def store(h: int, key: Key, addr: Optional[int], length: int, route_key: RouteKey) -> bool:
    """``maru_store`` of ``length`` bytes at ``addr``: whether the chunk is stored."""
    stored = ctypes.c_bool(False)
    _check(lib.maru_store(h, key, addr, length, route_key, ctypes.byref(stored)))
    return stored.value


def store_batch(h: int, keys: Sequence[Key], addrs: Sequence[int], lengths: Sequence[int], route_key: RouteKey) -> List[bool]:
    """``maru_store_batch``: per chunk, whether it is stored."""
    n = len(keys)
    stored = (ctypes.c_bool * n)()
    datas = (ctypes.c_void_p * n)(*addrs)
    _check(lib.maru_store_batch(h, _keys(keys), datas, _sizes(lengths), n, route_key, stored))
    return list(stored)


def load(h: int, key: Key, addr: int, capacity: int, route_key: RouteKey) -> Optional[int]:
    """``maru_load`` into ``capacity`` bytes at ``addr``: the chunk's length, None on a
    miss. A buffer too small raises :class:`BufferTooSmallError` with ``needed``."""
    got = ctypes.c_size_t(0)
    st = lib.maru_load(h, key, addr, capacity, ctypes.byref(got), route_key)
    if st == Status.NOT_FOUND:
        return None
    if st == Status.BUFFER_TOO_SMALL:
        raise BufferTooSmallError(st, last_error() or status_str(st), needed=got.value)
    _check(st)
    return got.value


def load_batch(
    h: int, keys: Sequence[Key], addrs: Sequence[int], capacities: Sequence[int], route_key: RouteKey
) -> List[Optional[int]]:
    """``maru_load_batch``: each chunk's length, None for a miss. A chunk larger than its
    buffer raises :class:`BufferTooSmallError` (``needed``: the largest such chunk)."""
    n = len(keys)
    bufs = (ctypes.c_void_p * n)(*addrs)
    caps = _sizes(capacities)
    lens = (ctypes.c_size_t * n)()
    found = (ctypes.c_bool * n)()
    st = lib.maru_load_batch(h, _keys(keys), bufs, caps, lens, found, n, route_key)
    if st == Status.BUFFER_TOO_SMALL:
        needed = max(lens[i] for i in range(n) if lens[i] > caps[i])
        raise BufferTooSmallError(st, last_error() or status_str(st), needed=needed)
    _check(st)
    return [lens[i] if found[i] else None for i in range(n)]


def load_pieces(
    h: int, keys: Sequence[Key], pieces: Sequence[Tuple[int, int, int, int]], route_key: RouteKey
) -> List[Tuple[bool, int]]:
    """``maru_load_pieces``: per chunk, whether all its pieces were copied and its
    length (0 for a miss). ``pieces`` are ``(chunk index, offset, dst, len)``, packed
    as 64-bit words in one step as for :func:`copy`."""
    n = len(keys)
    m = len(pieces)
    lens = (ctypes.c_size_t * max(n, 1))()
    found = (ctypes.c_bool * max(n, 1))()
    arr = _packed(pieces, 4, maru_piece_t, "maru_load_pieces", "(chunk, offset, dst, len)")
    _check(lib.maru_load_pieces(h, _keys(keys), n, route_key, arr, m, lens, found))
    return [(bool(found[i]), lens[i]) for i in range(n)]


# Exists, pins, remove -------------------------------------------------------------------


def exists(h: int, key: Key, route_key: RouteKey) -> bool:
    """``maru_exists``."""
    found = ctypes.c_bool(False)
    _check(lib.maru_exists(h, key, route_key, ctypes.byref(found)))
    return found.value


def _bool_batch(call: Callable[..., int], h: int, keys: Sequence[Key], route_key: RouteKey) -> List[bool]:
    n = len(keys)
    out = (ctypes.c_bool * n)()
    _check(call(h, _keys(keys), n, route_key, out))
    return list(out)


def exists_batch(h: int, keys: Sequence[Key], route_key: RouteKey) -> List[bool]:
    """``maru_exists_batch``: per key, whether it is stored."""
    return _bool_batch(lib.maru_exists_batch, h, keys, route_key)


def pin_batch(h: int, keys: Sequence[Key], route_key: RouteKey) -> List[bool]:
    """``maru_pin_batch``: per key, found and pinned."""
    return _bool_batch(lib.maru_pin_batch, h, keys, route_key)


def unpin_batch(h: int, keys: Sequence[Key], route_key: RouteKey) -> List[bool]:
    """``maru_unpin_batch``: per key, whether this handler held a pin on it."""
    return _bool_batch(lib.maru_unpin_batch, h, keys, route_key)


def remove_batch(h: int, keys: Sequence[Key], route_key: RouteKey) -> List[int]:
    """``maru_remove_batch``: a ``maru_remove_result_t`` value per key."""
    n = len(keys)
    res = (ctypes.c_uint32 * n)()
    _check(lib.maru_remove_batch(h, _keys(keys), n, route_key, res))
    return list(res)


# Staging slots and operations ---------------------------------------------------------


def slots_acquire(h: int, pool: int, n: int, timeout_ms: int) -> List[maru_slot_t]:
    """``maru_slots_acquire``: between 1 and ``n`` slots (``id``, ``data``, ``capacity``)."""
    out = (maru_slot_t * n)()
    got = ctypes.c_size_t(0)
    _check(lib.maru_slots_acquire(h, pool, n, timeout_ms, out, ctypes.byref(got)))
    return [out[i] for i in range(got.value)]


def slots_release(h: int, ids: Sequence[int]) -> None:
    """``maru_slots_release``."""
    _check(lib.maru_slots_release(h, _ids(ids), len(ids)))


def slots_held(h: int, ids: Sequence[int]) -> List[bool]:
    """``maru_slots_held``: per slot id, whether it is still the caller's."""
    n = len(ids)
    held = (ctypes.c_bool * n)()
    _check(lib.maru_slots_held(h, _ids(ids), n, held))
    return list(held)


def store_slots(h: int, keys: Sequence[Key], ids: Sequence[int], lengths: Sequence[int], route_key: RouteKey) -> List[bool]:
    """``maru_store_slots``: per chunk, whether it is stored."""
    n = len(keys)
    stored = (ctypes.c_bool * n)()
    _check(lib.maru_store_slots(h, _keys(keys), _ids(ids), _sizes(lengths), n, route_key, stored))
    return list(stored)


def load_slots(h: int, keys: Sequence[Key], ids: Sequence[int], route_key: RouteKey) -> Tuple[List[bool], List[int]]:
    """``maru_load_slots``: per chunk, (found, length)."""
    n = len(keys)
    lens = (ctypes.c_size_t * n)()
    found = (ctypes.c_bool * n)()
    _check(lib.maru_load_slots(h, _keys(keys), _ids(ids), n, route_key, lens, found))
    return list(found), list(lens)


def submit_store_slots(h: int, keys: Sequence[Key], ids: Sequence[int], lengths: Sequence[int], route_key: RouteKey) -> int:
    """``maru_submit_store_slots``: the running operation."""
    op = ctypes.c_void_p()
    _check(lib.maru_submit_store_slots(h, _keys(keys), _ids(ids), _sizes(lengths), len(keys), route_key, ctypes.byref(op)))
    return int(op.value or 0)


def submit_load_slots(h: int, keys: Sequence[Key], ids: Sequence[int], route_key: RouteKey) -> int:
    """``maru_submit_load_slots``: the running operation."""
    op = ctypes.c_void_p()
    _check(lib.maru_submit_load_slots(h, _keys(keys), _ids(ids), len(keys), route_key, ctypes.byref(op)))
    return int(op.value or 0)


def _op_status(st: int) -> bool:
    if st == Status.PENDING:
        return False
    _check(st)
    return True


def op_poll(op: int) -> bool:
    """``maru_op_poll``: True when the operation finished, False while it runs; raises
    the operation's error when it failed."""
    return _op_status(lib.maru_op_poll(op))


def op_wait(op: int, timeout_ms: int) -> bool:
    """``maru_op_wait`` up to ``timeout_ms``: as :func:`op_poll`."""
    return _op_status(lib.maru_op_wait(op, timeout_ms))


def op_results(op: int, n: int) -> Tuple[List[bool], List[int]]:
    """``maru_op_results`` of an operation of ``n`` chunks: per chunk, (stored or found,
    length)."""
    flags = (ctypes.c_bool * n)()
    lens = (ctypes.c_size_t * n)()
    _check(lib.maru_op_results(op, flags, lens, n))
    return list(flags), list(lens)


def op_free(op: int) -> None:
    """``maru_op_free`` (a running operation goes on to its end)."""
    lib.maru_op_free(op)


# Views of chunks in place (cxl) -----------------------------------------------------------


def views_acquire(h: int, keys: Sequence[Key], route_key: RouteKey) -> List[Optional[maru_view_t]]:
    """``maru_views_acquire``: per key, the view (``id``, ``data``, ``len``,
    ``valid_ms``), None for a miss."""
    n = len(keys)
    infos = (maru_view_t * n)()
    found = (ctypes.c_bool * n)()
    _check(lib.maru_views_acquire(h, _keys(keys), n, route_key, infos, found))
    return [infos[i] if found[i] else None for i in range(n)]


def views_release(h: int, ids: Sequence[int]) -> None:
    """``maru_views_release``."""
    _check(lib.maru_views_release(h, _ids(ids), len(ids)))


# Writes in place and region views (cxl) ----------------------------------------------------


def pages_take(h: int, n: int, route_key: RouteKey) -> List[maru_page_t]:
    """``maru_pages_take``: up to ``n`` pages of own regions to write chunks in place."""
    out = (maru_page_t * max(n, 1))()
    got = ctypes.c_size_t(0)
    _check(lib.maru_pages_take(h, n, route_key, out, ctypes.byref(got)))
    return [out[i] for i in range(got.value)]


def _pages(locs: Sequence[Tuple[int, int]]) -> "ctypes.Array[maru_page_t]":
    arr = (maru_page_t * max(len(locs), 1))()
    for i, (r, p) in enumerate(locs):
        arr[i].region_id, arr[i].page = r, p
    return arr


def pages_publish(h: int, keys: Sequence[Key], locs: Sequence[Tuple[int, int]], lens: Sequence[int]) -> List[bool]:
    """``maru_pages_publish``: per chunk, whether it is stored (now or already)."""
    n = len(keys)
    out = (ctypes.c_bool * max(n, 1))()
    _check(lib.maru_pages_publish(h, _keys(keys), _pages(locs), _sizes(lens), n, out))
    return [bool(out[i]) for i in range(n)]


def pages_give_back(h: int, locs: Sequence[Tuple[int, int]]) -> None:
    """``maru_pages_give_back``."""
    _check(lib.maru_pages_give_back(h, _pages(locs), len(locs)))


def regions_list(h: int) -> List[maru_region_t]:
    """``maru_regions_list``: the regions this host maps now."""
    cap = 16
    while True:
        out = (maru_region_t * cap)()
        count = ctypes.c_size_t(0)
        _check(lib.maru_regions_list(h, out, cap, ctypes.byref(count)))
        if count.value <= cap:
            return [out[i] for i in range(count.value)]
        cap = count.value


def region_view(h: int, region_id: int) -> Optional[maru_region_t]:
    """``maru_region_view``: the region as this host maps it, None if it maps none."""
    out = maru_region_t()
    found = ctypes.c_bool(False)
    _check(lib.maru_region_view(h, region_id, ctypes.byref(out), ctypes.byref(found)))
    return out if found.value else None


def staging_buffer(h: int) -> maru_staging_t:
    """``maru_staging_buffer``: where the staging buffer lies and how it is cut."""
    out = maru_staging_t()
    _check(lib.maru_staging_buffer(h, ctypes.byref(out)))
    return out


# Process-wide settings: memory hook, log callback --------------------------------------------

# The memory hook's ctypes callbacks must outlive every handler opened with them: never
# dropped.
_hooks: list = []


def set_memory_hook(
    register: Optional[Callable[[int, int], int]], unregister: Optional[Callable[[int, int], None]] = None
) -> None:
    """``maru_set_memory_hook`` with ``register(ptr, length) -> int`` and
    ``unregister(ptr, length)`` (None: no such callback; ``register`` None removes the
    hook). An exception from ``register`` counts as a failure (-1), one from
    ``unregister`` is dropped: none may cross into libmaru (:mod:`maru.hook` logs them)."""
    if register is None:
        _check(lib.maru_set_memory_hook(ctypes.cast(None, MEM_REGISTER_FN), ctypes.cast(None, MEM_UNREGISTER_FN), None))
        return
    reg_fn = register

    def c_register(_ctx: int, ptr: Optional[int], length: int) -> int:
        try:
            return int(reg_fn(ptr or 0, length))
        except Exception:  # noqa: BLE001 - must not cross into libmaru: a failure
            return -1

    reg = MEM_REGISTER_FN(c_register)
    if unregister is not None:
        unreg_fn = unregister

        def c_unregister(_ctx: int, ptr: Optional[int], length: int) -> None:
            try:
                unreg_fn(ptr or 0, length)
            except Exception:  # noqa: BLE001 - must not cross into libmaru
                pass

        unreg = MEM_UNREGISTER_FN(c_unregister)
    else:
        unreg = ctypes.cast(None, MEM_UNREGISTER_FN)
    _hooks.append((reg, unreg))
    _check(lib.maru_set_memory_hook(reg, unreg, None))


def set_memory_hook_auto() -> None:
    """``maru_set_memory_hook_auto``."""
    _check(lib.maru_set_memory_hook_auto())


_log_lock = threading.Lock()
_log_callback: Optional[object] = None  # the ctypes callback libmaru holds; kept alive here


def set_log_callback(min_level: int, fn: Optional[Callable[[int, str, str], None]]) -> None:
    """``maru_set_log_callback``: ``fn(level, target, message)`` (a
    ``maru_log_level_t`` and decoded text) for each message at ``min_level`` or more
    severe; ``fn`` None gives libmaru back its stderr output. ``fn`` runs on whichever
    thread logs; an exception from it is dropped."""
    global _log_callback
    with _log_lock:
        if fn is None:
            cb = ctypes.cast(None, LOG_FN)
        else:
            py_fn = fn

            def c_log(_ctx: object, level: int, target: Optional[bytes], message: Optional[bytes]) -> None:
                try:
                    py_fn(level, (target or b"").decode("utf-8", "replace"), (message or b"").decode("utf-8", "replace"))
                except Exception:  # noqa: BLE001 - nothing may cross back into libmaru
                    pass

            cb = LOG_FN(c_log)
        _check(lib.maru_set_log_callback(min_level, cb, None))
        # libmaru no longer calls the previous callback once the call returned.
        _log_callback = None if fn is None else cb


# Chunk keys -------------------------------------------------------------------------------


def chunk_keys(tokens: Sequence[int], chunk: int, namespace: str) -> List[str]:
    """``maru_chunk_keys``: the key of each full chunk of ``chunk`` tokens."""
    n = len(tokens) // chunk if chunk > 0 else 0
    arr = (ctypes.c_int32 * max(len(tokens), 1))(*tokens)
    out = ctypes.create_string_buffer(max(n, 1) * CHUNK_KEY_SIZE)
    got = ctypes.c_size_t()
    _check(lib.maru_chunk_keys(arr, len(tokens), chunk, namespace.encode("utf-8"), out, n, ctypes.byref(got)))
    raw = out.raw
    return [raw[i * CHUNK_KEY_SIZE : (i + 1) * CHUNK_KEY_SIZE].split(b"\0", 1)[0].decode("ascii") for i in range(got.value)]


# Key files -------------------------------------------------------------------------------


def key_file_check(path: str) -> None:
    """``maru_key_file_check``: raises :class:`~maru.ConfigError` (naming the file and
    what to do) unless ``path`` holds a key a handler can prove."""
    _check(lib.maru_key_file_check(os.fsencode(path)))


# Copies ----------------------------------------------------------------------------------


def copy(pieces: Sequence[Tuple[int, int, int]], into_shared: bool) -> None:
    """``maru_copy``: each ``(dst, src, len)`` piece, in one call. The pieces are packed
    as 64-bit words in one step (a ``maru_copy_t`` is three of them on a 64-bit host):
    a ctypes structure per piece cost about 1.5 us each, 0.7 ms for the 512 pieces of a
    batch of 32 chunks over 16 layers."""
    n = len(pieces)
    if not n:
        return
    arr = _packed(pieces, 3, maru_copy_t, "maru_copy", "(dst, src, len)")
    _check(lib.maru_copy(arr, n, bool(into_shared)))


def _packed(rows: Sequence[Sequence[int]], width: int, struct: type, call: str, shape: str) -> Any:
    """``rows`` as an array of ``struct`` (``width`` fields of 64 bits each): packed as
    64-bit words in one step where the host's pointers and sizes are 64 bits, a ctypes
    structure per row otherwise. A row not of ``width`` non-negative integers raises
    ValueError naming ``call`` and ``shape``."""
    if _AS_WORDS and ctypes.sizeof(struct) == 8 * width:
        if any(len(r) != width for r in rows):
            raise ValueError(f"{call}: every piece is {shape}")
        try:
            words = array.array("Q", itertools.chain.from_iterable(rows))
        except (OverflowError, TypeError) as e:
            raise ValueError(f"{call}: a piece is not {width} non-negative integers: {e}") from None
        return ctypes.cast((ctypes.c_uint64 * max(width * len(rows), 1)).from_buffer(words), ctypes.POINTER(struct))
    return (struct * max(len(rows), 1))(*rows)


# Pointers and size_t of 64 bits: a structure of them is that many 64-bit words, no padding.
_AS_WORDS = ctypes.sizeof(ctypes.c_void_p) == 8 and ctypes.sizeof(ctypes.c_size_t) == 8 and array.array("Q").itemsize == 8
