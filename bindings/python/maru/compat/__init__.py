"""The upstream Maru Python API (``MaruConfig``, ``MaruHandler``, ``AllocHandle``,
``MemoryInfo``) on top of libmaru, so adapters written for the upstream package (the
LMCache, SGLang and vLLM integrations) run on Maru in Rust.

Import it under the upstream names, which all work:

    from maru import MaruConfig, MaruHandler       # this module's classes
    from maru_handler import MaruHandler
    from maru_handler.memory import AllocHandle, MemoryInfo
    from maru_common import MaruConfig
    from maru.compat import MaruConfig, MaruHandler

The native handler (configured by a dict or JSON) is ``maru.Handler``; a compatible
handler reaches its own as ``h.native``. The adapters built on this API are in the
packages ``maru_lmcache``, ``maru_sglang`` and ``maru_vllm``.

What is the same: the method names, arguments, return values and their meaning:
``connect() -> bool`` (False, not an exception, when it fails), ``close()``,
``alloc(size)`` then fill ``handle.buf`` in place then ``store(key, handle)``,
``retrieve(key) -> MemoryInfo | None`` whose ``view`` is a memoryview of the chunk,
``exists``, ``batch_store(keys, handles)``, ``batch_retrieve``, ``batch_exists``,
``delete(key) -> bool`` (and ``batch_delete``), ``healthcheck``, ``get_chunk_size``;
RuntimeError when not connected, ValueError for a size over the chunk size or an
exhausted pool. Keys may be str or int (an int is
stored under its decimal string, as the LMCache connector's int keys need).

What differs (docs/migration.md has the full table):

* ``alloc`` on ``cxl`` (one pool) hands out the page itself, as upstream (written in
  place, published by ``store``: each byte moved once), with its ``region_id`` and
  ``page_index``; the LMCache adapter's surface (``set_on_region_added``,
  ``get_buffer_view``, ``get_region_page_count``, keyword-built ``AllocHandle``) works
  on it. On ``remote_cxl`` it hands out a **store staging slot** (WRITE from the slot,
  no copy), named as a page of the staging buffer's store region
  (:data:`STAGING_STORE_REGION`), so the same surface works there; at most
  ``store_slots`` handles are outstanding; ``alloc`` waits ``timeout_ms`` for one, then
  raises ValueError. ``batched_alloc`` takes many in one call. ``store`` (or ``free``)
  consumes the handle: its ``buf`` is released (using it raises).
* ``retrieve`` on ``cxl`` returns a view of the chunk **in the mapped region**, with
  no copy, as upstream, but mapped read-only and under a lease (a :class:`maru.View`): valid
  until ``info.release()`` (or leaving ``with info:``), the handler's close, a
  ``delete`` of the key by this handler, the end of the lease (maru-server's
  ``--lease-timeout-s``, 60 s by default), or, with ``retrieve_recycle`` (the
  default), until a later retrieve needs room once ``max_views`` views are held. On
  ``remote_cxl`` (the chunk lives in a memory node's CXL and cannot be mapped here)
  it is a view of a **load staging slot** the READ landed in (named as a page of
  :data:`STAGING_LOAD_REGION`), valid until released, closed, or recycled once all
  ``load_slots`` are in use (one load slot stays free for the copying fallback below).
  Either way the lease or slot also goes back the moment the ``MemoryInfo`` and
  everything made from its ``view`` are gone (no ``release()`` needed). A view that went
  back raises ``ValueError`` on any use: it never shows another key's bytes. A view from which something was made that
  is still alive (``torch.frombuffer(info.view)``, a slice) is never recycled; when no
  view or slot can be had, the chunk is copied into private memory instead
  (``info.zero_copy`` is False), so retrieve never fails for want of room.
* ``delete`` removes only keys this engine stored (``maru_remove_batch``; another
  engine's key returns False, where upstream's server would delete it) and is refused
  while a reader holds the chunk (a lease; upstream refuses while pinned).
* ``pin``, ``unpin``, ``batch_pin`` and ``batch_unpin`` are maru-server pins
  (``maru_pin_batch``): a pinned key is neither evicted nor deleted until unpinned, as
  upstream; they also end when this handler closes and when the key's memory is lost
  (memory node rebooted, region gone back), where upstream's would outlive them.
* ``free`` after ``store`` does not evict the key (upstream frees the page under it;
  use ``delete``).
* ``get_stats`` carries upstream's sections with this handler's figures, not
  maru-server's GET_STATS;
  ``healthcheck`` probes the pool with one round trip and says whether a session is
  up.
* Upstream-only knobs (``pool_size``, ``use_async_rpc``, ``max_inflight``,
  ``eager_map``, ``auto_expand``, ``expand_size``, ``rm_address``, ``enable_stats``) are
  accepted and validated as upstream does, and have no effect: regions and chunk size
  come from maru-server (``--region-size``, ``--chunk-size``), and ``connect`` fails
  when ``chunk_size_bytes`` does not divide the server's chunk (page) size (the message
  names both). ``MARU_EAGER_MAP`` and ``MARU_STAT`` override ``eager_map`` and
  ``enable_stats`` as upstream (other values: ValueError); ``MARU_STORAGE_BACKEND``,
  ``MARU_AGENT_KEY_FILE``, ``MARU_CACHE_NAMESPACE``, ``MARU_TRANSPORT`` and
  ``MARU_RDMA_DEVICE`` give the fields of ours left unset.
"""

from .config import MaruConfig
from .errors import NotConnectedError, PoolExhaustedError
from .handler import MaruHandler
from .memory import COPY_REGION, STAGING_LOAD_REGION, STAGING_STORE_REGION, AllocHandle, MemoryInfo

__all__ = [
    "AllocHandle",
    "COPY_REGION",
    "MaruConfig",
    "MaruHandler",
    "MemoryInfo",
    "NotConnectedError",
    "PoolExhaustedError",
    "STAGING_LOAD_REGION",
    "STAGING_STORE_REGION",
]
