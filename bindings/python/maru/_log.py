"""libmaru's log messages forwarded to Python's :mod:`logging` (``maru_set_log_callback``).

Each message goes to the logger named after the part of libmaru that wrote it, under
``maru.lib`` (``maru::worker::pool`` logs to ``maru.lib.worker.pool``), at the same
level. Forwarding starts when :mod:`maru` is imported, for messages at WARNING and
above; :func:`set_log_level` changes that (``logging.DEBUG`` shows everything), and
:func:`stop_forwarding` gives libmaru back its own stderr output (``MARU_LOG``).

The callback runs on whichever thread logs, libmaru's own threads included, and takes
the GIL for the call.
"""

from __future__ import annotations

import atexit
import logging
import threading

from . import _capi
from .errors import MaruError

#: ``maru_log_level_t`` for each :mod:`logging` level and back.
_TO_C = [(logging.DEBUG - 5, 5), (logging.DEBUG, 4), (logging.INFO, 3), (logging.WARNING, 2), (logging.ERROR, 1)]
_FROM_C = {1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO, 4: logging.DEBUG, 5: logging.DEBUG - 5}

ROOT = "maru.lib"

_lock = threading.Lock()


def _c_level(level: int) -> int:
    """The most verbose ``maru_log_level_t`` that ``level`` lets through."""
    for py, c in _TO_C:
        if level <= py:
            return c
    return 1 if level <= logging.CRITICAL else 0


def _forward(level: int, target: str, message: str) -> None:
    try:
        name = ROOT + ("." + target.split("::", 1)[1].replace("::", ".") if "::" in target else "")
        logger = logging.getLogger(name)
        py_level = _FROM_C.get(level, logging.ERROR)
        if logger.isEnabledFor(py_level):
            # The record names libmaru's module (``maru::worker::pool``) where a record
            # names a file, not this bridge.
            logger.handle(logger.makeRecord(name, py_level, target or "libmaru", 0, "%s", (message,), None))
    except Exception:  # noqa: BLE001 - nothing may cross back into libmaru
        pass


def set_log_level(level: int = logging.WARNING) -> None:
    """Forwards libmaru's messages at ``level`` and above (a :mod:`logging` level) to
    the ``maru.lib`` loggers."""
    with _lock:
        try:
            _capi.set_log_callback(_c_level(level), _forward)
        except MaruError as e:
            raise RuntimeError(f"maru_set_log_callback: {e.message}") from e


def stop_forwarding() -> None:
    """libmaru logs to stderr again, filtered by ``MARU_LOG``/``RUST_LOG``."""
    with _lock:
        try:
            _capi.set_log_callback(0, None)
        except MaruError:
            pass  # nothing to do about it (also runs at exit)


# libmaru's threads must not call into an interpreter that is shutting down.
atexit.register(stop_forwarding)
