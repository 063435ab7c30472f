"""Bookkeeping of libmaru memory handed to Python: revocable memoryviews over slot,
view and region memory with an exact count of what reaches them (:class:`_Views`),
the objects on their way back to libmaru (:class:`_Releases`), and the thread that
expires views when their lease runs out (:class:`_Expirer`). Below :mod:`maru.slots`
and :mod:`maru.views`, above nothing but the standard library: it never calls C
itself (the handler passes in the call that gives objects back).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import heapq
import itertools
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from .handler import MaruHandler
    from .views import View


class _Views:
    """The memoryviews handed out over one piece of libmaru memory (a staging slot, a
    view's chunk, a mapped region), revocable, and an exact count of what still reaches
    that memory.

    Each memoryview is made over a ctypes array built ``from_address`` (it does not own
    the memory): that array is the owner object of the export. Everything made from
    the memoryview (slices, ``numpy.frombuffer``, ``torch.frombuffer``, a
    ``ctypes.c_char.from_buffer``) keeps the array alive, and nothing else does, so a
    weak reference to the array says exactly when the last of them is gone: its
    callback runs when the array is freed (at once in CPython, at a collection
    elsewhere; never early). No reference counts are read.

    :meth:`revoke` releases the memoryviews it can (using one afterwards raises
    ValueError) and forgets them all, so only objects the caller made keep the arrays;
    :attr:`live` is how many arrays are still reachable, and :meth:`when_free` calls
    back once none is."""

    __slots__ = ("_mvs", "_live", "_cb", "__weakref__")

    def __init__(self) -> None:
        self._mvs: List[memoryview] = []
        # Weak references to the arrays still alive, by their own id (dict operations are
        # atomic under the GIL: the callbacks may run in any thread, at any point).
        self._live: Dict[int, "weakref.ref[Any]"] = {}
        self._cb: Dict[int, Callable[[], None]] = {}

    def make(self, addr: int, n: int, readonly: bool = False) -> memoryview:
        arr: Any = (ctypes.c_ubyte * max(n, 1)).from_address(addr)
        ref = weakref.ref(arr, self._gone)
        self._live[id(ref)] = ref
        mv = memoryview(arr).cast("B")
        if n == 0:
            mv = mv[:0]
        if readonly:
            mv = mv.toreadonly()
        self._mvs.append(mv)
        return mv

    def _gone(self, ref: "weakref.ref[Any]") -> None:
        self._live.pop(id(ref), None)
        if not self._live:
            cb = self._cb.pop(0, None)  # atomic: runs once however many threads race here
            if cb is not None:
                cb()

    @property
    def live(self) -> int:
        """How many arrays are still reachable (through a memoryview handed out, or an
        object made from one)."""
        return len(self._live)

    def revoke(self) -> int:
        """Releases every memoryview handed out that nothing was exported from (using it
        raises ValueError afterwards) and forgets them all; returns :attr:`live`: 0
        when nothing can reach the memory any more. Raises nothing."""
        mvs, self._mvs = self._mvs, []
        for mv in mvs:
            try:
                mv.release()
            except BufferError:  # exported (numpy.frombuffer(view), ...): its objects own it now
                pass
        del mvs
        return len(self._live)

    def forget(self) -> int:
        """Drops this object's references to the memoryviews handed out without
        releasing them (their holders keep using them); returns :attr:`live`."""
        self._mvs = []
        return len(self._live)

    def when_free(self, cb: Callable[[], None]) -> bool:
        """Arranges for ``cb`` to be called (once, from wherever the last array is freed)
        when nothing reaches the memory any more. Returns True, without calling ``cb``,
        when that is the case already."""
        self._cb[0] = cb
        if not self._live and self._cb.pop(0, None) is not None:
            return True
        return False


class _Releases:
    """libmaru objects (staging slots, views) given up in Python, on their way back to
    libmaru, and the calls that give them back, run as soon as nothing in Python reaches
    their memory.

    :meth:`give_up` is called when Python is done with an object (released, consumed,
    or its owner was garbage collected): the object goes back at once when nothing made
    from its memoryviews is alive, else the moment the last such object is freed
    (:meth:`_Views.when_free`). The callbacks may run anywhere, even inside a call of
    this binding holding a lock, so they only queue; the queue is drained by whoever can
    take the handler's lock without waiting (:meth:`kick`), and every call of the
    handler kicks on its way in and out, so nothing stays queued behind a busy lock."""

    def __init__(self, handler: "MaruHandler", release: Callable[[int, str, List[int]], List[Tuple[str, int]]]) -> None:
        self._handler = weakref.ref(handler)
        self._release = release  # (C handle, kind, ids) -> what could not go back yet
        self._queue: "collections.deque[Tuple[str, int]]" = collections.deque()
        self._later: List[Tuple[str, int]] = []
        # Given up while something made from their memory lives: kind, id -> views.
        self._waiting: Dict[Tuple[str, int], _Views] = {}
        # Per thread: inside batched(), what this thread gives up is queued and goes
        # back at the block's end (another thread's kick may take it earlier).
        self._batching = threading.local()

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Objects this thread gives up inside the block go back together at its end:
        one call per kind (views: one lease release per pool) instead of one each."""
        depth = getattr(self._batching, "depth", 0)
        self._batching.depth = depth + 1
        try:
            yield
        finally:
            self._batching.depth = depth
            if not depth:
                self.kick()

    def give_up(self, kind: str, ident: int, views: _Views, revoke: bool = True) -> None:
        """Python is done with slot or view ``ident``: its memoryviews are released
        (``revoke``; else only forgotten, when its owner object was collected while the
        caller still holds a memoryview of it), and it goes back to libmaru once nothing
        reaches its memory."""
        if revoke:
            views.revoke()
        else:
            views.forget()
        key = (kind, ident)
        self._waiting[key] = views
        if views.when_free(lambda: self._free(key)):
            self._free(key)

    def _free(self, key: Tuple[str, int]) -> None:
        if self._waiting.pop(key, None) is None:
            return
        self._queue.append(key)
        if not getattr(self._batching, "depth", 0):
            self.kick()

    def waiting(self) -> List[Tuple[str, int]]:
        """What is given up and still reachable from Python objects."""
        return [k for k, v in list(self._waiting.items()) if v.live]

    def retry_later(self) -> None:
        """Queues again what libmaru refused for now (a slot lent to an operation that
        was freed while running comes back to the caller at the operation's end)."""
        if self._later:
            later, self._later = self._later, []
            self._queue.extend(later)

    def kick(self) -> None:
        """Gives back what is queued, if the handler's lock can be had at once (else its
        holder does it on its way out)."""
        if not self._queue:
            return
        h = self._handler()
        if h is None:
            return
        while self._queue:
            got = h._try_use()
            if got is None:
                return
            c, closed = got
            try:
                items = []
                while self._queue:
                    items.append(self._queue.popleft())
                if closed:
                    continue  # closing the handler gives everything back
                for kind in ("slot", "view"):
                    ids = [i for k, i in items if k == kind]
                    if ids:
                        self._later += self._release(c, kind, ids)
            finally:
                if not closed:
                    h._done_use()

    def clear(self) -> None:
        self._queue.clear()
        self._later.clear()
        self._waiting.clear()


def _held(ref: "weakref.ref[View]") -> bool:
    v = ref()
    return v is not None and v._state == "held"


class _Expirer:
    """One daemon thread per handler that expires views on time (revokes their
    memoryviews when their lease runs out), started with the first view and ending when
    none is left or the handler closed."""

    def __init__(self, handler: "MaruHandler") -> None:
        self._handler = weakref.ref(handler)
        self._cv = threading.Condition()
        self._heap: List[Tuple[float, int, "weakref.ref[View]"]] = []
        self._seq = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stop = False

    def add(self, views: List[View]) -> None:
        with self._cv:
            if self._stop:
                return
            if len(self._heap) > 4096:
                # Mostly views released long ago: keep only those still held.
                live = [e for e in self._heap if _held(e[2])]
                if len(live) < len(self._heap) // 2:
                    heapq.heapify(live)
                    self._heap = live
            head = self._heap[0][0] if self._heap else None
            for v in views:
                heapq.heappush(self._heap, (v._deadline, next(self._seq), weakref.ref(v)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="maru-view-expiry", daemon=True)
                self._thread.start()
            elif head is None or self._heap[0][0] < head:
                # The thread sleeps until the earliest deadline it saw: it is woken only
                # when that moved earlier. Views acquired later expire later, so most
                # adds (a load's views) wake nobody: waking the thread each time made
                # it take the GIL from the loading thread at every load.
                self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._heap.clear()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and self._heap:
                    wait = self._heap[0][0] - time.monotonic()
                    if wait <= 0:
                        break
                    self._cv.wait(min(wait, 60.0))
                if self._stop or not self._heap:
                    self._thread = None
                    return
                _, _, ref = heapq.heappop(self._heap)
            v = ref()
            h = self._handler()
            if v is not None and h is not None:
                try:
                    h._expire_view(v)
                except Exception:  # pragma: no cover - never let the thread die
                    pass
            del v, h
