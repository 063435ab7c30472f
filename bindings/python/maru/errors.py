"""Exceptions raised by the binding, mapped from libmaru's ``maru_status_t`` codes.

Every exception is a :class:`MaruError` carrying ``code`` (the status value) and
``message`` (the library's own text from ``maru_last_error()``, which names what failed,
e.g. the unknown configuration field). Codes without a class of their own (PROTOCOL,
IO, INTERNAL, PANIC, and any code added later) raise plain :class:`MaruError`.

``MARU_PENDING`` (:attr:`Status.PENDING`) is not an error: an asynchronous operation
that has not finished yet. :meth:`maru.Op.poll` and :meth:`maru.Op.wait` turn it into
``False``; :func:`error_for` refuses it (and ``OK``) instead of making an exception of it.
"""

from __future__ import annotations

import enum
from typing import Dict, Optional, Type


class Status(enum.IntEnum):
    """``maru_status_t`` (include/maru.h). The numbers are stable."""

    OK = 0
    NULL_ARGUMENT = 1
    INVALID_ARGUMENT = 2
    CONFIG = 3
    UNAVAILABLE = 4
    NOT_FOUND = 5
    REFUSED = 6
    NO_SPACE = 7
    TIMEOUT = 8
    AUTH = 9
    PROTOCOL = 10
    IO = 11
    BUSY = 12
    CLOSED = 13
    BUFFER_TOO_SMALL = 14
    INTERNAL = 15
    #: Not an error: the asynchronous operation is still running (``maru_op_poll``,
    #: ``maru_op_wait`` past its timeout, ``maru_op_results`` before the end).
    PENDING = 16
    PANIC = 99


def is_error(code: int) -> bool:
    """Whether a ``maru_status_t`` value is a failure (anything but OK and PENDING)."""
    return int(code) not in (Status.OK, Status.PENDING)


class MaruError(Exception):
    """A libmaru call failed. ``code`` is the ``maru_status_t`` value, ``message`` the
    library's own text (``maru_last_error()``)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code: int = int(code)
        self.message: str = message

    @property
    def status(self) -> Optional[Status]:
        """The code as a :class:`Status`, or None for a code this binding does not know."""
        try:
            return Status(self.code)
        except ValueError:
            return None

    def __repr__(self) -> str:
        name = self.status.name if self.status is not None else str(self.code)
        return f"{type(self).__name__}({name}: {self.message!r})"


class InvalidArgumentError(MaruError):
    """A bad argument: a NULL, an empty key, a chunk larger than the chunk size, ...
    (``MARU_ERR_INVALID_ARGUMENT`` and ``MARU_ERR_NULL_ARGUMENT``)."""


class BufferTooSmallError(InvalidArgumentError):
    """The buffer given to ``retrieve_into`` cannot hold the chunk; ``needed`` is the
    chunk's size in bytes (``MARU_ERR_BUFFER_TOO_SMALL``)."""

    def __init__(self, code: int, message: str, needed: int = 0) -> None:
        super().__init__(code, message)
        self.needed: int = needed


class ConfigError(MaruError):
    """The configuration is wrong (``MARU_ERR_CONFIG``); fix it, retrying will not help."""


class UnavailableError(MaruError):
    """No pool could be reached (``MARU_ERR_UNAVAILABLE``); transient."""


class NotFoundError(MaruError):
    """The key, region or pool does not exist (``MARU_ERR_NOT_FOUND``). ``retrieve``
    returns None for a missing key instead of raising this."""


class AuthError(MaruError):
    """A key proof failed (``MARU_ERR_AUTH``): maru-server's (``MARU_SERVER_KEY_FILE``)
    or an agent's (``agent_key_file``) key does not match the daemon's, or the daemon
    does not allow this client. The message names the daemon; retrying will not
    help."""


class RefusedError(MaruError):
    """A daemon refused definitively (``MARU_ERR_REFUSED``); nothing was done."""


class NoSpaceError(MaruError):
    """No pool, region or staging slot can hold the request now (``MARU_ERR_NO_SPACE``)."""


class MaruTimeoutError(MaruError):
    """The operation did not finish within its deadline (``MARU_ERR_TIMEOUT``); its
    outcome is unknown."""


class ClosedError(MaruError):
    """The handler (or a connection) is closed (``MARU_ERR_CLOSED``)."""


class BusyError(MaruError):
    """The object is in use by a running operation (``MARU_ERR_BUSY``), e.g. releasing a
    staging slot lent to an asynchronous store: wait for the operation first."""


class SlotReleasedError(MaruError, ValueError):
    """A staging slot (or a view of one), or a view of a chunk in place
    (:class:`maru.View`), was used after it was released, retired, or its handler
    closed. Its memory may already hold another chunk, so the binding refuses
    every access instead of showing it. Also a ``ValueError``, like the error a released
    ``memoryview`` raises."""

    def __init__(self, message: str) -> None:
        super().__init__(Status.INVALID_ARGUMENT, message)


class ViewExpiredError(SlotReleasedError):
    """A view of a chunk in place (:class:`maru.View`, backend ``cxl``) was used after
    its lease ran out (``valid_ms`` after it was acquired): the chunk's page may hold
    another key's bytes by now, so the binding refuses the access. Acquire it again.
    Also a :class:`SlotReleasedError` and a ``ValueError``."""


class UnsupportedError(MaruError, NotImplementedError):
    """The call exists in the upstream Maru API but libmaru has no equivalent yet; the
    message says what to use instead. Also a ``NotImplementedError``. Nothing was done."""

    def __init__(self, message: str) -> None:
        super().__init__(Status.INTERNAL, message)


_BY_CODE: Dict[int, Type[MaruError]] = {
    Status.NULL_ARGUMENT: InvalidArgumentError,
    Status.INVALID_ARGUMENT: InvalidArgumentError,
    Status.CONFIG: ConfigError,
    Status.UNAVAILABLE: UnavailableError,
    Status.NOT_FOUND: NotFoundError,
    Status.REFUSED: RefusedError,
    Status.AUTH: AuthError,
    Status.NO_SPACE: NoSpaceError,
    Status.TIMEOUT: MaruTimeoutError,
    Status.CLOSED: ClosedError,
    Status.BUSY: BusyError,
    Status.BUFFER_TOO_SMALL: BufferTooSmallError,
}


def error_for(code: int, message: str) -> MaruError:
    """The exception for a status code and message (plain :class:`MaruError` for codes
    without a class of their own). ``OK`` and ``PENDING`` are not errors: ValueError."""
    if not is_error(code):
        raise ValueError(f"status {int(code)} ({Status(int(code)).name}) is not an error")
    return _BY_CODE.get(int(code), MaruError)(int(code), message)
