"""The compatible API's exceptions: upstream's RuntimeError and ValueError, each
also the :mod:`maru.errors` class it comes from, and the failures upstream reports as
a False or None result."""

from __future__ import annotations

from ..errors import ClosedError, MaruTimeoutError, NoSpaceError, UnavailableError, UnsupportedError


#: Failures upstream reports as a False / None / [False, ...] result instead of raising
#: (its RPC errors): the pool is unreachable or slow. Other errors still raise.
_TRANSIENT = (UnavailableError, MaruTimeoutError, NoSpaceError)


class NotConnectedError(ClosedError, RuntimeError):
    """Upstream's RuntimeError for a call on a handler that is not connected (never
    connected, closed, or closing). Also a :class:`~maru.ClosedError`."""


class PoolExhaustedError(NoSpaceError, ValueError):
    """Upstream's ValueError from ``alloc`` when no page can be had: here, no store
    staging slot became free within ``timeout_ms``. Also a :class:`~maru.NoSpaceError`."""


def _unsupported(what: str, instead: str) -> UnsupportedError:
    return UnsupportedError(f"{what} is not available on libmaru: {instead}")
