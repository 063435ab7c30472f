"""Upstream Maru's vLLM connector module name, served by :mod:`maru.vllm`:

    kv_transfer_config={"kv_connector": "MaruKVConnector",
                        "kv_connector_module_path": "maru_vllm", ...}

loads :class:`maru.vllm.MaruKVConnector` (docs/integration.md has its settings; the
``maru_*`` keys differ from upstream's in places, see docs/migration.md).
``maru_vllm.connector`` is the module upstream's path names, the same connector.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MaruKVConnector"]


def __getattr__(name: str) -> Any:
    if name in ("MaruKVConnector", "MaruConnectorMetadata"):
        from maru.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
