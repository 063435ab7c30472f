"""Bookkeeping of libmaru memory handed to Python: revocable memoryviews over slot and
view memory (:class:`_Views`), and the thread that expires views when their lease
runs out (:class:`_Expirer`). Below :mod:`maru.slots` and :mod:`maru.views`, above
nothing but the standard library: it never calls C itself.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from .handler import MaruHandler
    from .views import View


class _Views:
    """The memoryviews handed out over one region of libmaru memory, revocable.

    Each view is ``memoryview((c_ubyte * n).from_address(addr)).cast("B")``; ctypes
    arrays made ``from_address`` do not own the memory, so releasing the memoryview is
    what cuts Python's access. Derived views (slices, numpy arrays) keep the managed
    buffer, and so the array, alive: ``sys.getrefcount`` on the array tells whether any
    is left (CPython)."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: List[List[Any]] = []  # [array, memoryview or None]

    def make(self, addr: int, n: int, readonly: bool = False) -> memoryview:
        if len(self._items) >= 8:
            self._prune()
        if n == 0:
            arr: Any = (ctypes.c_ubyte * 1).from_address(addr)
            mv = memoryview(arr).cast("B")[:0]
        else:
            arr = (ctypes.c_ubyte * n).from_address(addr)
            mv = memoryview(arr).cast("B")
        if readonly:
            mv = mv.toreadonly()
        self._items.append([arr, mv])
        return mv

    def _prune(self) -> None:
        """Forgets views nobody holds any more (only this list refers to them)."""
        keep = []
        for item in self._items:
            # item[1]: the list's reference, getrefcount's argument; item[0]: the list's
            # and the managed buffer's (while the memoryview lives).
            if item[1] is not None and sys.getrefcount(item[1]) <= 2 and sys.getrefcount(item[0]) <= 3:
                item[1].release()
                continue
            keep.append(item)
        self._items = keep

    def revoke(self) -> int:
        """Releases every view; returns how many arrays are still referenced by objects
        derived from them (0: nothing can reach the memory any more). Raises nothing:
        a view exported to another object is left alive and counted."""
        alive = 0
        keep: List[List[Any]] = []
        for item in self._items:
            mv = item[1]
            if mv is not None:
                try:
                    mv.release()
                    item[1] = None
                except BufferError:  # exported (numpy.frombuffer(view), ...)
                    pass
            del mv
            # item holds one reference and getrefcount's argument another.
            if item[1] is not None or sys.getrefcount(item[0]) > 2:
                alive += 1
                keep.append(item)
        self._items = keep
        return alive


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
            for v in views:
                heapq.heappush(self._heap, (v._deadline, next(self._seq), weakref.ref(v)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="maru-view-expiry", daemon=True)
                self._thread.start()
            else:
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
