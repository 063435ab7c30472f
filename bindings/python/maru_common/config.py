"""Upstream Maru's ``maru_common.config`` import path: ``MaruConfig`` is
:class:`maru.compat.MaruConfig` (upstream's fields, defaults, checks and
``MARU_EAGER_MAP``, plus libmaru's settings)."""

from maru.compat import MaruConfig

__all__ = ["MaruConfig"]
