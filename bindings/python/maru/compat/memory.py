"""Upstream's ``AllocHandle`` (a page or staging slot to fill) and ``MemoryInfo`` (a
retrieved chunk's view), and the region ids the staging slots are named under."""

from __future__ import annotations

import weakref
from typing import Any, Optional, Union

from ..errors import SlotReleasedError
from ..slots import Slot
from ..views import View
from .errors import _unsupported


Key = Union[str, int]


def _k(key: Key) -> str:
    if isinstance(key, bool):
        raise TypeError("a key is a str or an int, not a bool")
    if isinstance(key, int):
        return str(key)
    if isinstance(key, str):
        return key
    raise TypeError(f"a key is a str or an int, not {type(key).__name__}")


class AllocHandle:
    """What :meth:`MaruHandler.alloc` returns: ``buf`` is a writable memoryview of
    ``size`` bytes that you fill in place, then pass the handle to
    :meth:`MaruHandler.store`.

    On ``cxl`` (one pool) ``buf`` is the page itself, in this host's writable mapping of
    one of the engine's own regions, as upstream: ``region_id`` and ``page_index`` name
    it, and ``store`` only publishes it (each byte is moved once, by you). On
    ``remote_cxl`` (and with several pools) ``buf`` is a **store staging slot**
    (``store`` WRITEs from it, no copy), named as page ``page_index`` of region
    :data:`STAGING_STORE_REGION`, so adapters that keep a buffer per page
    (:meth:`MaruHandler.get_buffer_view`) work the same.

    Built by keywords, as upstream's dataclass (``AllocHandle(buf=..., _region_id=...,
    _page_index=..., _size=...)``, what LMCache's adapter passes to ``store`` and
    ``free``), it names a page a previous ``alloc`` of the same handler took.

    ``store`` or ``free`` consumes the handle: ``buf`` is released then, and any use of
    it raises ValueError."""

    def __init__(
        self,
        slot: Optional[Slot] = None,
        size: Optional[int] = None,
        *,
        buf: Any = None,
        _region_id: Optional[int] = None,
        _page_index: Optional[int] = None,
        _size: Optional[int] = None,
    ) -> None:
        self._slot = slot
        self._page: Any = None  # maru.handler.PageInfo of a page taken in place
        self._region_id = _region_id
        self._page_index = _page_index
        self._size = int(size if size is not None else (_size or 0))
        self._buf: Optional[memoryview] = None
        if buf is not None:
            self._buf = buf if isinstance(buf, memoryview) else memoryview(buf)
        self.state = "allocated"  # allocated | stored | freed

    @classmethod
    def _of_page(cls, page: Any, size: int) -> "AllocHandle":
        a = cls(None, size, _region_id=page.region_id, _page_index=page.page)
        a._page = page
        return a

    def __repr__(self) -> str:
        where = f"slot={self._slot.id}" if self._slot is not None else f"region={self._region_id} page={self._page_index}"
        return f"<AllocHandle {self.state} size={self._size} {where}>"

    @property
    def buf(self) -> memoryview:
        """The writable memoryview to fill (``size`` bytes)."""
        if self.state != "allocated":
            raise SlotReleasedError(f"this AllocHandle was {self.state}: its buffer went back to libmaru")
        if self._buf is None:
            if self._slot is not None:
                self._slot.length = self._size
                self._buf = self._slot.data()
            elif self._page is not None:
                self._buf = self._page.buf[: self._size]
            else:
                self._buf = memoryview(b"")
        return self._buf

    @property
    def size(self) -> int:
        """Requested size in bytes."""
        return self._size

    @property
    def region_id(self) -> int:
        """The page's region: one of the engine's own regions (``cxl``), or
        :data:`STAGING_STORE_REGION` for a store staging slot (``remote_cxl``)."""
        if self._region_id is None:
            raise _unsupported(
                "AllocHandle.region_id of a handle that names no page",
                "build it with _region_id and _page_index, or take it from MaruHandler.alloc()",
            )
        return self._region_id

    @property
    def page_index(self) -> int:
        """The page's index in its region (for a staging slot: the slot's index among
        the store slots)."""
        if self._page_index is None:
            self.region_id  # raises
        return int(self._page_index or 0)

    @property
    def slot_id(self) -> Optional[int]:
        """libmaru's id of the store staging slot behind ``buf`` (None for a page)."""
        return None if self._slot is None else self._slot.id

    def _consume(self, state: str) -> None:
        self.state = state
        buf, self._buf = self._buf, None
        if self._page is not None:
            # The page is published (or back): the views handed out over it end, so a
            # late write through them raises instead of changing a published chunk.
            for mv in (buf, self._page.buf):
                try:
                    if mv is not None:
                        mv.release()
                except BufferError:
                    pass  # an array made from it lives on: the caller's to stop using
            return
        if self._slot is not None and not self._slot.released:
            try:
                self._slot.release()
            except BufferError:
                # A numpy/torch array over buf is still alive: give the slot up in Python,
                # libmaru keeps it held until that array is gone.
                self._slot._handler._release_slot(self._slot, "released", " (its handle was consumed)", force=True)


