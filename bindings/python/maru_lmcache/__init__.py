"""LMCache's Maru adapter, under the import path LMCache's own ``MaruBackend``
(``lmcache/v1/storage_backend/maru_backend.py``) uses:

    from maru_lmcache import CxlMemoryAdapter

:class:`CxlMemoryAdapter` is LMCache's memory allocator over a
:class:`maru.MaruHandler` (the upstream-compatible handler of this package): the
memory objects LMCache fills lie in the pages ``alloc`` hands out (on ``cxl`` pages of
the engine's own regions, on ``remote_cxl`` store staging slots), and the ones it reads
lie in what ``retrieve`` returned (the chunk in place on ``cxl``, the load staging slot
on ``remote_cxl``), held exactly as long as LMCache holds the object.

It is imported on first use (it needs ``torch`` and ``lmcache``), so importing this
package needs neither. ``CxlMemoryAllocator`` is the adapter's older name.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CxlMemoryAdapter"]


def __getattr__(name: str) -> Any:
    if name in ("CxlMemoryAdapter", "CxlMemoryAllocator"):
        from .adapter import CxlMemoryAdapter

        return CxlMemoryAdapter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
