"""``MaruStorage``: SGLang's HiCache L3 storage (``HiCacheStorage``) on a Maru handler.

Keys are SGLang's page hashes with a suffix naming the model and, unless the model is
MLA (one KV for all ranks), the tensor-parallel rank and size, as upstream's backend
names them, so engines of one model and layout share pages.

The V1 calls move whole host pages:

* ``batch_set_v1``: one ``batched_alloc`` for the keys, each page's K and V (or MLA's
  single part) copied from SGLang's host buffer straight into the allocated page (on
  ``cxl`` the page in CXL itself, on ``remote_cxl`` a store staging slot), then one
  ``batch_store``: each byte is copied once on the host.
* ``batch_get_v1``: one ``batch_retrieve``, each chunk copied from the retrieved view
  into the host pages, then the view released at once (its lease or load slot goes
  back before the call returns).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from maru import MaruHandler

from .config import MaruSGLangConfig

logger = logging.getLogger(__name__)


def _addr(mv: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


class MaruStorage(HiCacheStorage):
    """SGLang HiCache storage on Maru (``cxl`` or ``remote_cxl``); built by SGLang's
    ``StorageBackendFactory`` as ``MaruStorage(storage_config, kwargs)``. A handler that
    fails to connect raises RuntimeError (with the handler's reason)."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.maru_config = MaruSGLangConfig.from_extra_config(getattr(storage_config, "extra_config", None))
        self._handler: Optional[MaruHandler] = None
        self._suffix = self._key_suffix()
        self._connect()

    # Connection ---------------------------------------------------------------------

    def _connect(self) -> None:
        h = MaruHandler(self.maru_config.maru_config())
        if not h.connect():
            raise RuntimeError(f"MaruStorage: cannot connect to {self.maru_config.server_url}: {h.last_error}")
        self._handler = h
        logger.info(
            "MaruStorage connected: server %s, backend %s, chunk %d bytes",
            self.maru_config.server_url,
            h.config.backend,
            self.maru_config.chunk_size_bytes,
        )

    def _ready(self) -> bool:
        if self._handler is not None and self._handler.connected:
            return True
        try:
            self._connect()
            return True
        except RuntimeError as e:
            logger.warning("%s", e)
            return False

    # Keys ---------------------------------------------------------------------------

    def _key_suffix(self) -> str:
        cfg = self.storage_config
        model = "-".join((getattr(cfg, "model_name", None) or "").split("/"))
        if getattr(cfg, "is_mla_model", False):
            return f"_{model}"
        return f"_{model}_{cfg.tp_rank}_{cfg.tp_size}"

    def _key(self, key: str) -> str:
        return f"{key}{self._suffix}"

    # Legacy API ---------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        if not self._ready():
            return False
        try:
            return self._handler.exists(self._key(key))
        except Exception as e:
            logger.error("exists failed: %s", e)
            return False

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many keys from the first on are stored (one round trip)."""
        if not keys or not self._ready():
            return 0
        try:
            found = self._handler.batch_exists([self._key(k) for k in keys])
        except Exception as e:
            logger.error("batch_exists failed: %s", e)
            return 0
        return found.index(False) if False in found else len(found)

    def _into(self, info: Any, target: Any) -> Any:
        """Copies a retrieved chunk into ``target`` (or into a new tensor) and releases
        the view."""
        data = None
        try:
            data = torch.frombuffer(info.view, dtype=torch.uint8)
            if target is None:
                return data.clone()
            out = target.view(torch.uint8).flatten()
            n = min(data.numel(), out.numel())
            out[:n].copy_(data[:n])
            return target
        finally:
            del data
            info.release()

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Optional[torch.Tensor]:
        if not self._ready():
            return None
        try:
            info = self._handler.retrieve(self._key(key))
        except Exception as e:
            logger.error("get failed: %s", e)
            return None
        return None if info is None else self._into(info, target_location)

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> List[Optional[torch.Tensor]]:
        if not keys or not self._ready():
            return [None] * len(keys)
        try:
            infos = self._handler.batch_retrieve([self._key(k) for k in keys])
        except Exception as e:
            logger.error("batch_get failed: %s", e)
            return [None] * len(keys)
        out = []
        for i, info in enumerate(infos):
            target = target_locations[i] if target_locations is not None and i < len(target_locations) else None
            out.append(None if info is None else self._into(info, target))
        return out

    @staticmethod
    def _bytes_of(value: Any) -> memoryview:
        return memoryview(value.contiguous().view(torch.uint8).numpy())

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if value is None or not self._ready():
            return False
        try:
            return self._handler.store(self._key(key), data=self._bytes_of(value))
        except Exception as e:
            logger.error("set failed: %s", e)
            return False

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        if values is None or not keys or not self._ready():
            return False
        try:
            ok = self._handler.batch_store([self._key(k) for k in keys], [self._bytes_of(v) for v in values])
        except Exception as e:
            logger.error("batch_set failed: %s", e)
            return False
        return all(ok)

    # V1 API: whole pages of SGLang's host buffer --------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        layout = getattr(mem_pool_host, "layout", "")
        if not str(layout).startswith("page_first"):
            raise ValueError(
                f"MaruStorage needs a page_first host memory layout, not {layout!r}: "
                "set --hicache-mem-layout page_first_direct"
            )
        super().register_mem_pool_host(mem_pool_host)

    def _parts(self, host_indices: Any, n: int):
        """Host addresses and sizes of each key's parts (2 a key, K and V; 1 for MLA)."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        per = len(ptrs) // n if n else 0
        want = 1 if getattr(self.storage_config, "is_mla_model", False) else 2
        if per != want:
            logger.warning("%d host buffer parts a key where %d were expected", per, want)
        return ptrs, sizes, per

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        n = len(keys)
        if not n or not self._ready():
            return [False] * n
        try:
            ptrs, sizes, per = self._parts(host_indices, n)
            lens = [sum(sizes[i * per : (i + 1) * per]) for i in range(n)]
            handles = self._handler.batched_alloc(lens)
        except Exception as e:
            logger.error("batch_set_v1: no pages for %d keys: %s", n, e)
            return [False] * n
        try:
            for i, h in enumerate(handles):
                dst, at = _addr(h.buf), 0
                for c in range(per):
                    ctypes.memmove(dst + at, ptrs[i * per + c], sizes[i * per + c])
                    at += sizes[i * per + c]
            return self._handler.batch_store([self._key(k) for k in keys], handles)
        except Exception as e:
            logger.error("batch_set_v1 failed: %s", e)
            for h in handles:
                if h.state == "allocated":
                    self._handler.free(h)
            return [False] * n

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        n = len(keys)
        if not n or not self._ready():
            return [False] * n
        try:
            infos = self._handler.batch_retrieve([self._key(k) for k in keys])
            ptrs, sizes, per = self._parts(host_indices, n)
        except Exception as e:
            logger.error("batch_get_v1 failed: %s", e)
            return [False] * n
        out = []
        for i, info in enumerate(infos):
            if info is None:
                out.append(False)
                continue
            mv = None
            try:
                mv = info.view
                src, at = _addr(mv), 0
                for c in range(per):
                    k = min(sizes[i * per + c], len(mv) - at)
                    if k <= 0:
                        break
                    ctypes.memmove(ptrs[i * per + c], src + at, k)
                    at += sizes[i * per + c]
                out.append(True)
            finally:
                del mv
                info.release()
        return out

    # Lifecycle ----------------------------------------------------------------------

    def clear(self) -> None:
        """Nothing to do: maru-server keeps the cache (each engine removes its own keys)."""

    def close(self) -> None:
        if self._handler is not None:
            self._handler.close()
            self._handler = None
