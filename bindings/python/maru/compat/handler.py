"""Upstream's ``MaruHandler`` on libmaru's native handler (see :mod:`maru.compat` for
what is the same and what differs)."""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import handler as _native
from .._scoped import _Scoped
from ..errors import MaruError, NoSpaceError, Status
from ..slots import Slot, SlotPool
from ..views import RemoveResult
from .config import MaruConfig
from .errors import NotConnectedError, PoolExhaustedError, _TRANSIENT
from .memory import AllocHandle, Key, COPY_REGION, MemoryInfo, STAGING_LOAD_REGION, STAGING_STORE_REGION, _deref, _k, _live
from .regions import RegionSurface

log = logging.getLogger("maru.compat")


class MaruHandler(RegionSurface, _Scoped):
    """The upstream ``MaruHandler`` on libmaru. See the module docstring for what is
    the same and what differs; every method's docstring says how it maps.

    Thread-safe like upstream: calls may come from several threads."""

    def __init__(self, config: Optional[MaruConfig] = None) -> None:
        if config is not None and not isinstance(config, MaruConfig):
            raise TypeError(
                f"config must be a maru.MaruConfig, not {type(config).__name__}: maru.MaruHandler is the "
                "upstream-compatible handler; a dict or JSON string configures the native one, maru.Handler(config)"
            )
        self._config = config or MaruConfig()
        self._native: Optional[_native.MaruHandler] = None
        self._leftover: List[_native.MaruHandler] = []
        self._lock = threading.RLock()
        # Retrieved views, oldest first, held weakly: one the caller dropped (with all
        # made from it) goes back to libmaru at once, its lease or slot with it.
        self._retained: "collections.deque[weakref.ref[MemoryInfo]]" = collections.deque()
        self._connected = False
        # Pages taken in place by alloc (cxl), by (region id, page index).
        self._pages: Dict[Tuple[int, int], AllocHandle] = {}
        # Region-added callback, the regions it heard of, and region views handed out.
        self._on_region_added: Any = None
        self._regions_seen: "set[int]" = set()
        self._region_index: List[Dict[str, Any]] = []
        self._staging_info: Optional[Dict[str, int]] = None
        self._deleted = 0  # keys this handler deleted (for get_stats' total_entries)
        self._pages_in_place = False  # _in_place(), set at connect
        self._copies = 0  # the last page number given a retrieved copy (COPY_REGION)
        # The last retrieved view of each (region, page): see retrieved_view.
        self._at: Dict[Tuple[int, int], "weakref.ref[MemoryInfo]"] = {}
        #: The error of the last failed ``connect`` (None after a successful one).
        self.last_error: Optional[BaseException] = None

    def __enter__(self) -> "MaruHandler":
        if self._config.auto_connect:
            self.connect()
        return self

    def __repr__(self) -> str:
        return f"<maru.compat.MaruHandler {self._config.backend} {'connected' if self._connected else 'not connected'}>"

    # Connection ---------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether :meth:`connect` succeeded and :meth:`close` was not called since."""
        return self._connected

    @property
    def instance_id(self) -> str:
        """The configuration's ``instance_id``."""
        return str(self._config.instance_id)

    @property
    def config(self) -> MaruConfig:
        """The configuration."""
        return self._config

    @property
    def native(self) -> _native.MaruHandler:
        """The underlying native :class:`maru.MaruHandler` (slot API, ``route_key``,
        ``retrieve_into``, ...). RuntimeError when not connected."""
        return self._ensure()

    def connect(self) -> bool:
        """Opens the libmaru handler (sessions with maru-server, regions mapped or
        reached through the agents). Returns True on success, False on failure (the
        reason is logged and kept in ``last_error``), as upstream. Connecting again after
        :meth:`close` opens a new handler."""
        with self._lock:
            if self._connected:
                return True
            try:
                h = _native.MaruHandler(self._config.to_libmaru())
            except (MaruError, TypeError, ValueError) as e:
                log.error("maru connect to %s failed: %s", self._config.server_url, e)
                self.last_error = e
                return False
            try:
                chunk = h.chunk_size()
            except MaruError as e:
                h.close()
                log.error("maru connect: %s", e)
                self.last_error = e
                return False
            want = self._config.chunk_size_bytes
            if want > chunk or chunk % want:
                h.close()
                why = "is larger than" if want > chunk else "does not divide"
                self.last_error = ValueError(
                    f"chunk_size_bytes {want} {why} maru-server's chunk size {chunk} (its --chunk-size, the page "
                    f"size): set chunk_size_bytes to {chunk} (or a divisor of it), or restart maru-server with "
                    f"--chunk-size {want}"
                )
                log.error("maru connect: %s", self.last_error)
                return False
            if want < chunk:
                log.warning(
                    "chunk_size_bytes %d is smaller than maru-server's pages (%d bytes): each chunk takes a whole page",
                    want,
                    chunk,
                )
            self._native, self._connected, self.last_error = h, True, None
            self._pages_in_place = self._in_place()
            log.info("Connected: chunk_size=%d (server pages %d)", self._config.chunk_size_bytes, chunk)
            return True

    def close(self) -> None:
        """Releases every retrieved view and outstanding ``alloc`` handle, then closes the
        libmaru handler (drained: the chunks it stored stay readable by others). Never
        raises, as upstream: if an object made from a view (a torch tensor over
        ``info.view``) is still alive, the error is logged and the libmaru handler stays
        open, so that object's memory stays valid, until a later ``close``."""
        with self._lock:
            for h in list(self._leftover):
                try:
                    h.close()
                    self._leftover.remove(h)
                except BufferError:
                    pass
            if not self._connected:
                return
            self._connected = False
            h, self._native = self._native, None
            # Pages still taken go back with the session; region views end with it.
            for a in self._pages.values():
                a._consume("freed")
            self._pages.clear()
            self._region_index = []
            self._staging_info = None
            self._at.clear()
            self._regions_seen.clear()
            while self._retained:
                info = self._retained.popleft()()
                if info is None:
                    continue
                try:
                    info.release()
                except BufferError:
                    pass
        if h is None:
            return
        try:
            h.close()
        except BufferError as e:
            log.error("maru close: %s; the handler stays open until a later close()", e)
            self._leftover.append(h)
        except MaruError as e:
            log.error("maru close: %s", e)

    def _ensure(self) -> _native.MaruHandler:
        h = self._native
        if not self._connected or h is None:
            raise NotConnectedError(13, "Not connected. Call connect() first.")
        return h

    def _multi(self) -> bool:
        return "," in self._config.server_url

    def get_chunk_size(self) -> int:
        """The configured ``chunk_size_bytes`` (as upstream; connect checked that
        maru-server's pages are at least this large)."""
        return self._config.chunk_size_bytes

    # Store ------------------------------------------------------------------------

    def _in_place(self) -> bool:
        """Whether ``alloc`` hands out pages written in place: backend ``cxl``, one pool.
        Otherwise it hands out store staging slots, shown as pages of
        :data:`STAGING_STORE_REGION`."""
        return (self._config.backend or "cxl") == "cxl" and not self._multi()

    def alloc(self, size: int) -> AllocHandle:
        """A handle whose ``buf`` (``size`` bytes, writable) you fill in place, then
        :meth:`store`. On ``cxl`` (one pool) ``buf`` is a page of one of this engine's own
        regions in the mapping (``maru_pages_take``), as upstream: ``store`` publishes
        it, so each byte is moved once. On ``remote_cxl`` (or with several pools) ``buf``
        is a **store staging slot** (``remote_cxl`` WRITEs from it without a copy), named
        as page ``slot index`` of region :data:`STAGING_STORE_REGION`; at most
        ``store_slots`` handles are outstanding. Either way ``region_id`` and
        ``page_index`` name the page, and :meth:`get_buffer_view` reaches it.
        :class:`PoolExhaustedError` (a ValueError, as upstream's exhausted pool) when no
        page or slot can be had within ``timeout_ms``. ``size`` over
        ``chunk_size_bytes`` raises ValueError; 0 too (libmaru stores no empty chunks)."""
        return self.batched_alloc((size,))[0]

    def batched_alloc(self, sizes: Sequence[int]) -> List[AllocHandle]:
        """:meth:`alloc` for several chunks in one libmaru call (``maru_pages_take`` of
        ``len(sizes)`` pages, or ``maru_slots_acquire`` of as many store slots): all or
        none. Raises :class:`PoolExhaustedError` when fewer can be had (those taken go
        back)."""
        h = self._ensure()
        cap = self._config.chunk_size_bytes
        for n in sizes:
            if n > cap:
                raise ValueError(f"Requested size {n} exceeds chunk_size {cap}")
            if n < 1:
                raise ValueError(f"Requested size {n}: libmaru stores no empty chunks")
        if not sizes:
            return []
        if self._pages_in_place:
            try:
                pages = h.take_pages(len(sizes))
            except _TRANSIENT as e:
                raise PoolExhaustedError(e.code, f"Cannot allocate page: {e.message}") from e
            if len(pages) < len(sizes):
                if pages:
                    h.give_back_pages([(p.region_id, p.page) for p in pages])
                raise PoolExhaustedError(
                    Status.NO_SPACE,
                    f"Cannot allocate {len(sizes)} page(s) ({len(pages)} to be had): every page of this engine's "
                    "regions is taken, leased or pinned, and the pool gives no more regions",
                )
            out = [AllocHandle._of_page(p, n) for p, n in zip(pages, sizes)]
            new_region = False
            with self._lock:
                for a, p in zip(out, pages):
                    self._pages[(p.region_id, p.page)] = a
                    new_region = new_region or p.region_id not in self._regions_seen
            if new_region:
                self._announce_regions(h)
            return out
        try:
            slots = h.acquire_slots(SlotPool.STORE, len(sizes), timeout=self._config.timeout_ms / 1000)
        except NoSpaceError as e:
            raise PoolExhaustedError(
                e.code,
                f"Cannot allocate page: all {self._config.store_slots} store staging slots are in use "
                f"(store or free handles, or raise MaruConfig.store_slots): {e.message}",
            ) from e
        if len(slots) < len(sizes):
            h.release_slots(slots)
            raise PoolExhaustedError(
                Status.NO_SPACE,
                f"Cannot allocate {len(sizes)} page(s): only {len(slots)} of {self._config.store_slots} store "
                "staging slots are free (store or free handles, or raise MaruConfig.store_slots)",
            )
        st = self._staging(h)
        base = st["addr"] + st["load_slots"] * st["slot_size"]
        out = []
        with self._lock:
            for s_, n in zip(slots, sizes):
                a = AllocHandle(s_, n, _region_id=STAGING_STORE_REGION, _page_index=(s_._addr - base) // st["slot_size"])
                self._pages[(STAGING_STORE_REGION, a._page_index)] = a
                out.append(a)
        return out

    def _page_of(self, handle: AllocHandle) -> AllocHandle:
        """The outstanding handle ``handle`` names (itself, or the one a keyword-built
        handle names by region and page)."""
        if handle._slot is not None or handle._page is not None:
            return handle
        with self._lock:
            a = self._pages.get((int(handle._region_id or 0), int(handle._page_index or 0)))
        if a is None:
            raise ValueError(
                f"page {handle._page_index} of region {handle._region_id} is not allocated by this handler "
                "(stored or freed already?)"
            )
        return a

    def _forget(self, a: AllocHandle) -> None:
        with self._lock:
            if self._pages.get((a._region_id, a._page_index)) is a:
                del self._pages[(a._region_id, a._page_index)]

    def free(self, handle: AllocHandle) -> None:
        """Gives back a handle's buffer without storing it: its page or slot goes back
        for later allocs (also when named by a keyword-built handle, as LMCache's adapter
        does). After :meth:`store` it is a no-op (unlike upstream the stored chunk is not
        evicted). Freeing twice raises ValueError, as upstream."""
        h = self._ensure()
        if not isinstance(handle, AllocHandle):
            raise TypeError(f"expected an AllocHandle, not {type(handle).__name__}")
        if handle.state == "freed":
            raise ValueError("handle is not tracked (already freed)")
        if handle.state != "allocated":
            handle.state = "freed"
            return
        try:
            a = self._page_of(handle)
        except ValueError:
            raise ValueError("handle is not tracked (already freed)") from None
        self._forget(a)
        a._consume("freed")
        handle.state = "freed"
        if a._page is not None:
            try:
                h.give_back_pages([(a._region_id, a._page_index)])
            except _TRANSIENT as e:
                log.warning("free of page %s of region %s: %s", a._page_index, a._region_id, e)

    def _store_handles(self, h: _native.MaruHandler, keys: List[str], handles: List[AllocHandle]) -> List[bool]:
        """Stores filled handles (or keyword-built ones naming them), each consumed
        whatever the outcome: pages written in place are published
        (``maru_pages_publish``), staging slots stored (``maru_store_slots``)."""
        got = [self._page_of(x) for x in handles]
        lens = []
        for x, a in zip(handles, got):
            n = x._size if x is not a and x._size > 0 else a._size
            cap = a._page.capacity if a._page is not None else a._slot.capacity
            lens.append(min(max(n, 1), cap))
        for a in got:
            self._forget(a)
        out = [False] * len(keys)
        try:
            pi = [i for i, a in enumerate(got) if a._page is not None]
            si = [i for i, a in enumerate(got) if a._page is None]
            if pi:
                res = h.publish_pages([keys[i] for i in pi], [(got[i]._region_id, got[i]._page_index) for i in pi], [lens[i] for i in pi])
                for i, ok in zip(pi, res):
                    out[i] = ok
            if si:
                if self._multi():
                    res = [h.store_slots([keys[i]], [got[i]._slot], [lens[i]], route_key=keys[i])[0] for i in si]
                else:
                    res = h.store_slots([keys[i] for i in si], [got[i]._slot for i in si], [lens[i] for i in si])
                for i, ok in zip(si, res):
                    out[i] = ok
        except _TRANSIENT as e:
            log.warning("store of %d chunk(s) filled in place failed: %s", len(keys), e)
            return [False] * len(keys)
        finally:
            for x, a in zip(handles, got):
                a._consume("stored")
                x.state = "stored"
        return out

    def store(self, key: Key, handle: Any = None, data: Any = None) -> bool:
        """Stores a chunk under ``key``: an :class:`AllocHandle` filled in place (no copy;
        also a keyword-built one naming an allocated page, as LMCache's adapter passes),
        a :class:`MemoryInfo` (its ``view``), or any buffer (bytes, memoryview, numpy
        array; also as ``data=``). Returns True when the chunk is stored or was already
        present (first writer wins), False when it was skipped (pool unreachable or
        slow, no room), as upstream's RPC failure. The handle is consumed either way."""
        if handle is None:
            handle = data
        elif data is not None:
            raise TypeError("give either handle or data, not both")
        if handle is None:
            raise TypeError("store() needs a handle (from alloc) or data")
        return self.batch_store([key], [handle])[0]

    def batch_store(self, keys: Sequence[Key], handles: Sequence[Any]) -> List[bool]:
        """Stores several chunks (``handles[i]`` as for :meth:`store`) in as few calls as
        possible: pages written in place in one ``maru_pages_publish``, staging slots in
        one ``maru_store_slots``, the rest in one ``maru_store_batch``. Per key, what
        :meth:`store` returns ([False] * n when the pool failed, as upstream). Every
        handle is consumed."""
        h = self._ensure()
        keys_s = [_k(k) for k in keys]
        handles = list(handles)
        if len(keys_s) != len(handles):
            raise ValueError("keys and handles must have the same length")
        for x in handles:
            if isinstance(x, AllocHandle) and x.state != "allocated":
                raise ValueError(f"this AllocHandle was already {x.state}")
        out = [False] * len(keys_s)
        hi = [i for i, x in enumerate(handles) if isinstance(x, AllocHandle)]
        if hi:
            got = self._store_handles(h, [keys_s[i] for i in hi], [handles[i] for i in hi])
            for i, ok in zip(hi, got):
                out[i] = ok
        di = [i for i, x in enumerate(handles) if not isinstance(x, AllocHandle)]
        if di:
            items = [(keys_s[i], handles[i].view if isinstance(handles[i], MemoryInfo) else handles[i]) for i in di]
            try:
                if self._multi():
                    got = [h.store(k, d, route_key=k) for k, d in items]
                else:
                    got = h.batch_store(items)
            except _TRANSIENT as e:
                log.error("batch_store of %d keys failed: %s", len(items), e)
                got = [False] * len(items)
            for i, ok in zip(di, got):
                out[i] = ok
        return out

    # Load -------------------------------------------------------------------------

    def _view_budget(self) -> int:
        """Load slots retrieved views may hold at once on ``remote_cxl``: all but one,
        since its copying loads (the fallback) need a free load slot."""
        return self._config.load_slots - 1

    def _retain(self, info: MemoryInfo) -> None:
        with self._lock:
            if len(self._retained) > 2 * max(self._config.max_views, self._config.load_slots):
                self._retained = collections.deque(r for r in self._retained if _live(r))
                self._at = {k: r for k, r in self._at.items() if _live(r)}
            r = weakref.ref(info)
            self._retained.append(r)
            self._at[(info.region_id, info.page_index)] = r

    def _live_views(self) -> int:
        with self._lock:
            return sum(1 for r in self._retained if _live(r))

    def _recycle_one(self, kept: List[MemoryInfo]) -> bool:
        """Releases the oldest retrieved view nothing else refers to; False when none is
        left to recycle."""
        while True:
            with self._lock:
                if not self._retained:
                    return False
                info = self._retained.popleft()()
            if info is None or info.released:
                continue
            try:
                info.release()
                return True
            except BufferError:
                kept.append(info)  # something made from it is alive: never recycled

    def _slots_for(self, h: _native.MaruHandler, n: int) -> List[Slot]:
        """Up to ``n`` free load slots now, within the view budget, recycling the oldest
        retrieved views nothing else refers to (when ``retrieve_recycle``)."""
        got: List[Slot] = []
        kept: List[MemoryInfo] = []
        budget = self._view_budget()
        while len(got) < n:
            with self._lock:
                in_use = self._live_views() + len(kept)
            room = min(n - len(got), budget - in_use - len(got))
            if room > 0:
                try:
                    got += h.acquire_slots(SlotPool.LOAD, room, timeout=0)
                    continue
                except NoSpaceError:
                    pass
            if not self._config.retrieve_recycle or not self._recycle_one(kept):
                break
        with self._lock:
            self._retained.extendleft(weakref.ref(i) for i in reversed(kept))
        return got

    def _views_room(self, n: int) -> int:
        """How many of ``n`` keys may be retrieved as in-place views now (``cxl``), within
        ``max_views``, recycling the oldest retrieved views nothing else refers to (when
        ``retrieve_recycle``)."""
        kept: List[MemoryInfo] = []
        while True:
            with self._lock:
                in_use = self._live_views() + len(kept)
            room = self._config.max_views - in_use
            if room >= n or not self._config.retrieve_recycle or not self._recycle_one(kept):
                break
        with self._lock:
            self._retained.extendleft(weakref.ref(i) for i in reversed(kept))
        return max(0, min(n, room))

    def _load_in_place(self, h: _native.MaruHandler, keys: List[str], out: List[Optional[MemoryInfo]]) -> int:
        """``cxl``: views over the mapped region for as many keys as fit; how many were tried."""
        m = self._views_room(len(keys))
        if not m:
            return 0
        if self._multi():
            views = [h.acquire_view(k, route_key=k) for k in keys[:m]]
        else:
            views = h.acquire_views(keys[:m], route_key=keys[0])
        for i, v in enumerate(views):
            if v is not None:
                info = MemoryInfo._of_view(v, self._config.retrieve_writable)
                loc = self._locate(h, v.address)
                if loc is not None:
                    info.region_id, info.page_index = loc
                out[i] = info
                self._retain(info)
        if any(v is not None for v in views):
            self._announce_regions(h)
        return m

    def _load_into_slots(self, h: _native.MaruHandler, keys: List[str], out: List[Optional[MemoryInfo]]) -> int:
        """``remote_cxl``: loads into free load slots for as many keys as there are;
        how many were tried. Slots of misses go back at once."""
        slots = self._slots_for(h, len(keys))
        m = len(slots)
        if not m:
            return 0
        try:
            if self._multi():
                lens = [h.load_slots([k], [s], route_key=k)[0] for k, s in zip(keys[:m], slots)]
            else:
                lens = h.load_slots(keys[:m], slots, route_key=keys[0])
        except BaseException:
            for s in slots:
                if not s.released:
                    s.release()
            raise
        for i, (s, ln) in enumerate(zip(slots, lens)):
            if ln is not None:
                info = MemoryInfo._of_slot(s, keys[i])
                st = self._staging(h)
                info.region_id, info.page_index = STAGING_LOAD_REGION, (s._addr - st["addr"]) // st["slot_size"]
                out[i] = info
                self._retain(info)
            elif not s.released:
                s.release()  # a plain miss: the slot is still ours, and free for the next load
        return m

    def _retrieve_many(self, keys: List[str]) -> List[Optional[MemoryInfo]]:
        h = self._ensure()
        n = len(keys)
        out: List[Optional[MemoryInfo]] = [None] * n
        if self._config.backend == "cxl":
            m = self._load_in_place(h, keys, out)
        else:
            m = self._load_into_slots(h, keys, out)
        if m < n:
            # No view or slot for the rest: copies into private memory (valid as long as you like).
            rest = keys[m:]
            cap = h.chunk_size()
            bufs = [bytearray(cap) for _ in rest]
            if self._multi():
                lens2 = [h.retrieve_into(k, b, route_key=k) for k, b in zip(rest, bufs)]
            else:
                lens2 = h.batch_retrieve_into(rest, bufs, route_key=keys[0])
            for j, (k, b, ln) in enumerate(zip(rest, bufs, lens2)):
                if ln is not None:
                    info = MemoryInfo(memoryview(b)[:ln])
                    info.key = k
                    # Named as a page of no mapping, so that retrieved_view finds it.
                    with self._lock:
                        self._copies = (self._copies + 1) & 0xFFFF_FFFF
                        info.region_id, info.page_index = COPY_REGION, self._copies
                        self._at[(COPY_REGION, self._copies)] = weakref.ref(info)
                    out[m + j] = info
        return out

    def retrieve(self, key: Key) -> Optional[MemoryInfo]:
        """The chunk stored under ``key`` as a :class:`MemoryInfo` whose ``view`` is its
        bytes, or None on a miss (or when the pool failed, as upstream).

        On ``cxl`` the view lies in the mapped CXL region itself, with no copy, as
        upstream: a read-only :class:`maru.View` holding a lease at maru-server, so the
        chunk's page is not reused (its owner's ``delete`` is refused) while you read it.
        Differs from upstream: it is valid until ``info.release()`` (or ``with info:``),
        :meth:`close`, a :meth:`delete` of the key by this handler, or the end of its
        lease (maru-server's ``--lease-timeout-s``, 60 s by default; ``info.expires_in``),
        and with ``retrieve_recycle`` until a later retrieve needs room once
        ``max_views`` views are held. The view is read-only (upstream's is writable).

        On ``remote_cxl`` the chunk cannot be mapped here (it lives in a memory node's
        CXL): the view is a **load staging slot** the READ landed in, valid until
        ``info.release()``, :meth:`close`, or, with ``retrieve_recycle``, a later
        retrieve that needs its slot once all ``load_slots`` are in use (one load slot
        stays free for copying loads).

        A released view raises ValueError on any use: it never shows another key's
        bytes. Views something was made from (``torch.frombuffer(info.view)``, a slice)
        are never recycled; when no view or slot is left the chunk is copied into
        private memory instead (``info.zero_copy`` False).
        """
        k = _k(key)
        try:
            return self._retrieve_many([k])[0]
        except _TRANSIENT as e:
            log.error("retrieve %s failed: %s", k, e)
            return None

    def batch_retrieve(self, keys: Sequence[Key]) -> List[Optional[MemoryInfo]]:
        """:meth:`retrieve` for several keys in one call (one ``maru_views_acquire`` on
        ``cxl``, one ``maru_load_slots`` on ``remote_cxl``): a MemoryInfo or None per key
        ([None] * n when the pool failed, as upstream). Keys beyond ``max_views`` /
        the free load slots are copied into private memory."""
        ks = [_k(k) for k in keys]
        if not ks:
            return []
        try:
            return self._retrieve_many(ks)
        except _TRANSIENT as e:
            log.error("batch_retrieve of %d keys failed: %s", len(ks), e)
            return [None] * len(ks)

    # Exists, pins, delete ---------------------------------------------------------

    def exists(self, key: Key) -> bool:
        """Whether ``key`` is stored (published)."""
        k = _k(key)
        return self._ensure().exists(k, route_key=k)

    def batch_exists(self, keys: Sequence[Key]) -> List[bool]:
        """Whether each key is stored, in one round trip (``maru_exists_batch``);
        [False] * n when the pool failed, as upstream."""
        h = self._ensure()
        ks = [_k(k) for k in keys]
        try:
            if self._multi():
                return [h.exists(k, route_key=k) for k in ks]
            return h.batch_exists(ks)
        except _TRANSIENT as e:
            log.error("batch_exists of %d keys failed: %s", len(ks), e)
            return [False] * len(ks)

    def pin(self, key: Key) -> bool:
        """Pins ``key`` (``maru_pin_batch``), as upstream's PIN_KV: True when it exists
        and is pinned now. A pinned key is neither evicted nor deleted (by any engine)
        until this handler unpins it or closes; unlike upstream it also ends when its
        memory is lost (the memory node rebooted, its region went back). Pins count per
        handler and key. False when the pool failed."""
        return self.batch_pin([key])[0]

    def unpin(self, key: Key) -> bool:
        """Drops one of this handler's pins of ``key`` (UNPIN_KV): True when it held one."""
        return self.batch_unpin([key])[0]

    def batch_pin(self, keys: Sequence[Key]) -> List[bool]:
        """Pins the leading keys that exist and stops at the first miss, as upstream's
        BATCH_PIN_KV: True for each pinned key, False from the first miss on (those
        after it are not left pinned). [False] * n when the pool failed."""
        ks = [_k(k) for k in keys]
        got = self._pin_calls(ks, True, "batch_pin")
        if False in got:
            first = got.index(False)
            tail = [k for k, p in zip(ks[first:], got[first:]) if p]
            if tail:
                self._pin_calls(tail, False, "batch_pin")
            got = got[:first] + [False] * (len(ks) - first)
        return got

    def batch_unpin(self, keys: Sequence[Key]) -> List[bool]:
        """Drops one pin of each key (BATCH_UNPIN_KV): per key, whether this handler
        held one. [False] * n when the pool failed."""
        return self._pin_calls([_k(k) for k in keys], False, "batch_unpin")

    def _pin_calls(self, ks: List[str], on: bool, what: str) -> List[bool]:
        h = self._ensure()
        if not ks:
            return []
        try:
            if self._multi():
                return [h.pin(k, route_key=k) if on else h.unpin(k, route_key=k) for k in ks]
            return h.batch_pin(ks) if on else h.batch_unpin(ks)
        except _TRANSIENT as e:
            log.error("%s of %d keys failed: %s", what, len(ks), e)
            return [False] * len(ks)

    def delete(self, key: Key) -> bool:
        """Removes ``key`` (``maru_remove_batch``): True when it was removed (no reader
        finds it any more; its page is free for this engine's next stores), False
        otherwise, as upstream's DELETE_KV ``success``: not stored, refused, or the pool
        failed. Refused (logged) when **another engine stored it** (upstream's server
        does not check the owner; libmaru removes only the caller's keys) or while a
        reader holds it (a lease, like upstream's refusal while pinned). This handler's
        own retrieved in-place views of the key (``cxl``) are released first, so they do
        not hold it (they raise on use afterwards); one something was made from is
        kept, and then the key is not removed."""
        return self.batch_delete([key])[0]

    def batch_delete(self, keys: Sequence[Key]) -> List[bool]:
        """:meth:`delete` for several keys in one call (one ``maru_remove_batch``); per
        key, True when removed ([False] * n when the pool failed)."""
        h = self._ensure()
        ks = [_k(k) for k in keys]
        if not ks:
            return []
        self._release_own_views(set(ks))
        try:
            if self._multi():
                res = [h.remove(k, route_key=k) for k in ks]
            else:
                res = h.batch_remove(ks)
        except _TRANSIENT as e:
            log.error("delete of %d keys failed: %s", len(ks), e)
            return [False] * len(ks)
        with self._lock:
            self._deleted += sum(1 for r in res if r is RemoveResult.REMOVED)
        for k, r in zip(ks, res):
            if r is RemoveResult.NOT_OWNER:
                log.warning("delete %s refused: another engine stored it (libmaru removes only this engine's keys)", k)
            elif r is RemoveResult.LEASED:
                log.warning("delete %s refused: a reader holds it now (a lease); try again later", k)
            elif r is RemoveResult.PINNED:
                log.warning("delete %s refused: it is pinned (unpin it first)", k)
        return [r is RemoveResult.REMOVED for r in res]

    def _release_own_views(self, keys: "set[str]") -> None:
        """Releases this handler's retrieved in-place views of ``keys`` (their leases
        would refuse the removal); those something was made from stay."""
        with self._lock:
            infos = [i for i in map(_deref, self._retained) if i is not None and i._mapped is not None and i.key in keys and not i.released]
        for i in infos:
            try:
                v = i._mapped
                assert v is not None
                v._handler._release_view(v, "released", " (this handler deleted its key)")
                i.release()
            except BufferError:
                log.warning("delete %s: a retrieved view of it is still in use (an array made from it), so it stays", i.key)

    def prefetch_batch(self, keys: Sequence[Key]) -> int:
        """How many of ``keys`` are stored (one ``batch_exists``), as upstream's
        prefetch hint returns without a plugin; libmaru has no prefetch plugins."""
        return sum(self.batch_exists(keys))

    # Health and stats -------------------------------------------------------------

    #: The key :meth:`healthcheck` asks for (never stored by the binding).
    HEALTHCHECK_KEY = "__maru_compat_healthcheck__"

    def healthcheck(self) -> bool:
        """True when connected and a pool answers: one round trip to maru-server (an
        ``exists`` of a probe key, as upstream's HEARTBEAT), then whether a pool's
        session is up in ``maru_stats_json`` (a pool that failed to answer the probe is
        set aside by libmaru, and counts as down until its background thread opens a new
        session). With several pools the probe reaches the one its key routes to; True
        when any pool is up. Never raises."""
        h = self._native
        if not self._connected or h is None:
            return False
        try:
            h.exists(self.HEALTHCHECK_KEY, route_key=self.HEALTHCHECK_KEY)
            st = h.stats()
        except MaruError as e:
            log.warning("Healthcheck failed: %s", e)
            return False
        return any(p.get("up") for p in st.get("pools", []))

    def get_stats(self) -> Dict[str, Any]:
        """This handler's libmaru counters (``maru_stats_json``: per pool and ``total``:
        stored, hits, misses, bytes, ...), a ``compat`` part (retrieved views held,
        chunk size), and upstream's sections and fields with this handler's figures:

        * ``kv_manager``: ``total_entries`` (keys this handler stored that it has not
          deleted and that were not evicted), ``total_size`` (their bytes, as far as
          libmaru counts them: stored less evicted), plus ``stored``, ``hits``, ...;
        * ``allocation_manager``: ``num_allocations`` (regions the engine owns),
          ``total_allocated`` (their bytes, where mapped here), ``active_clients`` (1:
          this handler);
        * ``allocator``: ``page_count`` (pages ``alloc`` takes from: of the engine's own
          regions, or the store staging slots), ``free_pages`` (those neither taken by
          ``alloc`` nor holding one of this handler's chunks), ``allocated_pages``,
          ``chunk_size``, ``page_size``.

        Upstream's come from maru-server's GET_STATS (every engine's): run
        ``maru-server stats`` for the server's view."""
        h = self._ensure()
        st = h.stats()
        with self._lock:
            live = [i for i in map(_deref, self._retained) if i is not None and not i.released]
            taken = len(self._pages)
            deleted = self._deleted
        tot = st.get("total") or {}
        regions = h.regions()
        own = [r for r in regions if r["writable"]]
        entries = max(0, tot.get("stored", 0) - tot.get("evictions", 0) - deleted)
        st["kv_manager"] = {
            "total_entries": entries,
            "total_size": max(0, tot.get("bytes_stored", 0) - tot.get("bytes_evicted", 0)),
            "stored": tot.get("stored", 0),
            "already_present": tot.get("already_present", 0),
            "hits": tot.get("hits", 0),
            "misses": tot.get("misses", 0),
            "bytes_stored": tot.get("bytes_stored", 0),
            "evictions": tot.get("evictions", 0),
            "deleted": deleted,
        }
        st["allocation_manager"] = {
            "num_allocations": tot.get("regions", 0),
            "total_allocated": sum(int(r["len"]) for r in own),
            "active_clients": 1,
            "mapped_regions": len(regions),
            "regions_lost": tot.get("regions_lost", 0),
            "regions_given_back": tot.get("regions_given_back", 0),
        }
        if self._in_place():
            pages = sum(int(r["page_count"]) for r in own)
            free = max(0, pages - taken - entries)
            page_size = own[0]["page_size"] if own else h.chunk_size()
        else:
            stg = st.get("staging") or {}
            pages, free = int(stg.get("store_slots", 0)), int(stg.get("free_store_slots", 0))
            page_size = int(stg.get("slot_size", 0)) or h.chunk_size()
        st["allocator"] = {
            "page_count": pages,
            "free_pages": free,
            "allocated_pages": taken,
            "chunk_size": self._config.chunk_size_bytes,
            "page_size": page_size,
            "utilization": (pages - free) / pages if pages else 0.0,
            "store_no_room": tot.get("store_no_room", 0),
        }
        st["compat"] = {
            "instance_id": self.instance_id,
            "chunk_size": self._config.chunk_size_bytes,
            "retained_views": len(live),
            "in_place_views": sum(1 for i in live if i.in_place),
            "load_slots": self._config.load_slots,
            "store_slots": self._config.store_slots,
            "max_views": self._config.max_views,
            "pages_taken_in_place": taken,
            "enable_stats": self._config.enable_stats,
        }
        return st
