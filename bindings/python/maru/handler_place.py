"""The handler's calls on memory in place (:class:`_PlaceCalls`, a part of
:class:`maru.Handler`, backend ``cxl``): pages of own regions taken, written and
published; whole regions as memoryviews; chunks read in place as :class:`~maru.View`
objects or bare spans. The rules of views are in :mod:`maru.views`."""

from __future__ import annotations

import collections
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _capi
from ._args import _keys, _rk
from ._book import _Expirer, _Views
from .errors import MaruError
from .views import View


class PageInfo(collections.namedtuple("PageInfo", "region_id page offset addr capacity buf")):
    """A page of an own region taken for writing a chunk in place (cxl): its region id,
    page index, byte offset in the region, address, capacity and a writable
    memoryview ``buf`` of it."""


def _region_info(r: Any) -> Dict[str, Any]:
    """A mapped region's description (``maru_region_info_t``) as a dict."""
    return {
        "region_id": r.region_id,
        "addr": int(r.data or 0),
        "len": r.len,
        "page_size": r.page_size,
        "page_count": r.page_count,
        "writable": bool(r.writable),
    }


class _PlaceCalls:
    """The in-place methods of :class:`maru.Handler` (its ``_use``, ``_slot_lock``,
    ``_views``, ``_expirer``, ``_releases`` and ``_region_exports`` are the handler's)."""

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
        ks = _keys(keys)
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
        return [_region_info(r) for r in rs]

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
        info = _region_info(r)
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
        ks = _keys(keys)
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
        ks = _keys(keys)
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
