"""Upstream Maru's ``maru_handler.memory.types`` import path: ``AllocHandle`` and
``MemoryInfo`` from :mod:`maru.compat`."""

from maru.compat import AllocHandle, MemoryInfo

__all__ = ["AllocHandle", "MemoryInfo"]
