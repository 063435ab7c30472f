"""``MaruHandler``: one engine's handle on Maru (a libmaru handler)."""

from __future__ import annotations

import ctypes
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ._lib import last_error, lib
from .errors import ClosedError, error_for

Buffer = Union[bytes, bytearray, memoryview, Any]  # anything with the buffer protocol

_OK = 0
_NOT_FOUND = 5
_TOO_SMALL = 14


def _check(status: int) -> None:
    if status != _OK:
        raise error_for(status, last_error())


def _key(k: str) -> bytes:
    if not isinstance(k, str) or not k:
        raise TypeError("keys are non-empty str")
    return k.encode("utf-8")


def _rk(route_key: Optional[str]) -> Optional[bytes]:
    return None if route_key is None else _key(route_key)


def _address(data: Buffer) -> Tuple[int, int, Any]:
    """(address, length, keep-alive) of a buffer, without copying it. Writable buffers
    (bytearray, numpy arrays, writable memoryviews) are passed in place; read-only ones
    (bytes, read-only views) are passed in place too, through a pointer to their bytes."""
    mv = memoryview(data)
    if not mv.contiguous:
        raise ValueError("the buffer must be contiguous")
    mv = mv.cast("B")
    n = mv.nbytes
    if n == 0:
        return 0, 0, mv
    if not mv.readonly:
        arr = (ctypes.c_char * n).from_buffer(mv)
        return ctypes.addressof(arr), n, (arr, mv)
    if isinstance(data, bytes):
        # bytes are immutable; c_char_p points at their storage.
        p = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
        return p, n, data
    # A read-only view of something else: one copy.
    copy = bytes(mv)
    p = ctypes.cast(ctypes.c_char_p(copy), ctypes.c_void_p).value or 0
    return p, n, copy


class MaruHandler:
    """An engine's handler: store and retrieve KV chunks by key.

    ``config`` is the JSON configuration (a dict or a JSON string) described in
    docs/configuration.md: ``backend`` (``remote_cxl`` or ``cxl``), ``server_url``,
    ``engine_id``, ``namespace``, ``layout``, ``agent_key_file``, ``load_slots``,
    ``store_slots``, ``timeout_ms``. Use it as a context manager, or call ``close()``.
    Methods are thread-safe.
    """

    def __init__(self, config: Union[Dict[str, Any], str]) -> None:
        text = config if isinstance(config, str) else json.dumps(config)
        h = ctypes.c_void_p()
        _check(lib.maru_handler_open(text.encode("utf-8"), ctypes.byref(h)))
        self._h: Optional[ctypes.c_void_p] = h

    def __enter__(self) -> "MaruHandler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _handle(self) -> ctypes.c_void_p:
        if self._h is None:
            raise ClosedError(13, "the handler is closed")
        return self._h

    def close(self) -> None:
        """Closes the handler's sessions (drained: stored chunks stay readable for other
        engines). Closing twice is harmless."""
        h, self._h = self._h, None
        if h is not None:
            _check(lib.maru_handler_close(h))

    def chunk_size(self) -> int:
        """The largest chunk ``store`` takes (the pools' page size)."""
        out = ctypes.c_uint64()
        _check(lib.maru_chunk_size(self._handle(), ctypes.byref(out)))
        return out.value

    def store(self, key: str, data: Buffer, route_key: Optional[str] = None) -> bool:
        """Stores ``data`` (bytes, bytearray, memoryview, numpy array, ... — not copied)
        under ``key``. ``route_key`` picks the pool: pass a request's first chunk key
        for all its chunks. Returns False when the chunk was skipped (no free staging
        slot, pool unavailable)."""
        addr, n, keep = _address(data)
        stored = ctypes.c_bool(False)
        _check(lib.maru_store(self._handle(), _key(key), addr or None, n, _rk(route_key), ctypes.byref(stored)))
        del keep
        return stored.value

    def store_ptr(self, key: str, ptr: int, length: int, route_key: Optional[str] = None) -> bool:
        """Stores ``length`` bytes at address ``ptr`` (host memory, e.g. a pinned torch
        tensor's ``data_ptr()``)."""
        stored = ctypes.c_bool(False)
        _check(lib.maru_store(self._handle(), _key(key), ptr, length, _rk(route_key), ctypes.byref(stored)))
        return stored.value

    def retrieve_into(self, key: str, buffer: Buffer, route_key: Optional[str] = None) -> Optional[int]:
        """Loads ``key`` into a writable buffer (no copy beyond the load itself).
        Returns its length, or None on a miss. A buffer too small raises
        InvalidArgumentError naming the size needed."""
        mv = memoryview(buffer).cast("B")
        if mv.readonly:
            raise TypeError("retrieve_into needs a writable buffer")
        n = mv.nbytes
        arr = (ctypes.c_char * max(n, 1)).from_buffer(mv) if n else (ctypes.c_char * 1)()
        got = ctypes.c_size_t(0)
        st = lib.maru_load(self._handle(), _key(key), ctypes.addressof(arr), n, ctypes.byref(got), _rk(route_key))
        if st == _NOT_FOUND:
            return None
        if st == _TOO_SMALL:
            raise error_for(2, f"chunk {key} has {got.value} bytes; the buffer holds {n}")
        _check(st)
        return got.value

    def retrieve(self, key: str, route_key: Optional[str] = None) -> Optional[bytes]:
        """Loads ``key``; None on a miss."""
        cap = self.chunk_size()
        buf = bytearray(cap)
        n = self.retrieve_into(key, buf, route_key)
        return None if n is None else bytes(buf[:n])

    def exists(self, key: str, route_key: Optional[str] = None) -> bool:
        """Whether ``key`` is stored."""
        found = ctypes.c_bool(False)
        _check(lib.maru_exists(self._handle(), _key(key), _rk(route_key), ctypes.byref(found)))
        return found.value

    def batch_store(self, items: Sequence[Tuple[str, Buffer]], route_key: Optional[str] = None) -> List[bool]:
        """Stores a request's chunks; ``route_key`` defaults to the first key."""
        rk = route_key if route_key is not None else (items[0][0] if items else None)
        return [self.store(k, d, rk) for k, d in items]

    def batch_retrieve(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[Optional[bytes]]:
        """Loads a request's chunks; None for each miss."""
        rk = route_key if route_key is not None else (keys[0] if keys else None)
        return [self.retrieve(k, rk) for k in keys]

    def batch_exists(self, keys: Sequence[str], route_key: Optional[str] = None) -> List[bool]:
        """Whether each key is stored."""
        rk = route_key if route_key is not None else (keys[0] if keys else None)
        return [self.exists(k, rk) for k in keys]

    def stats(self) -> Dict[str, Any]:
        """Counters per pool and in total (stored, hits, misses, bytes, ...)."""
        need = ctypes.c_size_t(0)
        st = lib.maru_stats_json(self._handle(), None, 0, ctypes.byref(need))
        if st not in (_OK, _TOO_SMALL):
            _check(st)
        buf = ctypes.create_string_buffer(need.value + 1)
        _check(lib.maru_stats_json(self._handle(), buf, need.value + 1, ctypes.byref(need)))
        return json.loads(buf.value.decode("utf-8"))
