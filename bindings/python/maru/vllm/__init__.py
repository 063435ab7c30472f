"""Maru's vLLM KV connector (vLLM V1 API, tested with vLLM 0.32 on CPU).

    LLM(model=..., kv_transfer_config={
        "kv_connector": "MaruKVConnector", "kv_connector_module_path": "maru.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"maru_server_url": "127.0.0.1:5555",
                                      "maru_storage_backend": "cxl"}})

``MaruKVConnector`` is imported on first use, so ``maru.vllm`` (and its logic in
:mod:`maru.vllm.core` and :mod:`maru.vllm.worker`) imports without vLLM or torch
installed. docs/integration.md describes the settings and the limits.
"""

from __future__ import annotations

from typing import Any

from .core import (
    DEFAULT_CHUNK_TOKENS,
    ChunkTransfer,
    SchedulerCore,
    Settings,
    keyspace,
    model_kv_config,
    namespace_digest,
    parse_settings,
)
from .worker import WorkerCore

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "ChunkTransfer",
    "MaruKVConnector",
    "SchedulerCore",
    "Settings",
    "WorkerCore",
    "keyspace",
    "model_kv_config",
    "namespace_digest",
    "parse_settings",
]


def __getattr__(name: str) -> Any:
    if name in ("MaruKVConnector", "MaruConnectorMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'maru.vllm' has no attribute {name!r}")
