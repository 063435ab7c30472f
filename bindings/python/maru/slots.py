"""Staging slots as memoryviews, and asynchronous slot operations.

A handler's staging buffer is cut into slots of one chunk each, in two pools: ``LOAD``
and ``STORE`` (``load_slots`` / ``store_slots`` in the configuration). With the slot
API the caller fills a store slot in place and stores it, or loads chunks straight into
load slots and reads them in place: on ``remote_cxl`` the one-sided WRITE goes from the
slot and the READ lands in it, so nothing is copied on the host. On ``cxl`` libmaru
copies between the slot and the mapped region (one copy).

Safety rules, enforced by the binding:

* ``Slot.view`` (and ``Slot.data()``) are memoryviews straight over libmaru's memory.
  When the slot is released, retired or its handler closed, every memoryview the slot
  handed out is released (using one raises ``ValueError``), and every access through
  the :class:`Slot` raises :class:`~maru.SlotReleasedError`. A released slot's memory
  goes back to libmaru and may hold another key's chunk a moment later: this is why.
* Something derived from a view (a slice ``view[a:b]``, ``numpy.frombuffer(view)``,
  ``torch.frombuffer(view)``) cannot be revoked by Python. So ``release()`` refuses
  (``BufferError``, the slot stays held and valid) while such an object is alive; drop
  it and release again. Closing the handler refuses likewise.
* A slot whose chunk comes back not loaded after a plain miss, or not stored after a
  skipped store, stays yours (a load miss leaves ``length`` and ``key`` None). Only a
  slot libmaru took back after a transfer whose outcome was unknown (it may still be
  written by the NIC) is *retired*: after every call the binding asks libmaru which
  (``maru_slots_held``), and refuses further access to those; ``slot.released`` says
  so. This holds for slots of a failed call or operation too. Acquire a new slot.
* A slot lent to a running asynchronous operation cannot be released or accessed
  through the wrapper (:class:`~maru.BusyError`) until the operation finished.
"""

from __future__ import annotations

import ctypes
import enum
import threading
import time
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Union

from . import _capi
from ._buffer import Buffer, _bytes_view
from ._book import _Views
from ._scoped import _Scoped
from .errors import BusyError, MaruError, SlotReleasedError, Status, error_for

if TYPE_CHECKING:  # pragma: no cover
    from .handler import MaruHandler


class SlotPool(enum.IntEnum):
    """``maru_slot_pool_t``: the pool a staging slot comes from."""

    LOAD = 0
    STORE = 1


