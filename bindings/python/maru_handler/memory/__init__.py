"""Upstream Maru's ``maru_handler.memory`` import path: ``AllocHandle`` and
``MemoryInfo`` from :mod:`maru.compat` (``from maru_handler.memory import MemoryInfo``,
as the LMCache connector does, keeps working)."""

from maru.compat import AllocHandle, MemoryInfo

__all__ = ["AllocHandle", "MemoryInfo"]
