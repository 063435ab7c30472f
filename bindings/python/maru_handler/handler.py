"""Upstream Maru's ``maru_handler.handler`` import path: ``MaruHandler`` from
:mod:`maru.compat`."""

from maru.compat import MaruHandler

__all__ = ["MaruHandler"]
