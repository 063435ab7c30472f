"""``MaruHandler``: one engine's handle on Maru (a libmaru handler)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import threading
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from . import _buffer
from ._buffer import Buffer
from ._lib import last_error, lib, status_str
from .errors import BufferTooSmallError, ClosedError, InvalidArgumentError, Status, error_for


def _check(status: int) -> None:
    """Raises the exception for a failed call (with this thread's last error message)."""
    if status != Status.OK:
        raise error_for(status, last_error() or status_str(status))


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


class MaruHandler:
    """An engine's handler: store and retrieve KV chunks by key.

    ``config`` is the JSON configuration (a dict, or a JSON string) of
    docs/configuration.md: ``backend`` (``"remote_cxl"`` or ``"cxl"``), ``server_url``,
    ``engine_id``, and optionally ``namespace``, ``layout``, ``agent_key_file``,
    ``transport``, ``load_slots``, ``store_slots``, ``timeout_ms``. A wrong configuration
    raises :class:`~maru.ConfigError` naming the field; no reachable pool raises
    :class:`~maru.UnavailableError`.

    Use it as a context manager, or call :meth:`close`. Methods may be called from
    several threads at once; ``close`` waits for calls in flight and later calls raise
    :class:`~maru.ClosedError`.

    ``route_key`` picks the pool a chunk goes to: pass a request's first chunk key for
    all its chunks (the batch methods default to their first key, single calls to the
    key itself).
    """

    def __init__(self, config: Union[Mapping[str, Any], str]) -> None:
        self._h: Optional[int] = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._active = 0
        self._closing = False
        self._chunk: Optional[int] = None
        text = config if isinstance(config, str) else json.dumps(dict(config))
        h = ctypes.c_void_p()
        _check(lib.maru_handler_open(text.encode("utf-8"), ctypes.byref(h)))
        self._h = h.value

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

    @contextlib.contextmanager
    def _use(self) -> Iterator[int]:
        """The C handle for one call; keeps ``close`` from freeing it meanwhile."""
        with self._lock:
            if self._h is None or self._closing:
                raise ClosedError(Status.CLOSED, "the handler is closed")
            self._active += 1
            h = self._h
        try:
            yield h
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self._idle.notify_all()

    def close(self) -> None:
        """Closes the handler's sessions, drained: the chunks it stored stay readable for
        other engines. Waits for calls in flight on other threads. Closing twice is
        harmless."""
        with self._lock:
            if self._h is None or self._closing:
                return
            self._closing = True
            self._idle.wait_for(lambda: self._active == 0)
            h, self._h = self._h, None
        _check(lib.maru_handler_close(h))

    def chunk_size(self) -> int:
        """The largest chunk :meth:`store` takes: the pools' page size (maru-server's
        ``--chunk-size``)."""
        if self._chunk is None:
            out = ctypes.c_uint64()
            with self._use() as h:
                _check(lib.maru_chunk_size(h, ctypes.byref(out)))
            self._chunk = out.value
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
        stored = ctypes.c_bool(False)
        with _buffer.readable(data) as (addr, n), self._use() as h:
            _check(lib.maru_store(h, k, addr or _EMPTY_ADDR, n, rk, ctypes.byref(stored)))
        return stored.value

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
        stored = ctypes.c_bool(False)
        with self._use() as h:
            _check(lib.maru_store(h, k, ptr or None, length, rk, ctypes.byref(stored)))
        return stored.value

    def batch_store(self, items: Sequence[Tuple[str, Buffer]], route_key: Optional[str] = None) -> List[bool]:
        """Stores a request's chunks in one call (``maru_store_batch``): ``items`` are
        ``(key, data)`` pairs, ``data`` as for :meth:`store` (not copied). ``route_key``
        defaults to the first key. Returns, per chunk, what :meth:`store` would."""
        items = list(items)
        if not items:
            return []
        n = len(items)
        keys = (ctypes.c_char_p * n)(*(_key(k, f"items[{i}] key") for i, (k, _) in enumerate(items)))
        datas = (ctypes.c_void_p * n)()
        lens = (ctypes.c_size_t * n)()
        stored = (ctypes.c_bool * n)()
        rk = _rk(route_key)
        with contextlib.ExitStack() as stack:
            for i, (_, d) in enumerate(items):
                addr, ln = stack.enter_context(_buffer.readable(d))
                datas[i], lens[i] = addr or _EMPTY_ADDR, ln
            with self._use() as h:
                _check(lib.maru_store_batch(h, keys, datas, lens, n, rk, stored))
        return list(stored)

    # Load ----------------------------------------------------------------------------

    def retrieve_into(self, key: str, buffer: Buffer, route_key: Optional[str] = None) -> Optional[int]:
        """Loads ``key`` into ``buffer`` (any writable, C-contiguous buffer: bytearray,
        memoryview, numpy array, ...; no copy in Python). Returns the chunk's length, or
        None on a miss. A buffer too small raises :class:`~maru.BufferTooSmallError`
        whose ``needed`` is the chunk's size."""
        k, rk = _key(key), _rk(route_key)
        got = ctypes.c_size_t(0)
        with _buffer.writable(buffer) as (addr, cap), self._use() as h:
            st = lib.maru_load(h, k, addr or _EMPTY_ADDR, cap, ctypes.byref(got), rk)
            if st == Status.NOT_FOUND:
                return None
            if st == Status.BUFFER_TOO_SMALL:
                raise BufferTooSmallError(st, last_error() or status_str(st), needed=got.value)
            _check(st)
        return got.value

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
        ks = (ctypes.c_char_p * n)(*(_key(k, f"keys[{i}]") for i, k in enumerate(keys)))
        bufs = (ctypes.c_void_p * n)()
        caps = (ctypes.c_size_t * n)()
        lens = (ctypes.c_size_t * n)()
        found = (ctypes.c_bool * n)()
        rk = _rk(route_key)
        with contextlib.ExitStack() as stack:
            for i, b in enumerate(buffers):
                addr, cap = stack.enter_context(_buffer.writable(b))
                bufs[i], caps[i] = addr or _EMPTY_ADDR, cap
            with self._use() as h:
                st = lib.maru_load_batch(h, ks, bufs, caps, lens, found, n, rk)
                if st == Status.BUFFER_TOO_SMALL:
                    needed = max(lens[i] for i in range(n) if lens[i] > caps[i])
                    raise BufferTooSmallError(st, last_error() or status_str(st), needed=needed)
                _check(st)
        return [lens[i] if found[i] else None for i in range(n)]

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
        found = ctypes.c_bool(False)
        with self._use() as h:
            _check(lib.maru_exists(h, k, rk, ctypes.byref(found)))
        return found.value

    def batch_exists(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[bool]:
        """Whether each key is stored; ``route_key`` defaults to the first key (one
        ``maru_exists`` call per key: the C API has no batched exists)."""
        keys = list(keys)
        if not keys:
            return []
        rk = route_key if route_key is not None else keys[0]
        return [self.exists(k, rk) for k in keys]

    def stats(self) -> Dict[str, Any]:
        """The handler's counters (``maru_stats_json``) as a dict: per pool and in
        ``"total"`` (stored, hits, misses, bytes, ...)."""
        need = ctypes.c_size_t(0)
        with self._use() as h:
            for _ in range(3):
                buf = ctypes.create_string_buffer(need.value + 1) if need.value else None
                st = lib.maru_stats_json(h, buf, len(buf) if buf else 0, ctypes.byref(need))
                if st == Status.OK and buf is not None:
                    return json.loads(buf.value.decode("utf-8"))
                if st != Status.BUFFER_TOO_SMALL:
                    _check(st)
        raise error_for(Status.INTERNAL, "the statistics kept growing while they were read")


# A valid address for a zero-length buffer: libmaru refuses NULL data pointers even for
# zero bytes, and then reports the length itself as the problem.
_EMPTY = (ctypes.c_char * 1)()
_EMPTY_ADDR = ctypes.addressof(_EMPTY)
