"""``MaruHostTensorAllocator``: upstream's name for the allocator of SGLang's host KV
buffer (``HostKVCache``).

Upstream's put the whole host buffer in one CXL region, as a single chunk, so that
``MaruStorage`` could skip its copies. A chunk is a page of maru-server here (the unit
of keys, leases and eviction), and a page as large as the whole host buffer is not
offered, so this allocator gives SGLang an ordinary host tensor, as SGLang's own
allocator does, and says so once in the log: ``MaruStorage`` then copies each page
once between it and Maru (see :mod:`maru_sglang.maru_storage`). Code that asks for it
keeps working.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

try:
    from sglang.srt.mem_cache.memory_pool_host import HostTensorAllocator
except ImportError:  # SGLang not installed (or another version): a base of our own

    class HostTensorAllocator:  # type: ignore[no-redef]
        def __init__(self) -> None:
            self.dtype: Any = None
            self.dims: Any = None


class MaruHostTensorAllocator(HostTensorAllocator):
    """SGLang's host-buffer allocator (see the module docstring): ``allocate`` returns
    a host tensor of ``dims`` and ``dtype``; ``handler`` is None (no Maru region backs
    it) and ``base_ptr`` its address."""

    def __init__(self) -> None:
        super().__init__()
        self._tensor: Optional[torch.Tensor] = None

    @property
    def handler(self) -> None:
        """None: the host buffer is not in a Maru region here."""
        return None

    @property
    def base_ptr(self) -> int:
        """Address of the host buffer (0 before ``allocate``)."""
        return 0 if self._tensor is None else int(self._tensor.data_ptr())

    def allocate(self, dims: tuple, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        self.dims, self.dtype = dims, dtype
        logger.info(
            "MaruHostTensorAllocator: the host KV buffer (%s, %s) is ordinary host memory: a Maru page "
            "as large as the whole buffer is not offered; MaruStorage copies pages to and from it",
            tuple(dims),
            dtype,
        )
        self._tensor = torch.empty(dims, dtype=dtype, device="cpu")
        return self._tensor
