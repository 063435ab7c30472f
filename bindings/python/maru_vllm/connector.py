"""Upstream Maru's ``maru_vllm.connector`` import path: :mod:`maru.vllm.connector`'s
``MaruKVConnector`` (needs vLLM)."""

from maru.vllm.connector import MaruConnectorMetadata, MaruKVConnector

__all__ = ["MaruConnectorMetadata", "MaruKVConnector"]
