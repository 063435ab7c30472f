"""SGLang's HiCache L3 storage on Maru, under upstream's import path:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "maru", "module_path": "maru_sglang.maru_storage",
        "class_name": "MaruStorage", "maru_server_url": "tcp://127.0.0.1:5555"}'

:class:`MaruStorage` (``maru_sglang.maru_storage``) needs ``sglang`` and ``torch`` and
is imported on first use; :class:`MaruSGLangConfig` (``maru_sglang.config``) reads the
``maru_*`` keys of the extra config. :class:`MaruHostTensorAllocator`
(``maru_sglang.allocator``) is upstream's host-buffer allocator name.
"""

from __future__ import annotations

from typing import Any

from maru_common.logging_setup import setup_package_logging

setup_package_logging("maru_sglang")

from .config import MaruSGLangConfig  # noqa: E402

__all__ = ["MaruHostTensorAllocator", "MaruSGLangConfig", "MaruStorage"]


def __getattr__(name: str) -> Any:
    if name == "MaruStorage":
        from .maru_storage import MaruStorage

        return MaruStorage
    if name == "MaruHostTensorAllocator":
        from .allocator import MaruHostTensorAllocator

        return MaruHostTensorAllocator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
