"""Upstream Maru's ``maru_common`` import path: ``from maru_common import MaruConfig``
gives :class:`maru.compat.MaruConfig` (the upstream fields and defaults, plus
libmaru's). See docs/migration.md."""

from maru.compat import MaruConfig

__all__ = ["MaruConfig"]