class MemoryInfo:
    """A chunk's bytes as a memoryview (``view``; its length is the chunk's).

    Build one yourself (``MemoryInfo(view=memoryview(data))``) to pass data to
    :meth:`MaruHandler.store` / :meth:`MaruHandler.batch_store`, as the LMCache
    connector does. The ones :meth:`MaruHandler.retrieve` returns lie, with
    ``zero_copy`` True, in the mapped CXL region itself on ``cxl`` (a read-only
    :class:`maru.View` under a lease, as upstream's view of the mapping) or in a load
    staging slot on ``remote_cxl``; or, when none could be had, in private memory
    (``zero_copy`` False). Release them with :meth:`release` or a ``with`` block. After
    that (or after the handler closed, the slot or view was recycled, or a view's lease
    ran out) ``view`` raises ValueError. ``region_id`` and ``page_index`` (0 by default,
    as upstream) name the chunk's page for in-place views on ``cxl``; they are 0 for
    staging-slot views and copies."""

    def __init__(self, view: Any, region_id: int = 0, page_index: int = 0) -> None:
        self._view: Optional[memoryview] = view if isinstance(view, memoryview) else memoryview(view)
        self.region_id = region_id
        self.page_index = page_index
        self.key: Optional[str] = None
        self.zero_copy = False
        self._slot: Optional[Slot] = None
        self._mapped: Optional[View] = None
        self._released = False

    @classmethod
    def _of_slot(cls, slot: Slot, key: str) -> "MemoryInfo":
        m = cls(slot.data())
        m._slot, m.key, m.zero_copy = slot, key, True
        return m

    @classmethod
    def _of_view(cls, v: View, writable_flag: bool = False) -> "MemoryInfo":
        m = cls(v.exported_writable() if writable_flag else v.view)
        m._mapped, m.key, m.zero_copy = v, v.key, True
        return m

    def __repr__(self) -> str:
        state = "released" if self.released else f"{len(self._view or b'')} bytes"
        where = " in place" if self._mapped is not None else (" zero-copy" if self.zero_copy else "")
        return f"<MemoryInfo {self.key!r} {state}{where}>"

    def __enter__(self) -> "MemoryInfo":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    @property
    def in_place(self) -> bool:
        """Whether ``view`` lies in the mapped CXL region itself (``cxl``: a
        :class:`maru.View` under a lease), not in a staging slot or a copy."""
        return self._mapped is not None

    @property
    def expires_in(self) -> Optional[float]:
        """Seconds left before an in-place view's lease runs out (it then raises on
        use); None for slot views and copies, which do not expire."""
        return self._mapped.expires_in() if self._mapped is not None else None

    @property
    def released(self) -> bool:
        """Whether the view was released (by you, the handler's close, recycling, a
        ``delete`` of its key by this handler, or the end of an in-place view's lease)."""
        if self._released:
            return True
        if self._slot is not None:
            return self._slot.released
        if self._mapped is not None:
            return self._mapped.released
        return False

    @property
    def view(self) -> memoryview:
        """The chunk's bytes. Raises :class:`~maru.SlotReleasedError` (a ValueError;
        :class:`~maru.ViewExpiredError` once an in-place view's lease ran out) once
        released."""
        if self.released or self._view is None:
            if self._mapped is not None and self._mapped.expired:
                self._mapped.view  # raises ViewExpiredError
            why = ""
            if self._slot is not None and self._slot.released:
                why = self._slot._why
            elif self._mapped is not None and self._mapped.released:
                why = self._mapped._why
            raise SlotReleasedError(f"the view of chunk {self.key!r} was released{why}; retrieve it again")
        return self._view

    @view.setter
    def view(self, v: Any) -> None:
        if self._slot is not None or self._mapped is not None:
            raise AttributeError("the view of a retrieved chunk cannot be replaced")
        self._view = v if isinstance(v, memoryview) else memoryview(v)

    def release(self) -> None:
        """Gives the view (and its staging slot, or its lease) back. Harmless twice.
        Raises ``BufferError`` (nothing released) while an object made from the view,
        such as ``torch.frombuffer(info.view)`` or a slice, is still alive."""
        if self._released:
            return
        if self._slot is not None:
            if not self._slot.released:
                self._slot.release()
        elif self._mapped is not None:
            self._mapped.release()
        elif self._view is not None:
            try:
                self._view.release()
            except BufferError:
                pass  # private memory: what was made from it keeps it alive, nothing to protect
        self._released = True
        self._view = None


def _deref(r: "weakref.ref[MemoryInfo]") -> Optional[MemoryInfo]:
    return r()


def _live(r: "weakref.ref[MemoryInfo]") -> bool:
    i = r()
    return i is not None and not i.released


#: Where ``alloc`` hands out staging slots (``remote_cxl``, several pools), the region
#: id its handles name: page ``i`` is store staging slot ``i``. Far above the RM's
#: region ids (a counter from 1).
STAGING_STORE_REGION = 0x7FFF_FFFE
#: The region id of the load staging slots ``retrieve`` reads into (``remote_cxl``):
#: a retrieved ``MemoryInfo`` names its slot as a page of it.
STAGING_LOAD_REGION = 0x7FFF_FFFF
#: The region id a retrieved chunk copied into private memory names (when no view or
#: slot could be had): its page is a counter, for :meth:`MaruHandler.retrieved_view`;
#: no mapping has it (``get_buffer_view`` of it is None).
COPY_REGION = 0x7FFF_FFFD