class Slot(_Scoped):
    """One staging slot held by the caller (from :meth:`MaruHandler.acquire_slots`).

    Attributes: ``id`` (libmaru's slot id, never reused), ``pool`` (:class:`SlotPool`),
    ``capacity`` (bytes: one chunk), ``length`` (bytes that count: set by
    :meth:`write`, by a load, or by the caller before a store), ``key`` (the key last
    loaded into it). Fill or read it through :attr:`view`, :meth:`data`, :meth:`write`,
    :meth:`read` or :attr:`address` (for a GPU copy kernel or ``cudaMemcpy``), then
    :meth:`release` it (or use it as a context manager). See the module docstring for
    the safety rules.
    """

    _ends_with = "release"

    def __init__(self, handler: "MaruHandler", pool: SlotPool, info: Any) -> None:
        self._handler = handler
        self.id: int = int(info.id)
        self.pool: SlotPool = pool
        self.capacity: int = int(info.capacity)
        self._addr: int = int(info.data or 0)
        self._views = _Views()
        self._view: Optional[memoryview] = None
        self._state = "held"  # held | retired | released
        self._why = ""
        self._op: Optional["Op"] = None
        self._c_released = False
        self.length: Optional[int] = None
        self.key: Optional[str] = None

    def __repr__(self) -> str:
        return f"<Slot {self.id} {self.pool.name.lower()} {self._state} capacity={self.capacity} length={self.length}>"

    def _dropped(self) -> None:
        self._handler._slot_dropped(self)

    # Access -------------------------------------------------------------------------

    @property
    def released(self) -> bool:
        """Whether the slot was released or retired (no access any more)."""
        return self._state != "held"

    @property
    def busy(self) -> bool:
        """Whether the slot is lent to an asynchronous operation still running."""
        op = self._op
        return op is not None and not op._refresh()

    def _check(self) -> None:
        if self._state != "held":
            raise SlotReleasedError(f"staging slot {self.id} is {self._state}{self._why}: its memory is no longer yours")
        if self.busy:
            raise BusyError(Status.BUSY, f"staging slot {self.id} is lent to a running operation: wait for it first")

    @property
    def view(self) -> memoryview:
        """A writable memoryview of the whole slot (``capacity`` bytes), the same object
        on every access until the slot is released (then it is released too)."""
        self._check()
        if self._view is None:
            self._view = self._views.make(self._addr, self.capacity)
        return self._view

    def data(self) -> memoryview:
        """A new writable memoryview of the slot's first ``length`` bytes (after a load:
        the chunk), released with the slot."""
        self._check()
        n = self.capacity if self.length is None else self.length
        return self._views.make(self._addr, n)

    @property
    def address(self) -> int:
        """The slot's address (for a copy kernel, ``cudaMemcpyAsync``, ...). Valid only
        while the slot is held: the binding cannot revoke a raw address."""
        self._check()
        return self._addr

    def write(self, data: Buffer, offset: int = 0) -> int:
        """Copies ``data`` (any C-contiguous buffer) into the slot at ``offset`` and sets
        ``length`` to ``offset + len(data)``; returns the bytes written."""
        self._check()
        mv = _bytes_view(data)
        try:
            n = mv.nbytes
            if offset < 0 or offset + n > self.capacity:
                raise ValueError(f"{n} bytes at offset {offset} do not fit in slot {self.id} of {self.capacity} bytes")
            self.view[offset : offset + n] = mv
        finally:
            mv.release()
        self.length = offset + n
        return n

    def read(self, n: Optional[int] = None) -> bytes:
        """A copy of the first ``n`` bytes (default ``length``, else ``capacity``)."""
        self._check()
        if n is None:
            n = self.capacity if self.length is None else self.length
        if not 0 <= n <= self.capacity:
            raise ValueError(f"slot {self.id} holds {self.capacity} bytes, not {n}")
        return ctypes.string_at(self._addr, n) if n else b""

    # Release ------------------------------------------------------------------------

    def release(self) -> None:
        """Gives the slot back to libmaru and releases every view it handed out.

        Releasing twice is harmless. Raises :class:`~maru.BusyError` while the slot is
        lent to a running operation, and ``BufferError`` (nothing released, the slot
        stays valid) while an object derived from one of its views (slice, numpy or
        torch array) is alive."""
        if self.busy:
            raise BusyError(Status.BUSY, f"staging slot {self.id} is lent to a running operation: wait for it first")
        self._handler._release_slot(self, "released")

    def _revoke(self) -> int:
        self._view = None
        return self._views.revoke()


