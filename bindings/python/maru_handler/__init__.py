"""Upstream Maru's ``maru_handler`` import path, served by libmaru's compatibility layer
(:mod:`maru.compat`): ``from maru_handler import MaruHandler`` keeps working. See
docs/migration.md for what differs from the upstream package."""

from maru.compat import MaruConfig, MaruHandler
from maru_handler.memory import AllocHandle, MemoryInfo

__all__ = ["AllocHandle", "MaruConfig", "MaruHandler", "MemoryInfo"]
