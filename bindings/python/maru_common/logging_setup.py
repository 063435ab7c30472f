"""Upstream Maru's ``maru_common.logging_setup``: ``setup_package_logging(name)``
configures a package's logger once (level from ``MARU_LOG_LEVEL``, else
``LMCACHE_LOG_LEVEL``, else INFO; one stream handler) and returns it, as the adapters
(``maru_sglang``, ``maru_lmcache``) expect."""

from __future__ import annotations

import logging
import os

_configured: "set[str]" = set()


def setup_package_logging(package_name: str) -> logging.Logger:
    """The logger of ``package_name``, set up the first time (see the module docstring)."""
    logger = logging.getLogger(package_name)
    if package_name in _configured:
        return logger
    name = os.getenv("MARU_LOG_LEVEL", os.getenv("LMCACHE_LOG_LEVEL", "INFO")).upper()
    level = getattr(logging, name, logging.INFO)
    if not isinstance(level, int):
        level = logging.INFO
    logger.setLevel(level)
    if not logger.handlers:
        h = logging.StreamHandler()
        h.setLevel(level)
        h.setFormatter(logging.Formatter("[%(asctime)s] maru %(levelname)s: %(message)s (%(filename)s:%(lineno)d:%(name)s)"))
        logger.addHandler(h)
        logger.propagate = False
    _configured.add(package_name)
    return logger


__all__ = ["setup_package_logging"]
