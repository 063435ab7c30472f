"""``MaruHandler``: one engine's handle on Maru (a libmaru handler)."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import _buffer
from . import _capi
from . import hook as _hook
from ._buffer import Buffer
from ._capi import EMPTY_ADDR as _EMPTY_ADDR
from .errors import (
    BufferTooSmallError,
    BusyError,
    ClosedError,
    InvalidArgumentError,
    MaruError,
    Status,
    error_for,
)
from ._book import _Expirer, _Releases, _Views
from .slots import Op, Slot, SlotPool, as_lengths
from .views import RemoveResult, View


log = logging.getLogger(__name__)


class PageInfo(collections.namedtuple("PageInfo", "region_id page offset addr capacity buf")):
    """A page of an own region taken for writing a chunk in place (cxl): its region id,
    page index, byte offset in the region, address, capacity and a writable
    memoryview ``buf`` of it."""


def _key(k: str, what: str = "key") -> bytes:
    if not isinstance(k, str):
        raise TypeError(f"{what} must be a str, not {type(k).__name__}")
    if not k:
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"{what} is empty")
    if "\0" in k:
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"{what} {k!r} contains a NUL character")
    return k.encode("utf-8")


def _rk(route_key: Optional[str]) -> Optional[bytes]:
    return None if route_key is None else _key(route_key, "route_key")


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


class MaruHandler:
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

    def __enter__(self) -> "MaruHandler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

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
        ks = [_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
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
        ks = [_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
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
        ks = [_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
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
        ks = [_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
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

    # Staging slots ----------------------------------------------------------------

    def acquire_slots(self, pool: Union[SlotPool, int], n: int = 1, timeout: float = 1.0) -> List[Slot]:
        """Takes between 1 and ``n`` staging slots of ``pool`` (:class:`SlotPool` ``LOAD``
        or ``STORE``), waiting up to ``timeout`` seconds for at least one
        (``maru_slots_acquire``). No free slot in time raises
        :class:`~maru.NoSpaceError` (release slots or raise ``load_slots`` /
        ``store_slots``). Each :class:`~maru.Slot` has a writable memoryview ``view``
        straight over the staging buffer; release it when done."""
        pool = SlotPool(pool)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int, not {n!r}")
        if timeout < 0:
            raise ValueError("timeout must be >= 0")
        with self._use() as h:
            infos = _capi.slots_acquire(h, int(pool), n, min(int(timeout * 1000), 0xFFFFFFFF))
            slots = [Slot(self, pool, info) for info in infos]
            with self._slot_lock:
                for s in slots:
                    self._slots[s.id] = s
        return slots

    def acquire_slot(self, pool: Union[SlotPool, int], timeout: float = 1.0) -> Slot:
        """One staging slot of ``pool`` (:meth:`acquire_slots` with ``n=1``)."""
        return self.acquire_slots(pool, 1, timeout)[0]

    def release_slots(self, slots: Sequence[Slot]) -> None:
        """Releases each slot (:meth:`Slot.release`)."""
        for s in slots:
            s.release()

    def _own(self, slots: Sequence[Slot], keys: Sequence[str]) -> Tuple[List[bytes], List[int], int]:
        slots = list(slots)
        keys = list(keys)
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots: give one slot per key")
        seen = set()
        for s in slots:
            if not isinstance(s, Slot):
                raise TypeError(f"expected a Slot, not {type(s).__name__}")
            if s._handler is not self:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"slot {s.id} belongs to another handler")
            if s.id in seen:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"slot {s.id} appears twice in one call")
            seen.add(s.id)
            s._check()
        n = len(keys)
        ks = [_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        ids = [s.id for s in slots]
        return ks, ids, n

    def store_slots(
        self,
        keys: Sequence[str],
        slots: Sequence[Slot],
        lengths: Union[None, int, Sequence[int]] = None,
        route_key: Optional[str] = None,
    ) -> List[bool]:
        """Stores ``lengths[i]`` bytes of ``slots[i]`` under ``keys[i]``
        (``maru_store_slots``; ``lengths`` defaults to each slot's ``length``, as set by
        :meth:`Slot.write`). On ``remote_cxl`` the WRITE goes from the slot: no copy.
        Returns per chunk whether it is stored (or was already). The slots stay yours
        (release them), also after a skipped store or a failed call, except those that
        libmaru took back after a transfer whose outcome was unknown
        (``maru_slots_held`` says which): they are retired."""
        slots = list(slots)
        lens_l = as_lengths(lengths, slots)
        for s, ln in zip(slots, lens_l):
            if not 1 <= ln <= s.capacity:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"length {ln} of slot {s.id} is not in 1..{s.capacity}")
        if not slots:
            return []
        ks, ids, n = self._own(slots, keys)
        rk = _rk(route_key)
        failed: Optional[MaruError] = None
        with self._use() as h:
            try:
                stored = _capi.store_slots(h, ks, ids, lens_l, rk)
            except MaruError as e:
                failed = e
        if failed is not None:
            self._settle(slots, [False] * n, " (its store failed and libmaru took it back)")
            raise failed
        return self._apply_stored(slots, stored)

    def load_slots(self, keys: Sequence[str], slots: Sequence[Slot], route_key: Optional[str] = None) -> List[Optional[int]]:
        """Loads ``keys[i]`` into ``slots[i]`` (``maru_load_slots``; on ``remote_cxl`` the
        READ lands in the slot: no copy). Returns each chunk's length, None where it was
        not loaded. Loaded slots get ``length`` and ``key``; read them through
        :meth:`Slot.data`. A slot whose chunk was not loaded stays yours (``length`` and
        ``key`` None) after a plain miss; only one libmaru took back after a transfer
        whose outcome was unknown is retired (``maru_slots_held`` says which)."""
        slots = list(slots)
        if not slots:
            return []
        ks, ids, n = self._own(slots, keys)
        rk = _rk(route_key)
        failed: Optional[MaruError] = None
        with self._use() as h:
            try:
                found, lens = _capi.load_slots(h, ks, ids, rk)
            except MaruError as e:
                failed = e
        if failed is not None:
            for s in slots:
                s.length = s.key = None
            self._settle(slots, [False] * n, " (its load failed and libmaru took it back)")
            raise failed
        return self._apply_loaded(list(keys), slots, found, lens)

    def submit_store_slots(
        self,
        keys: Sequence[str],
        slots: Sequence[Slot],
        lengths: Union[None, int, Sequence[int]] = None,
        route_key: Optional[str] = None,
    ) -> Op:
        """:meth:`store_slots` without waiting (``maru_submit_store_slots``): returns the
        running :class:`~maru.Op`. The slots are lent to it until it finished (do not
        write into them meanwhile; the wrapper refuses access)."""
        slots = list(slots)
        keys = list(keys)
        lens_l = as_lengths(lengths, slots)
        for s, ln in zip(slots, lens_l):
            if not 1 <= ln <= s.capacity:
                raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"length {ln} of slot {s.id} is not in 1..{s.capacity}")
        if not slots:
            raise ValueError("nothing to submit: no slots")
        ks, ids, _ = self._own(slots, keys)
        with self._use() as h:
            op = _capi.submit_store_slots(h, ks, ids, lens_l, _rk(route_key))
        return self._lend(Op(self, "store", keys, slots, op))

    def submit_load_slots(self, keys: Sequence[str], slots: Sequence[Slot], route_key: Optional[str] = None) -> Op:
        """:meth:`load_slots` without waiting (``maru_submit_load_slots``): returns the
        running :class:`~maru.Op`; the slots are lent to it until it finished."""
        slots = list(slots)
        keys = list(keys)
        if not slots:
            raise ValueError("nothing to submit: no slots")
        ks, ids, _ = self._own(slots, keys)
        with self._use() as h:
            op = _capi.submit_load_slots(h, ks, ids, _rk(route_key))
        return self._lend(Op(self, "load", keys, slots, op))

    def _lend(self, op: Op) -> Op:
        for s in op.slots:
            s._op = op
        return op

    def _settle(self, slots: List[Slot], ok: List[bool], why: str) -> None:
        """After a call: the slots whose chunk was not stored/loaded (``ok`` False) that
        libmaru took back (``maru_slots_held``: no longer the caller's, after a transfer
        whose outcome was unknown) are retired; the others stay held. When libmaru
        cannot say (the handler closed meanwhile), they are all retired."""
        bad = [s for s, k in zip(slots, ok) if not k and s._state == "held"]
        if not bad:
            return
        try:
            held = self._held_ids([s.id for s in bad])
        except MaruError:
            held = [False] * len(bad)
        for s, kept in zip(bad, held):
            if not kept:
                self._release_slot(s, "retired", why, force=True)

    def _apply_stored(self, slots: List[Slot], stored: Any) -> List[bool]:
        out = [bool(stored[i]) for i in range(len(slots))]
        self._settle(slots, out, " (its chunk was not stored and libmaru took it back: the transfer's outcome was unknown)")
        return out

    def _apply_loaded(self, keys: List[str], slots: List[Slot], found: Any, lens: Any) -> List[Optional[int]]:
        out: List[Optional[int]] = []
        for i, s in enumerate(slots):
            if found[i]:
                s.length, s.key = int(lens[i]), keys[i]
                out.append(int(lens[i]))
            else:
                s.length = s.key = None
                out.append(None)
        self._settle(
            slots,
            [x is not None for x in out],
            " (its chunk was not loaded and libmaru took it back: the transfer's outcome was unknown)",
        )
        return out

    def _held_ids(self, ids: List[int]) -> List[bool]:
        if not ids:
            return []
        with self._use() as h:
            return _capi.slots_held(h, ids)

    def slots_held(self, slots: Sequence[Union[Slot, int]]) -> List[bool]:
        """Whether each slot (a :class:`~maru.Slot` or a slot id) is still this caller's
        in libmaru (``maru_slots_held``): False once released, or taken back by libmaru
        after a transfer whose outcome was unknown. The binding already retires such
        slots after each call (``slot.released``); this asks libmaru directly."""
        ids = []
        for s in slots:
            if isinstance(s, Slot):
                ids.append(s.id)
            elif isinstance(s, int) and not isinstance(s, bool) and s >= 0:
                ids.append(s)
            else:
                raise TypeError(f"expected a Slot or a slot id, not {s!r}")
        return self._held_ids(ids)

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

    def _release_slot(self, slot: Slot, state: str, why: str = "", force: bool = False) -> None:
        """Revokes the slot's views and gives it back (``force``: give it up in Python
        even while objects made from its views live; the C slot then goes back the
        moment the last of them is freed)."""
        with self._slot_lock:
            if slot._state != "held":
                return
            alive = slot._revoke()
            if alive and not force:
                raise BufferError(
                    f"staging slot {slot.id}: {alive} object(s) made from its views (slices, numpy or torch "
                    "arrays) are still alive; drop them, then release again (the slot stays valid meanwhile)"
                )
            slot._state, slot._why = state, why
            self._slots.pop(slot.id, None)
            slot._c_released = True
        self._releases.give_up("slot", slot.id, slot._views)

    def _slot_dropped(self, slot: Slot) -> None:
        """A slot garbage collected while held (from ``Slot.__del__``, which may run
        anywhere, even while this thread holds a lock): given back when nothing reaches
        its memory any more, at once when no memoryview of it (or object made from
        one) is left."""
        if slot._state == "held" and slot._op is None and not slot._c_released:
            slot._c_released = True
            self._releases.give_up("slot", slot.id, slot._views, revoke=False)

    # Views of chunks in place (cxl) --------------------------------------------------

    # Writes in place and region views (cxl) ------------------------------------------

    def take_pages(self, n: int, route_key: Optional[str] = None) -> List["PageInfo"]:
        """Takes up to ``n`` pages of this engine's own regions to write chunks in place
        (``maru_pages_take``, backend ``cxl`` only; ``remote_cxl`` raises
        :class:`~maru.InvalidArgumentError`). Each :class:`PageInfo` has ``buf``, a
        writable memoryview of the page in the mapping: fill it, then
        :meth:`publish_pages`, or :meth:`give_back_pages`. Fewer than ``n`` when the pool
        has no room."""
        with self._use() as h:
            got = _capi.pages_take(h, n, _rk(route_key))
        out = []
        for p in got:
            addr = p.data or 0
            exp = self._region_exports.get(p.region_id) or self._region_export(p.region_id)
            if exp is not None and exp[2]["addr"] <= addr and addr + p.capacity <= exp[2]["addr"] + exp[2]["len"]:
                at = addr - exp[2]["addr"]
                buf = exp[1][at : at + p.capacity]
            else:  # not in the mapping region_view names: a memoryview of its own
                buf = _Views().make(addr, p.capacity)
            out.append(PageInfo(p.region_id, p.page, p.offset, addr, p.capacity, buf))
        return out

    def publish_pages(self, keys: Sequence[str], pages: Sequence[Tuple[int, int]], lens: Sequence[int]) -> List[bool]:
        """Publishes pages written in place (``maru_pages_publish``): ``keys[i]`` with the
        first ``lens[i]`` bytes of page ``pages[i]`` = (region id, page index), the chunks
        of one request in chain order. Per chunk: stored (now or already); False when its
        region was lost meanwhile or the pool is unavailable."""
        ks = [_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        with self._use() as h:
            return _capi.pages_publish(h, ks, list(pages), list(lens))

    def give_back_pages(self, pages: Sequence[Tuple[int, int]]) -> None:
        """Gives back pages taken and not published (``maru_pages_give_back``)."""
        with self._use() as h:
            _capi.pages_give_back(h, list(pages))

    def regions(self) -> List[Dict[str, Any]]:
        """The regions this host maps now (``maru_regions_list``; none on
        ``remote_cxl``): ``region_id``, ``len``, ``page_size``, ``page_count``,
        ``writable`` (own regions)."""
        with self._use() as h:
            rs = _capi.regions_list(h)
        return [
            {
                "region_id": r.region_id,
                "addr": int(r.data or 0),
                "len": r.len,
                "page_size": r.page_size,
                "page_count": r.page_count,
                "writable": bool(r.writable),
            }
            for r in rs
        ]

    def region_view(self, region_id: int) -> Optional[Tuple[memoryview, Dict[str, Any]]]:
        """A memoryview of a whole region this host maps (``maru_region_view``),
        writable for own regions, with its description (as :meth:`regions`); None when
        it maps no such region. The same memoryview every time; the memory stays mapped
        until :meth:`close`, which releases it (and refuses while something made from it,
        a slice or an array, is alive)."""
        got = self._region_export(region_id)
        if got is None:
            return None
        return got[1], {k: v for k, v in got[2].items() if k != "addr"}

    def staging_buffer(self) -> Dict[str, int]:
        """Where the staging buffer lies (``maru_staging_buffer``): ``addr``, ``len``,
        ``slot_size``, ``load_slots`` (the first slots), ``store_slots`` (the rest). A
        slot acquired from a pool lies at one of its pool's places."""
        with self._use() as h:
            st = _capi.staging_buffer(h)
        return {
            "addr": int(st.data or 0),
            "len": int(st.len),
            "slot_size": int(st.slot_size),
            "load_slots": int(st.load_slots),
            "store_slots": int(st.store_slots),
        }

    def staging_view(self) -> memoryview:
        """A writable memoryview of the whole staging buffer, the same one every time
        (released by :meth:`close`, which refuses while something made from it lives).
        Read or write only the slots you hold: the others are libmaru's."""
        with self._slot_lock:
            got = self._region_exports.get(self.STAGING_EXPORT)
        if got is None:
            st = self.staging_buffer()
            with self._slot_lock:
                got = self._region_exports.get(self.STAGING_EXPORT)
                if got is None:
                    vs = _Views()
                    got = (vs, vs.make(st["addr"], st["len"]), st)
                    self._region_exports[self.STAGING_EXPORT] = got
        return got[1]

    #: The key of the staging buffer's memoryview among the region exports.
    STAGING_EXPORT = -1

    def _region_export(self, region_id: int) -> Optional[Tuple[_Views, memoryview, Dict[str, Any]]]:
        """The one memoryview of a region's mapping this handler hands out (pages taken
        and region views are slices of it), made on first use; None when this host maps
        no such region."""
        with self._slot_lock:
            got = self._region_exports.get(region_id)
        if got is not None:
            return got
        with self._use() as h:
            r = _capi.region_view(h, region_id)
        if r is None:
            return None
        info = {
            "region_id": r.region_id,
            "addr": int(r.data or 0),
            "len": r.len,
            "page_size": r.page_size,
            "page_count": r.page_count,
            "writable": bool(r.writable),
        }
        with self._slot_lock:
            got = self._region_exports.get(region_id)
            if got is None:
                vs = _Views()
                got = (vs, vs.make(info["addr"], r.len, readonly=not r.writable), info)
                self._region_exports[region_id] = got
        return got

    def acquire_views(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[Optional[View]]:
        """Reads a request's chunks in place, with no copy at all (``maru_views_acquire``,
        backend ``cxl`` only): a :class:`~maru.View` per found key (its ``view`` is a
        read-only memoryview over this host's mapping of the region), None for a miss.
        Each view holds a lease that keeps the chunk's bytes until :meth:`View.release`
        (or a ``with`` block, or :meth:`close`), and at most ``valid_ms`` ms; then it
        expires (see :mod:`maru.views`). Release views as soon as their bytes are used.
        ``route_key`` defaults to the first key. On ``remote_cxl`` raises
        :class:`~maru.InvalidArgumentError` (no mapping here: use :meth:`load_slots`)."""
        keys = list(keys)
        if not keys:
            return []
        ks = [_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        rk = _rk(route_key)
        t0 = time.monotonic()
        with self._use() as h:
            infos = _capi.views_acquire(h, ks, rk)
            out: List[Optional[View]] = [None if info is None else View(self, key, info, t0) for key, info in zip(keys, infos)]
            got = [v for v in out if v is not None]
            with self._slot_lock:
                for v in got:
                    self._views[v.id] = v
                if got and self._expirer is None:
                    self._expirer = _Expirer(self)
                exp = self._expirer
        if got and exp is not None:
            exp.add(got)
        return out

    def acquire_spans(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[Optional[Tuple[int, int, int]]]:
        """The leases of :meth:`acquire_views` without :class:`~maru.View` objects: per
        found key ``(view id, address, length)`` of the chunk in this host's mapping,
        None for a miss. Nothing in Python guards the address (no memoryview to revoke,
        no expiry): for a caller that copies the bytes at once (the vLLM connector's
        loads, with :func:`maru.copy_ranges`) and then gives the ids back with
        :meth:`release_spans`, well within the lease (``valid_ms``, 60 s by default).
        Spans still held when the handler closes end with it. ``cxl`` only."""
        keys = list(keys)
        if not keys:
            return []
        ks = [_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
        with self._use() as h:
            infos = _capi.views_acquire(h, ks, _rk(route_key))
        return [None if i is None else (i.id, int(i.data or 0), i.len) for i in infos]

    def release_spans(self, ids: Sequence[int]) -> None:
        """Ends the leases of spans (their ids from :meth:`acquire_spans`) in one call;
        the addresses must not be read after it."""
        ids = list(ids)
        if ids:
            with self._use() as h:
                _capi.views_release(h, ids)

    def acquire_view(self, key: str, route_key: Optional[str] = None) -> Optional[View]:
        """One chunk in place (:meth:`acquire_views` of one key; ``route_key`` defaults
        to the key); None on a miss."""
        return self.acquire_views([key], key if route_key is None else route_key)[0]

    def release_views(self, views: Sequence[Optional[View]]) -> None:
        """Releases each view (:meth:`View.release`); None entries (misses) are skipped.
        Their leases go back together (one call per pool)."""
        with self._releases.batched():
            for v in views:
                if v is not None:
                    v.release()

    def held_views(self) -> List[View]:
        """The views this handler handed out that are still held (not released, not
        expired)."""
        with self._slot_lock:
            vs = list(self._views.values())
        return [v for v in vs if not v.released]

    def _release_view(self, view: View, state: str, why: str = "", force: bool = False) -> None:
        """Revokes the view's memoryviews and ends it in libmaru (``force``: give it up
        in Python even while derived objects live; the C view, its lease and the mapping
        then end the moment the last of them is freed)."""
        with self._slot_lock:
            if view._c_released:
                if view._state == "held":
                    view._state, view._why = state, why
                return
            alive = view._revoke()
            if alive and not force:
                raise BufferError(
                    f"view {view.id} of chunk {view.key!r}: {alive} object(s) made from its memoryviews (slices, "
                    "numpy or torch arrays) are still alive; drop them, then release again (the view stays valid "
                    "meanwhile, until its lease runs out)"
                )
            if view._state == "held":
                view._state, view._why = state, why
            self._views.pop(view.id, None)
            view._c_released = True
        self._releases.give_up("view", view.id, view._views)

    def _expire_view(self, view: View) -> None:
        """The view's lease ran out (the expiry thread, or an access that noticed)."""
        if view._state != "held" or time.monotonic() < view._deadline:
            return
        try:
            self._release_view(view, "expired", force=True)
        except MaruError:
            pass  # revoked in Python already; libmaru ends the lease with the handler

    def _view_dropped(self, view: View) -> None:
        """A view garbage collected while its C view is held (from ``View.__del__``,
        which may run anywhere): its lease ends when nothing reaches its memory any
        more, at once when no memoryview of it (or object made from one) is left."""
        if not view._c_released:
            view._c_released = True
            self._releases.give_up("view", view.id, view._views, revoke=False)

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

    def held_slots(self) -> List[Slot]:
        """The slots this handler handed out that are still held in Python."""
        with self._slot_lock:
            return [s for s in self._slots.values() if s._state == "held"]


#: The native handler's public name (``maru.Handler``).
Handler = MaruHandler
