"""Key arguments as libmaru takes them: a non-empty ``str`` without NUL, UTF-8 encoded,
with the name of the argument in the error when it is not."""

from __future__ import annotations

from typing import List, Optional, Sequence

from .errors import InvalidArgumentError, Status


def _key(k: str, what: str = "key") -> bytes:
    if not isinstance(k, str):
        raise TypeError(f"{what} must be a str, not {type(k).__name__}")
    if not k:
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"{what} is empty")
    if "\0" in k:
        raise InvalidArgumentError(Status.INVALID_ARGUMENT, f"{what} {k!r} contains a NUL character")
    return k.encode("utf-8")


def _keys(keys: Sequence[str], what: str = "keys") -> List[bytes]:
    """Each of ``keys`` as :func:`_key`, named ``what[i]`` in an error."""
    return [_key(k, f"{what}[{i}]") for i, k in enumerate(keys)]


def _rk(route_key: Optional[str]) -> Optional[bytes]:
    return None if route_key is None else _key(route_key, "route_key")
