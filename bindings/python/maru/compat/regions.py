"""The region surface LMCache's adapter builds its buffers from (``get_buffer_view``,
``get_region_page_count``, ``set_on_region_added``, ...), mixed into the compatible
``MaruHandler``: on ``cxl`` the mapped regions, elsewhere the staging buffer named
as two regions whose pages are the store and the load slots."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from .. import handler as _native
from .errors import _unsupported
from .memory import MemoryInfo, STAGING_LOAD_REGION, STAGING_STORE_REGION


class RegionSurface:
    """The region methods of :class:`maru.compat.MaruHandler`."""

    # Regions (LMCache's adapter builds its buffers from them): on cxl the mapped
    # regions; where alloc hands out staging slots (remote_cxl, several pools), the
    # staging buffer too, as two regions whose pages are the store and the load slots.

    def _staging(self, h: _native.MaruHandler) -> Dict[str, int]:
        st = self._staging_info
        if st is None:
            st = self._staging_info = h.staging_buffer()
        return st

    def _staging_regions(self, h: _native.MaruHandler) -> List[Dict[str, Any]]:
        if self._in_place():
            return []
        st = self._staging(h)
        size = st["slot_size"]
        load = {"region_id": STAGING_LOAD_REGION, "addr": st["addr"], "len": size * st["load_slots"],
                "page_size": size, "page_count": st["load_slots"], "writable": False, "staging": True}
        store = {"region_id": STAGING_STORE_REGION, "addr": st["addr"] + load["len"], "len": size * st["store_slots"],
                 "page_size": size, "page_count": st["store_slots"], "writable": True, "staging": True}
        return [store, load]

    def _regions(self, h: _native.MaruHandler, refresh: bool = False) -> List[Dict[str, Any]]:
        if refresh or not self._region_index:
            self._region_index = h.regions() + self._staging_regions(h)
        return self._region_index

    def _locate(self, h: _native.MaruHandler, addr: int) -> Optional[Tuple[int, int]]:
        """(region id, page index) of an address in this host's mappings (listed again
        when it lies in none listed so far: a region mapped since)."""
        for refresh in (False, True):
            for r in self._regions(h, refresh):
                if r["addr"] <= addr < r["addr"] + r["len"] and r["page_size"]:
                    return r["region_id"], (addr - r["addr"]) // r["page_size"]
        return None

    def _announce_regions(self, h: _native.MaruHandler) -> None:
        """Calls the region-added callback for every region mapped since it last ran
        (nothing to do without one: setting one replays every region mapped by then)."""
        cb = self._on_region_added
        if cb is None:
            return
        new = []
        with self._lock:
            for r in self._regions(h, refresh=True):
                if r["region_id"] not in self._regions_seen:
                    self._regions_seen.add(r["region_id"])
                    new.append(r)
        for r in new:
            cb(r["region_id"], r["page_count"])

    def set_on_region_added(self, callback: Any) -> None:
        """Sets ``callback(region_id, page_count)``, called for every region this handler
        maps: at once for those mapped already, then for each new one (an own region
        taken by ``alloc``, another engine's mapped by ``retrieve``), as upstream. None
        removes it. Pages are maru-server's pages (``--chunk-size``). Where ``alloc``
        hands out staging slots (``remote_cxl``), the staging buffer's two regions
        (:data:`STAGING_STORE_REGION`, :data:`STAGING_LOAD_REGION`) are announced at once."""
        h = self._ensure()
        with self._lock:
            self._on_region_added = callback
            self._regions_seen.clear()
        if callback is not None:
            self._announce_regions(h)

    def get_buffer_view(self, region_id: int, offset: int, size: int) -> Optional[memoryview]:
        """A memoryview of ``size`` bytes at ``offset`` of a region this host maps
        (``maru_region_view``): writable for the engine's own regions (write only into
        pages ``alloc`` handed you and you have not stored yet), read-only for other
        engines'; of the staging buffer's regions (``remote_cxl``), writable (write only
        into store slots ``alloc`` handed you). None when the region is not mapped here
        or the range is outside it. The memory stays mapped until :meth:`close`."""
        h = self._ensure()
        r = next((x for x in self._regions(h) if x["region_id"] == region_id), None)
        if r is not None and r.get("staging"):
            if offset < 0 or size < 0 or offset + size > r["len"]:
                return None
            at = r["addr"] - self._staging(h)["addr"] + offset
            return h.staging_view()[at : at + size]
        got = h.region_view(region_id)
        if got is None:
            return None
        mv, info = got
        if offset < 0 or size < 0 or offset + size > info["len"]:
            return None
        return mv[offset : offset + size]

    def get_by_location(self, region_id: int, page_index: int, size: int) -> Optional[memoryview]:
        """The first ``size`` bytes of page ``page_index`` of a region mapped here (what
        LMCache's adapter looks up after a ``retrieve``, whose ``MemoryInfo`` names the
        page): :meth:`get_buffer_view` at ``page_index`` × maru-server's page size. None
        when the region is not mapped here or the range is outside it."""
        r = self._region(region_id)
        if r is None or not 0 <= page_index < int(r["page_count"]) or size > r["page_size"]:
            return None
        return self.get_buffer_view(region_id, page_index * int(r["page_size"]), size)

    def retrieved_view(self, region_id: int, page_index: int) -> Optional[MemoryInfo]:
        """Ours: the live :class:`MemoryInfo` this handler's last ``retrieve`` of page
        ``page_index`` of ``region_id`` returned (None when it was released or dropped
        since). An adapter that reads a retrieved chunk through a buffer of its own
        (LMCache's ``get_by_location``) makes its tensor from ``info.view`` instead, so
        the lease (or load slot) is held exactly as long as that tensor lives."""
        with self._lock:
            r = self._at.get((region_id, page_index))
        info = r() if r is not None else None
        return None if info is None or info.released else info

    def _region(self, region_id: int) -> Optional[Dict[str, Any]]:
        for refresh in (False, True):
            for r in self._regions(self._ensure(), refresh):
                if r["region_id"] == region_id:
                    return r
        return None

    def get_owned_region_ids(self) -> List[int]:
        """The regions ``alloc`` takes pages from: the engine's own regions mapped here
        (``cxl``), the staging store region where ``alloc`` hands out staging slots."""
        return [r["region_id"] for r in self._regions(self._ensure(), refresh=True) if r["writable"]]

    def get_region_page_size(self, region_id: int) -> Optional[int]:
        """Ours: the page size of a region mapped here (maru-server's ``--chunk-size``;
        the slot size on the staging regions); None if none. Pages lie at
        ``page_index`` x this, whatever ``chunk_size_bytes`` is."""
        r = self._region(region_id)
        return None if r is None else int(r["page_size"])

    def get_region_page_count(self, region_id: int) -> Optional[int]:
        """Pages (maru-server's ``--chunk-size``; staging slots on the staging regions)
        of a region mapped here; None if none."""
        r = self._region(region_id)
        return None if r is None else int(r["page_count"])

    @property
    def pool_handle(self) -> Any:
        """Upstream's RM handle of the first owned region: not available. A region's
        handle is the capability that maps and frees it; libmaru keeps it to itself
        (only the owner and maru-server hold it). Raises :class:`~maru.UnsupportedError`;
        :meth:`get_owned_region_ids` and :meth:`get_region_page_count` describe the
        regions."""
        raise _unsupported(
            "MaruHandler.pool_handle (the RM handle of a region)",
            "libmaru keeps region handles to itself; use get_owned_region_ids() and get_region_page_count()",
        )
