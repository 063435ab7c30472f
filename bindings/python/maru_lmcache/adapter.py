"""``CxlMemoryAdapter``: LMCache's ``MemoryAllocatorInterface`` over a Maru handler.

What LMCache's ``MaruBackend`` does with it, and how each step maps onto the handler:

* ``allocate`` / ``batched_allocate``: ``handler.alloc`` (``batched_alloc``: one
  libmaru call for the batch) takes a page; the memory object returned is the page's,
  built once per page when its region is announced (``set_on_region_added``), so LMCache
  writes the chunk (its GPU copy) straight into the page. On ``cxl`` a page of the
  engine's own region, on ``remote_cxl`` a store staging slot (WRITE from it, no copy).
* ``create_store_handle``: an ``AllocHandle`` naming the page by region and index, which
  ``handler.store`` / ``batch_store`` publish (``cxl``) or store from (``remote_cxl``).
* ``get_by_location``: after ``handler.retrieve``, a memory object over the retrieved
  chunk. It is made from that retrieve's own view (``handler.retrieved_view``), so the
  chunk's lease (``cxl``) or load slot (``remote_cxl``) is held exactly as long as
  LMCache holds the object, and goes back the moment it drops it.
* ``free``: gives an allocated page back (``handler.free`` by region and index).

Addresses are ``(region_id << 32) | page_index``, as upstream's adapter encodes them.
Pages lie at ``page_index`` x maru-server's page size, whatever LMCache's chunk size
(``connect`` refuses a chunk size that does not divide the page size).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from lmcache.logging import init_logger
from lmcache.v1.memory_management import (
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
)

from maru_handler.memory import AllocHandle

logger = init_logger(__name__)

Shapes = Union[torch.Size, List[torch.Size]]
Dtypes = Union[torch.dtype, List[torch.dtype]]


class CxlMemoryAdapter(MemoryAllocatorInterface):
    """LMCache's allocator backed by a Maru handler's pages (see the module docstring).

    ``handler`` is a connected :class:`maru.MaruHandler`; ``shapes``, ``dtypes`` and
    ``fmt`` describe one full chunk (LMCache's metadata); ``chunk_size`` is its size in
    bytes (what ``handler.get_chunk_size()`` returns)."""

    def __init__(self, handler: Any, shapes: List[torch.Size], dtypes: List[torch.dtype], fmt: MemoryFormat, chunk_size: int):
        self._handler = handler
        self._lock = threading.Lock()
        self._shapes = list(shapes)
        self._dtypes = list(dtypes)
        self._fmt = fmt
        self._chunk_size = int(chunk_size)
        # The memory object of each page alloc can hand out, by region.
        self._pool: Dict[int, List[TensorMemoryObj]] = {}
        self._handler.set_on_region_added(self._on_region_added)

    # Addresses ----------------------------------------------------------------------

    @staticmethod
    def encode_address(region_id: int, page_index: int) -> int:
        """``(region_id << 32) | page_index``."""
        return (region_id << 32) | page_index

    @staticmethod
    def decode_address(address: int) -> Tuple[int, int]:
        """``(region_id, page_index)`` of an address."""
        return address >> 32, address & 0xFFFFFFFF

    # Memory objects -----------------------------------------------------------------

    def _page_size(self, region_id: int) -> int:
        get = getattr(self._handler, "get_region_page_size", None)
        size = get(region_id) if get is not None else None
        return int(size) if size else self._chunk_size

    def _metadata(self, address: int, size: int, shape: torch.Size) -> MemoryObjMetadata:
        multi = len(self._shapes) > 1
        return MemoryObjMetadata(
            shape=shape,
            dtype=self._dtypes[0],
            address=address,
            phy_size=size,
            ref_count=1,
            fmt=self._fmt,
            shapes=self._shapes if multi else None,
            dtypes=self._dtypes if multi else None,
        )

    def _object(self, buf: Any, address: int, size: int, single_token_size: int) -> TensorMemoryObj:
        """A memory object over the first ``size`` bytes of ``buf``: the full chunk's
        shape, or for a partial chunk the token dimension cut to its tokens."""
        dtype = self._dtypes[0]
        raw = torch.frombuffer(buf, dtype=dtype, count=size // dtype.itemsize)
        shape = self._shapes[0]
        if size < self._chunk_size:
            dim = self._fmt.token_dim()
            if dim < len(shape) and single_token_size > 0:
                dims = list(shape)
                dims[dim] = size // single_token_size
                shape = torch.Size(dims)
        return TensorMemoryObj(raw, self._metadata(address, size, shape), parent_allocator=None)

    def _on_region_added(self, region_id: int, page_count: int) -> None:
        """Builds the memory object of every page of a region alloc takes pages from
        (the engine's own regions; the staging store region on remote_cxl). Other
        engines' regions are read through retrieved views (get_by_location)."""
        if region_id not in self._handler.get_owned_region_ids():
            return
        page = self._page_size(region_id)
        objs = []
        for p in range(page_count):
            buf = self._handler.get_buffer_view(region_id, p * page, self._chunk_size)
            if buf is None:
                logger.error("[Maru] no view of page %d of region %d: its pages are not used", p, region_id)
                return
            objs.append(self._object(buf, self.encode_address(region_id, p), self._chunk_size, 0))
        with self._lock:
            self._pool[region_id] = objs
        logger.debug("[Maru] region %d: %d pages", region_id, page_count)

    def _single_token_size(self) -> int:
        dim = self._fmt.token_dim()
        shape = self._shapes[0]
        return self._chunk_size // shape[dim] if dim < len(shape) and shape[dim] else 0

    def _page_object(self, handle: Any) -> Optional[MemoryObj]:
        rid, pid = handle.region_id, handle.page_index
        with self._lock:
            pages = self._pool.get(rid)
        if pages is None or pid >= len(pages):
            logger.error("[Maru] page %d of region %d has no memory object", pid, rid)
            return None
        obj = pages[pid]
        size = handle.size
        if size >= self._chunk_size:
            return obj
        # A partial chunk: a view of the page cut to its tokens.
        raw = obj.raw_data[: size // self._dtypes[0].itemsize]
        shape = self._shapes[0]
        dim, one = self._fmt.token_dim(), self._single_token_size()
        if dim < len(shape) and one > 0:
            dims = list(shape)
            dims[dim] = size // one
            shape = torch.Size(dims)
        return TensorMemoryObj(raw, self._metadata(obj.meta.address, size, shape), parent_allocator=None)

    @staticmethod
    def _bytes(shapes: Shapes, dtypes: Dtypes) -> int:
        if isinstance(shapes, torch.Size):
            shapes = [shapes]
        if isinstance(dtypes, torch.dtype):
            dtypes = [dtypes] * len(shapes)
        return sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes))

    # MemoryAllocatorInterface -------------------------------------------------------

    def allocate(
        self, shapes: Shapes, dtypes: Dtypes, fmt: MemoryFormat = MemoryFormat.UNDEFINED, allocator_type: Optional[str] = None
    ) -> Optional[MemoryObj]:
        """A page's memory object for a chunk of ``shapes``/``dtypes`` (its bytes
        decide the size; the object keeps this adapter's shapes, cut to the tokens of a
        partial chunk). None when no page can be had."""
        got = self.batched_allocate(shapes, dtypes, 1, fmt, allocator_type)
        return got[0] if got else None

    def batched_allocate(
        self,
        shapes: Shapes,
        dtypes: Dtypes,
        batch_size: int,
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
        allocator_type: Optional[str] = None,
    ) -> Optional[List[MemoryObj]]:
        """``batch_size`` pages in one handler call (all or none: None)."""
        size = self._bytes(shapes, dtypes)
        if size == 0 or batch_size < 1:
            return None
        many = getattr(self._handler, "batched_alloc", None)
        try:
            handles = many([size] * batch_size) if many is not None else [self._handler.alloc(size) for _ in range(batch_size)]
        except (ValueError, RuntimeError) as e:
            logger.debug("[Maru] alloc of %d page(s) failed: %s", batch_size, e)
            return None
        out = []
        for h in handles:
            obj = self._page_object(h)
            if obj is None:
                for x in handles:
                    self._handler.free(x)
                return None
            out.append(obj)
        return out

    def free(self, memory_obj: MemoryObj, allocator_type: Optional[str] = None) -> None:
        """Gives an allocated, unstored page back (a no-op for one stored already)."""
        rid, pid = self.decode_address(memory_obj.metadata.address)
        try:
            self._handler.free(AllocHandle(buf=memoryview(b""), _region_id=rid, _page_index=pid, _size=0))
        except Exception as e:  # freed already: nothing to give back
            logger.debug("[Maru] free of page %d of region %d: %s", pid, rid, e)

    def batched_free(self, memory_objs: List[MemoryObj], allocator_type: Optional[str] = None, update_stats: bool = True) -> None:
        for obj in memory_objs:
            self.free(obj, allocator_type)

    def close(self) -> None:
        """Stops listening for regions and drops the page objects (before the handler
        closes: they are made from its memory)."""
        self._handler.set_on_region_added(None)
        with self._lock:
            self._pool.clear()

    # Store and retrieve -------------------------------------------------------------

    def create_store_handle(self, memory_obj: MemoryObj) -> AllocHandle:
        """The ``AllocHandle`` ``handler.store`` takes for a filled page: its region and
        index, and the chunk's bytes."""
        rid, pid = self.decode_address(memory_obj.metadata.address)
        return AllocHandle(buf=memoryview(b""), _region_id=rid, _page_index=pid, _size=memory_obj.metadata.phy_size)

    def get_by_location(self, region_id: int, page_index: int, actual_size: int, single_token_size: int) -> Optional[MemoryObj]:
        """The memory object of a chunk just retrieved (``retrieve`` named its page):
        made from that retrieve's view, so its lease or load slot lasts as long as the
        object. Without one (a handler that does not say), a view of the page as mapped.
        None when neither is there."""
        address = self.encode_address(region_id, page_index)
        get = getattr(self._handler, "retrieved_view", None)
        info = get(region_id, page_index) if get is not None else None
        if info is not None:
            try:
                return self._object(info.view, address, actual_size, single_token_size)
            except ValueError:  # released meanwhile (recycled): read it as mapped
                pass
        buf = self._handler.get_buffer_view(region_id, page_index * self._page_size(region_id), actual_size)
        if buf is None:
            logger.debug("[Maru] page %d of region %d is not mapped here", page_index, region_id)
            return None
        return self._object(buf, address, actual_size, single_token_size)
