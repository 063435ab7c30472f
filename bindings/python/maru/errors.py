"""Exceptions raised by the binding, one per libmaru status code."""

from __future__ import annotations


class MaruError(Exception):
    """A libmaru call failed. ``code`` is the ``maru_status_t`` value, ``message`` the
    library's own text (``maru_last_error()``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InvalidArgumentError(MaruError):
    """A bad argument (a chunk larger than the chunk size, a NULL, ...)."""


class ConfigError(MaruError):
    """The configuration is wrong; fix it, retrying will not help."""


class UnavailableError(MaruError):
    """No pool could be reached (the handler retries pools in the background)."""


class NotFoundError(MaruError):
    """The key is not stored."""


class RefusedError(MaruError):
    """A daemon refused definitively."""


class NoSpaceError(MaruError):
    """No room (staging buffer, regions)."""


class MaruTimeoutError(MaruError):
    """A transfer did not finish in time."""


class ClosedError(MaruError):
    """The handler is closed."""


# maru_status_t values (include/maru.h) → exception class.
_BY_CODE = {
    1: InvalidArgumentError,  # MARU_ERR_NULL_ARGUMENT
    2: InvalidArgumentError,
    3: ConfigError,
    4: UnavailableError,
    5: NotFoundError,
    6: RefusedError,
    7: NoSpaceError,
    8: MaruTimeoutError,
    13: ClosedError,
}


def error_for(code: int, message: str) -> MaruError:
    """The exception for a status code (``MaruError`` for codes without their own)."""
    return _BY_CODE.get(code, MaruError)(code, message)