class Op(_Scoped):
    """An asynchronous slot operation (:meth:`MaruHandler.submit_store_slots`,
    :meth:`MaruHandler.submit_load_slots`).

    :meth:`poll` (no wait) and :meth:`wait` say whether it finished and raise the
    operation's own error if it failed; :meth:`results` waits and returns per chunk
    whether it was stored (store) or its length / None (load). Its slots are lent to it
    until it finished; then a load's slots have ``length`` and ``key`` set, and slots
    libmaru took back are retired (see :mod:`maru.slots`). Free it
    with :meth:`close` or a ``with`` block (also done when it is garbage collected); an
    operation freed while running still runs to its end.
    """

    def __init__(self, handler: "MaruHandler", kind: str, keys: List[str], slots: List[Slot], ptr: int) -> None:
        self._handler = handler
        self.kind = kind
        self.keys = keys
        self.slots = slots
        self._ptr: Optional[int] = ptr
        self._lock = threading.Lock()
        self._done = False
        self._error: Optional[BaseException] = None
        self._results: Optional[List[Any]] = None

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done else "running")
        return f"<Op {self.kind} of {len(self.keys)} chunks, {state}>"

    def _dropped(self) -> None:
        # Unreachable: so are its slots (they refer to it while it runs), and no
        # bookkeeping is needed; only the C operation is freed (no locks taken here).
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            _capi.op_free(ptr)

    def close(self) -> None:
        """Frees the operation (``maru_op_free``); a running one goes on to its end, its
        slots then stay retired in Python (their results are lost)."""
        with self._lock:
            ptr, self._ptr = self._ptr, None
            if ptr is not None and not self._done:
                self._done = True
                self._error = SlotReleasedError("the operation was freed before it finished")
                for s in self.slots:
                    s._op = None
                    self._handler._release_slot(s, "retired", " (its operation was freed while running)", force=True)
        if ptr is not None:
            _capi.op_free(ptr)

    def _finish(self, err: Optional[MaruError]) -> None:
        """Records the end of the operation (under the lock, once): ``err`` is its
        failure, None when it succeeded (then its results are read)."""
        n = len(self.keys)
        flags: List[bool] = [False] * n
        lens: List[int] = [0] * n
        if err is None:
            assert self._ptr is not None
            try:
                flags, lens = _capi.op_results(self._ptr, n)
            except MaruError as e:
                err = e
        self._done = True
        for s in self.slots:
            s._op = None
        if err is not None:
            self._error = err
            if self.kind == "load":
                for s in self.slots:
                    s.length = s.key = None
            self._handler._settle(
                self.slots, [False] * n, " (its operation failed and libmaru took it back)"
            )
            return
        if self.kind == "load":
            self._results = self._handler._apply_loaded(self.keys, self.slots, flags, lens)
        else:
            self._results = self._handler._apply_stored(self.slots, flags)

    def _refresh(self, timeout_ms: int = 0) -> bool:
        with self._lock:
            if self._done:
                return True
            if self._ptr is None:
                return True
            err: Optional[MaruError] = None
            try:
                if not (_capi.op_wait(self._ptr, timeout_ms) if timeout_ms else _capi.op_poll(self._ptr)):
                    return False
            except MaruError as e:
                err = e
            self._finish(err)
            return True

    @property
    def done(self) -> bool:
        """Whether the operation finished (successfully or not); never raises."""
        return self._refresh()

    def poll(self) -> bool:
        """True when the operation finished, False while it runs; raises its error
        (a :class:`~maru.MaruError`) when it failed."""
        done = self._refresh()
        if self._error is not None:
            raise self._error
        return done

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits up to ``timeout`` seconds (None: until it finishes); True when it
        finished, False when the time passed first. Raises the operation's error."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            left_ms = 200 if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000)
            if self._refresh(min(200, left_ms) if left_ms > 0 else 0):
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
        return self.poll()

    def results(self, timeout: Optional[float] = None) -> List[Any]:
        """Waits for the end (``timeout`` seconds, None: no limit) and returns, per
        chunk, True/False (stored) for a store, the chunk's length or None (a miss or a
        failed transfer) for a load. Raises the operation's error, or
        :class:`~maru.MaruTimeoutError` when ``timeout`` passed first."""
        if not self.wait(timeout):
            raise error_for(Status.TIMEOUT, f"the {self.kind} operation did not finish within {timeout} s")
        assert self._results is not None
        return list(self._results)


def as_lengths(lengths: Union[None, int, Sequence[int]], slots: Sequence[Slot]) -> List[int]:
    """The byte count to store from each slot: ``lengths`` (one int for all, or one
    per slot), else each slot's ``length``."""
    if lengths is None:
        out = []
        for s in slots:
            if s.length is None:
                raise ValueError(f"slot {s.id} has no length: write() into it, set slot.length, or pass lengths")
            out.append(s.length)
        return out
    if isinstance(lengths, int):
        return [lengths] * len(slots)
    out = [int(n) for n in lengths]
    if len(out) != len(slots):
        raise ValueError(f"{len(slots)} slots but {len(out)} lengths")
    return out
