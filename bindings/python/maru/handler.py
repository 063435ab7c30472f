"""``MaruHandler``: one engine's handle on Maru (a libmaru handler): its lifetime
(open, calls in flight, close) and the calls by key (store, load, exists, pins,
remove, stats). Its staging-slot calls are in :mod:`maru.handler_slots`, its calls on
memory in place in :mod:`maru.handler_place`."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _buffer
from . import _capi
from . import hook as _hook
from ._args import _key, _keys, _rk
from ._buffer import Buffer
from ._capi import EMPTY_ADDR as _EMPTY_ADDR
from .errors import (
    BufferTooSmallError,
    BusyError,
    ClosedError,
    MaruError,
    Status,
    error_for,
)
from ._book import _Expirer, _Releases, _Views
from ._scoped import _Scoped
from .handler_place import PageInfo, _PlaceCalls
from .handler_slots import _SlotCalls
from .slots import Slot
from .views import RemoveResult, View

__all__ = ["Handler", "MaruHandler", "PageInfo"]

log = logging.getLogger(__name__)


class _InUse:
    """The context manager of :meth:`MaruHandler._use` (one per handler; the state is
    the handler's)."""

    __slots__ = ("_h",)

    def __init__(self, handler: "MaruHandler") -> None:
        self._h = handler

    def __enter__(self) -> int:
        return self._h._enter()

    def __exit__(self, *exc: Any) -> None:
        self._h._exit()


class MaruHandler(_SlotCalls, _PlaceCalls, _Scoped):
    """An engine's handler: store and retrieve KV chunks by key.

    ``config`` is the JSON configuration (a dict, or a JSON string) of
    docs/configuration.md: ``backend`` (``"remote_cxl"`` or ``"cxl"``), ``server_url``,
    ``engine_id``, and optionally ``namespace``, ``layout``, ``agent_key_file``,
    ``server_key_file`` (the maru-server key, or its tenant's; default
    ``MARU_SERVER_KEY_FILE``, else ``~/.maru/server.key`` when it exists), ``transport``, ``load_slots``, ``store_slots``,
    ``timeout_ms``. A wrong configuration
    raises :class:`~maru.ConfigError` naming the field; no reachable pool raises
    :class:`~maru.UnavailableError`.

    Use it as a context manager, or call :meth:`close`. Methods may be called from
    several threads at once; ``close`` waits for calls in flight and later calls raise
    :class:`~maru.ClosedError`.

    ``route_key`` picks the pool a chunk goes to: pass a request's first chunk key for
    all its chunks (the batch methods default to their first key, single calls to the
    key itself).

    Staging slots (:meth:`acquire_slots`, :meth:`store_slots`, :meth:`load_slots`,
    :meth:`submit_store_slots`, :meth:`submit_load_slots`) give zero-copy access to the
    handler's staging buffer as memoryviews; see :mod:`maru.slots` for their rules. On
    ``cxl``, :meth:`acquire_views` reads chunks in place in the mapped region (no copy
    at all; see :mod:`maru.views`). :meth:`remove` / :meth:`batch_remove` unpublish
    keys this engine stored.

    This is ``maru.Handler``. The package's ``maru.MaruHandler`` is the
    upstream-compatible handler (:class:`maru.compat.MaruHandler`, configured by a
    ``MaruConfig``), as in the upstream Maru package.
    """

    def __init__(self, config: Union[Mapping[str, Any], str]) -> None:
        self._h: Optional[int] = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closing = False
        # A handle close() gave up waiting for: freed by the last call to leave.
        self._free_on_exit: Optional[int] = None
        # How long close() waits for calls in flight in Python once libmaru shut down.
        self._close_wait_s = 10.0
        self._chunk: Optional[int] = None
        self._slot_lock = threading.RLock()
        self._slots: "weakref.WeakValueDictionary[int, Slot]" = weakref.WeakValueDictionary()
        # Views of chunks in place (cxl) held in Python.
        self._views: "weakref.WeakValueDictionary[int, View]" = weakref.WeakValueDictionary()
        # Slots and views Python is done with, given back to libmaru the moment nothing
        # made from their memoryviews is alive any more (exact: see maru._book).
        self._releases = _Releases(self, self._c_release)
        self._in_use = _InUse(self)
        self._expirer: Optional[_Expirer] = None
        # Memoryviews of the mapped regions (cxl), one per region mapping; pages taken
        # for writing in place are slices of them.
        self._region_exports: Dict[int, Tuple[_Views, memoryview, Dict[str, Any]]] = {}
        if not isinstance(config, (str, Mapping)):
            raise TypeError(f"config must be a dict or a JSON string, not {type(config).__name__}")
        text = config if isinstance(config, str) else json.dumps(dict(config))
        self._h = _capi.handler_open(text)
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            # libmaru accepted it: timeout_ms, when given, is a positive integer.
            self._close_wait_s = int(json.loads(text).get("timeout_ms", 10_000)) / 1000

    def __repr__(self) -> str:
        return f"<MaruHandler {'closed' if self.closed else 'open'}>"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._h is None or self._closing

    def _use(self) -> "_InUse":
        """The C handle for one call (``with self._use() as h:``); keeps ``close`` from
        freeing it meanwhile. Gives back what Python gave up
        (:class:`~maru._book._Releases`) on the way in and out."""
        return self._in_use

    def _enter(self) -> int:
        rel = self._releases
        if rel._queue or rel._later:
            rel.retry_later()
            rel.kick()
        with self._lock:
            if self._h is None or self._closing:
                raise ClosedError(Status.CLOSED, "the handler is closed")
            self._active += 1
            return self._h

    def _exit(self) -> None:
        self._done_use()
        if self._releases._queue:
            self._releases.kick()

    def _try_use(self) -> Optional[Tuple[int, bool]]:
        """``(C handle, closed)`` without waiting for the lock (None when another thread,
        or this one further up, holds it); when not closed, the caller ends with
        :meth:`_done_use`. For :class:`~maru._book._Releases`, whose callbacks run
        anywhere."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._h is None or self._closing:
                return 0, True
            self._active += 1
            return self._h, False
        finally:
            self._lock.release()

    def _done_use(self) -> None:
        free = None
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._closing:
                self._idle.notify_all()  # close() waits for the calls in flight
                free, self._free_on_exit = self._free_on_exit, None
        if free is not None:
            # close() returned before this call left: the handle is freed now that no
            # call of Python's can use it any more.
            with contextlib.suppress(MaruError):
                _capi.handler_close(free)

    def close(self) -> None:
        """Closes the handler's sessions, drained: the chunks it stored stay readable for
        other engines. Closing twice is harmless.

        Calls in flight on other threads: libmaru's handler is shut down first
        (``maru_handler_shutdown``), so a thread waiting in :meth:`acquire_slots` gets
        :class:`~maru.ClosedError` at once and calls inside libmaru return within the
        configuration's ``timeout_ms``; then ``close`` waits, at most ``timeout_ms``
        more, for those calls to leave Python's wrappers. A call still inside after that
        does not hold ``close`` up: the handler is freed when that call leaves (every
        libmaru call it makes meanwhile raises :class:`~maru.ClosedError`).

        Every staging slot's and every :class:`~maru.View`'s memoryviews are released
        first (the staging buffer and the mapping go away with the handler). While an
        object derived from one (a slice, a numpy or torch array over it) is alive,
        ``close`` raises ``BufferError`` and the handler stays open: drop those objects
        and close again."""
        with self._lock:
            if self._h is None or self._closing:
                return
        with self._slot_lock:
            stuck = [s.id for s in list(self._slots.values()) if s._revoke()]
            stuck_views = [v.id for v in list(self._views.values()) if v._revoke()]
            for kind, i in self._releases.waiting():
                (stuck if kind == "slot" else stuck_views).append(i)
            stuck_regions = [r for r, (vs, _, _) in list(self._region_exports.items()) if vs.revoke()]
            if stuck or stuck_views or stuck_regions:
                what = []
                if stuck:
                    what.append(f"staging slots {sorted(stuck)}")
                if stuck_views:
                    what.append(f"views {sorted(stuck_views)}")
                if stuck_regions:
                    what.append(f"regions {sorted(stuck_regions)}")
                raise BufferError(
                    f"{' and '.join(what)} still have views in use (slices, numpy or torch arrays made from "
                    "Slot.view, View.view, AllocHandle.buf, MemoryInfo.view or a region view): drop them, then close again"
                )
        with self._lock:
            if self._h is None or self._closing:
                return
            self._closing = True  # no new call begins
            h = self._h
        try:
            # Wakes libmaru's waiters and refuses their next calls (CLOSED); returns
            # once the calls inside libmaru left it, at most timeout_ms.
            try:
                _capi.handler_shutdown(h)
            except MaruError as e:  # close all the same: maru_handler_close shuts down too
                log.warning("maru.Handler.close: maru_handler_shutdown failed: %s", e)
            with self._lock:
                self._h = None
                if not self._idle.wait_for(lambda: self._active == 0, timeout=self._close_wait_s):
                    # A call is still in Python's wrappers (and may call libmaru
                    # again, which answers CLOSED): the last one to leave frees.
                    self._free_on_exit = h
                    log.warning(
                        "maru.Handler.close: %d call(s) still in flight after %.1f s; the handler is freed when they return",
                        self._active, self._close_wait_s,
                    )
                    return
            _capi.handler_close(h)
        finally:
            with self._slot_lock:
                for s in list(self._slots.values()):
                    s._revoke()
                    s._state, s._why, s._c_released = "released", " (its handler was closed)", True
                self._slots.clear()
                for vw in list(self._views.values()):
                    vw._revoke()
                    if vw._state == "held":
                        vw._state, vw._why = "released", " (its handler was closed)"
                    vw._c_released = True
                self._views.clear()
                self._releases.clear()
                self._region_exports.clear()
                if self._expirer is not None:
                    self._expirer.stop()

    def chunk_size(self) -> int:
        """The largest chunk :meth:`store` takes: the pools' page size (maru-server's
        ``--chunk-size``)."""
        if self._chunk is None:
            with self._use() as h:
                self._chunk = _capi.chunk_size(h)
        else:
            with self._use():
                pass  # a closed handler still raises ClosedError
        return self._chunk

    # Store ---------------------------------------------------------------------------

    def store(self, key: str, data: Buffer, route_key: Optional[str] = None) -> bool:
        """Stores ``data`` under ``key``.

        ``data`` is anything with the buffer protocol (bytes, bytearray, memoryview and
        slices of them, numpy arrays, ...) and must be C-contiguous; its bytes are passed
        to libmaru in place, without a copy in Python, whether it is writable or
        read-only (outside CPython a read-only buffer is copied once). At most
        :meth:`chunk_size` bytes (more raises InvalidArgumentError).

        Returns True when the chunk is stored or was already present, False when it was
        skipped (no free staging slot, pool unavailable): the caller just computes it
        again next time.
        """
        k, rk = _key(key), _rk(route_key)
        with _buffer.readable(data) as (addr, n), self._use() as h:
            return _capi.store(h, k, addr or _EMPTY_ADDR, n, rk)

    def store_ptr(self, key: str, ptr: int, length: int, route_key: Optional[str] = None) -> bool:
        """Stores ``length`` bytes at address ``ptr`` (host memory that stays valid during
        the call, e.g. a CPU or pinned torch tensor's ``t.data_ptr()`` with
        ``t.numel() * t.element_size()`` bytes, or a numpy array's ``a.ctypes.data``).
        Nothing is copied in Python. Returns as :meth:`store`."""
        if not isinstance(ptr, int) or not isinstance(length, int):
            raise TypeError("ptr and length must be int")
        if length < 0:
            raise ValueError("length must be ≥ 0")
        k, rk = _key(key), _rk(route_key)
        with self._use() as h:
            return _capi.store(h, k, ptr or None, length, rk)

    def batch_store(self, items: Sequence[Tuple[str, Buffer]], route_key: Optional[str] = None) -> List[bool]:
        """Stores a request's chunks in one call (``maru_store_batch``): ``items`` are
        ``(key, data)`` pairs, ``data`` as for :meth:`store` (not copied). ``route_key``
        defaults to the first key. Returns, per chunk, what :meth:`store` would."""
        items = list(items)
        if not items:
            return []
        n = len(items)
        keys = [_key(k, f"items[{i}] key") for i, (k, _) in enumerate(items)]
        datas = [0] * n
        lens = [0] * n
        rk = _rk(route_key)
        with contextlib.ExitStack() as stack:
            for i, (_, d) in enumerate(items):
                addr, ln = stack.enter_context(_buffer.readable(d))
                datas[i], lens[i] = addr or _EMPTY_ADDR, ln
            with self._use() as h:
                return _capi.store_batch(h, keys, datas, lens, rk)

    # Load ----------------------------------------------------------------------------

    def retrieve_into(self, key: str, buffer: Buffer, route_key: Optional[str] = None) -> Optional[int]:
        """Loads ``key`` into ``buffer`` (any writable, C-contiguous buffer: bytearray,
        memoryview, numpy array, ...; no copy in Python). Returns the chunk's length, or
        None on a miss. A buffer too small raises :class:`~maru.BufferTooSmallError`
        whose ``needed`` is the chunk's size."""
        k, rk = _key(key), _rk(route_key)
        with _buffer.writable(buffer) as (addr, cap), self._use() as h:
            return _capi.load(h, k, addr or _EMPTY_ADDR, cap, rk)

    def retrieve(self, key: str, route_key: Optional[str] = None) -> Optional[bytes]:
        """Loads ``key`` and returns its bytes, or None on a miss. The buffer is
        :meth:`chunk_size` bytes, grown and retried if the library says the chunk needs
        more. Use :meth:`retrieve_into` to load into your own buffer without the copy
        into ``bytes``."""
        buf = bytearray(self.chunk_size())
        for _ in range(3):
            try:
                n = self.retrieve_into(key, buf, route_key)
            except BufferTooSmallError as e:
                buf = bytearray(max(e.needed, len(buf) * 2))
                continue
            if n is None:
                return None
            with memoryview(buf) as mv:
                return mv[:n].tobytes()
        raise BufferTooSmallError(Status.BUFFER_TOO_SMALL, f"chunk {key} kept growing while it was loaded")

    def batch_retrieve_into(
        self, keys: Sequence[str], buffers: Sequence[Buffer], route_key: Optional[str] = None
    ) -> List[Optional[int]]:
        """Loads a request's chunks in one call (``maru_load_batch``) into ``buffers[i]``
        (writable, not copied). Returns each chunk's length, None for a miss.
        ``route_key`` defaults to the first key. A chunk larger than its buffer raises
        :class:`~maru.BufferTooSmallError` (``needed``: that chunk's size)."""
        keys = list(keys)
        buffers = list(buffers)
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        n = len(keys)
        ks = _keys(keys)
        bufs = [0] * n
        caps = [0] * n
        rk = _rk(route_key)
        with contextlib.ExitStack() as stack:
            for i, b in enumerate(buffers):
                addr, cap = stack.enter_context(_buffer.writable(b))
                bufs[i], caps[i] = addr or _EMPTY_ADDR, cap
            with self._use() as h:
                return _capi.load_batch(h, ks, bufs, caps, rk)

    def load_pieces(
        self, keys: Sequence[str], pieces: Sequence[Tuple[int, int, int, int]], route_key: Optional[str] = None
    ) -> List[Tuple[bool, int]]:
        """Loads a request's chunks and copies pieces of them into memory of the
        caller's, in one call (``maru_load_pieces``: the leases taken, the pieces copied
        while held, the leases given back, inside libmaru). ``pieces`` are ``(chunk
        index, offset in the chunk, destination address, length)``; every destination
        must be writable for its length and apart from the others (not checked, as with
        :func:`maru.copy_ranges`). Per chunk: ``(copied, length)``, ``copied`` true where
        the chunk was found and all its pieces copied, ``length`` the chunk's length
        where found (also when a piece lies past its end: then nothing of it is copied),
        0 for a miss. Both backends. ``route_key`` defaults to the first key."""
        keys = list(keys)
        if not keys:
            if pieces:
                raise ValueError(f"{len(pieces)} pieces but no key")
            return []
        ks = _keys(keys)
        with self._use() as h:
            return _capi.load_pieces(h, ks, pieces, _rk(route_key))

    def batch_retrieve(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[Optional[bytes]]:
        """Loads a request's chunks in one call; each one's bytes, or None for a miss.
        ``route_key`` defaults to the first key."""
        keys = list(keys)
        cap = self.chunk_size()
        for _ in range(3):
            bufs = [bytearray(cap) for _ in keys]
            try:
                lens = self.batch_retrieve_into(keys, bufs, route_key)
            except BufferTooSmallError as e:
                cap = max(e.needed, cap * 2)
                continue
            out: List[Optional[bytes]] = []
            for b, n in zip(bufs, lens):
                if n is None:
                    out.append(None)
                else:
                    del b[n:]
                    out.append(bytes(b))
            return out
        raise BufferTooSmallError(Status.BUFFER_TOO_SMALL, "chunks kept growing while they were loaded")

    # Exists and stats ----------------------------------------------------------------

    def exists(self, key: str, route_key: Optional[str] = None) -> bool:
        """Whether ``key`` is stored (published) in its pool."""
        k, rk = _key(key), _rk(route_key)
        with self._use() as h:
            return _capi.exists(h, k, rk)

    def batch_exists(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[bool]:
        """Whether each key is stored, in one round trip (``maru_exists_batch``);
        ``route_key`` defaults to the first key."""
        return self._bool_batch(_capi.exists_batch, keys, route_key)

    # Pins ----------------------------------------------------------------------------

    def pin(self, key: str, route_key: Optional[str] = None) -> bool:
        """Pins ``key`` (``maru_pin_batch``): True when it is stored and pinned now. A
        pinned key is neither evicted nor removed, by any engine, until this handler
        unpins it or closes, or its memory is lost (the memory node rebooted, its
        region went back). Pins count: two pins need two :meth:`unpin` calls."""
        return self.batch_pin([key], key if route_key is None else route_key)[0]

    def batch_pin(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[bool]:
        """:meth:`pin` for a request's keys in one round trip; per key, found and pinned
        (a miss is not pinned). ``route_key`` defaults to the first key."""
        return self._pins(keys, route_key, True)

    def unpin(self, key: str, route_key: Optional[str] = None) -> bool:
        """Drops one of this handler's pins of ``key``: True when it held one."""
        return self.batch_unpin([key], key if route_key is None else route_key)[0]

    def batch_unpin(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[bool]:
        """:meth:`unpin` for a request's keys in one round trip."""
        return self._pins(keys, route_key, False)

    def _pins(self, keys: Sequence[str], route_key: Optional[str], on: bool) -> List[bool]:
        return self._bool_batch(_capi.pin_batch if on else _capi.unpin_batch, keys, route_key)

    def _bool_batch(self, call: Any, keys: Sequence[str], route_key: Optional[str]) -> List[bool]:
        """``call(h, keys, route_key)`` (a :mod:`maru._capi` wrapper), one C call for the
        request's keys, with a bool per key."""
        keys = list(keys)
        if not keys:
            return []
        ks = _keys(keys)
        rk = _rk(route_key)
        with self._use() as h:
            return list(call(h, ks, rk))

    # Remove --------------------------------------------------------------------------

    def remove(self, key: str, route_key: Optional[str] = None) -> RemoveResult:
        """Unpublishes ``key``, which this engine stored (``maru_remove_batch``): no
        reader finds it afterwards and its page is free for this engine's next stores.
        Returns a :class:`~maru.RemoveResult`: ``REMOVED``, ``NOT_FOUND`` (not stored, or
        its pool is unavailable now), ``NOT_OWNER`` (refused: another engine stored it)
        ``LEASED`` (refused: a reader holds it now, e.g. through a
        :class:`~maru.View`; try again later) or ``PINNED`` (refused: an engine pins
        it). ``route_key`` must be the one the chunk
        was stored with (default: the key itself)."""
        return self.batch_remove([key], key if route_key is None else route_key)[0]

    def batch_remove(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[RemoveResult]:
        """:meth:`remove` for a request's keys in one call (``maru_remove_batch``); a
        :class:`~maru.RemoveResult` per key. ``route_key`` defaults to the first key (as
        for :meth:`batch_store`)."""
        keys = list(keys)
        if not keys:
            return []
        n = len(keys)
        ks = _keys(keys)
        rk = _rk(route_key)
        with self._use() as h:
            res = _capi.remove_batch(h, ks, rk)
        out = []
        for i in range(n):
            try:
                out.append(RemoveResult(res[i]))
            except ValueError:
                raise error_for(Status.INTERNAL, f"maru_remove_batch gave {res[i]} for {keys[i]!r}, unknown to this binding") from None
        return out

    def stats(self) -> Dict[str, Any]:
        """The handler's counters (``maru_stats_json``) as a dict: per pool and in
        ``"total"`` (stored, hits, misses, bytes, ...)."""
        with self._use() as h:
            text = _capi.stats_json(h)
        return json.loads(text)

    @staticmethod
    def _c_release(h: int, kind: str, ids: List[int]) -> List[Tuple[str, int]]:
        """Gives slots or views back in libmaru (for :class:`~maru._book._Releases`);
        returns the slots libmaru refused for now: lent to an operation freed while
        running, they come back to the caller at its end and are released then."""
        call = _capi.slots_release if kind == "slot" else _capi.views_release
        try:
            call(h, ids)
            return []
        except BusyError:
            pass
        except MaruError:
            return []  # closed meanwhile, or already back: nothing of it is held
        later = []
        for i in ids:
            try:
                call(h, [i])
            except BusyError:
                later.append((kind, i))
            except MaruError:
                pass
        return later

    @staticmethod
    def set_memory_hook_auto() -> None:
        """:func:`maru.set_memory_hook_auto` (process-wide, for handlers opened later)."""
        _hook.set_memory_hook_auto()

    def held_in_libmaru(self) -> Dict[str, int]:
        """How many slots and views this handler holds in libmaru now: those held
        through a :class:`~maru.Slot` or :class:`~maru.View`, and those given up in
        Python while something made from their memory (a memoryview, an array) is
        still alive (they go back the moment it is freed)."""
        with self._slot_lock:
            slots = sum(1 for s in self._slots.values() if not s._c_released)
            views = sum(1 for v in self._views.values() if not v._c_released)
        for kind, _ in self._releases.waiting():
            if kind == "slot":
                slots += 1
            else:
                views += 1
        return {"slots": slots, "views": views}


#: The native handler's public name (``maru.Handler``).
Handler = MaruHandler
