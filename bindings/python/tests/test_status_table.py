"""One table for the C boundary's statuses: each ``maru_status_t`` of include/maru.h,
its value, its meaning (``maru_status_str``) and the Python exception it raises; and
each exception class of the binding, the status it carries. Checked both ways, so a
status added to the header, or an exception class added to the binding, without a
row here fails this test."""

from __future__ import annotations

import re
from pathlib import Path

import maru.compat
import maru.errors as errors
from maru._lib import status_str
from maru.compat.errors import NotConnectedError, PoolExhaustedError

HEADER = Path(__file__).resolve().parents[3] / "include" / "maru.h"

#: name in maru.h: (value, meaning as maru_status_str gives it, exception raised or None
#: for a status that is not an error)
STATUSES = {
    "MARU_OK": (0, "ok", None),
    "MARU_ERR_NULL_ARGUMENT": (1, "null argument", errors.InvalidArgumentError),
    "MARU_ERR_INVALID_ARGUMENT": (2, "invalid argument", errors.InvalidArgumentError),
    "MARU_ERR_CONFIG": (3, "configuration error", errors.ConfigError),
    "MARU_ERR_UNAVAILABLE": (4, "unavailable", errors.UnavailableError),
    "MARU_ERR_NOT_FOUND": (5, "not found", errors.NotFoundError),
    "MARU_ERR_REFUSED": (6, "refused", errors.RefusedError),
    "MARU_ERR_NO_SPACE": (7, "no space", errors.NoSpaceError),
    "MARU_ERR_TIMEOUT": (8, "timed out", errors.MaruTimeoutError),
    "MARU_ERR_AUTH": (9, "authentication failed", errors.AuthError),
    "MARU_ERR_PROTOCOL": (10, "protocol error", errors.MaruError),
    "MARU_ERR_IO": (11, "I/O error", errors.MaruError),
    "MARU_ERR_BUSY": (12, "busy", errors.BusyError),
    "MARU_ERR_CLOSED": (13, "closed", errors.ClosedError),
    "MARU_ERR_BUFFER_TOO_SMALL": (14, "buffer too small", errors.BufferTooSmallError),
    "MARU_ERR_INTERNAL": (15, "internal error", errors.MaruError),
    "MARU_PENDING": (16, "pending", None),
    "MARU_ERR_PANIC": (99, "panic inside libmaru", errors.MaruError),
}

#: Exception classes raised by the binding itself rather than for a status code, and
#: the status each carries (its ``code``), with how one is made.
RAISED_BY_BINDING = {
    errors.SlotReleasedError: ("MARU_ERR_INVALID_ARGUMENT", lambda: errors.SlotReleasedError("m")),
    errors.ViewExpiredError: ("MARU_ERR_INVALID_ARGUMENT", lambda: errors.ViewExpiredError("m")),
    errors.UnsupportedError: ("MARU_ERR_INTERNAL", lambda: errors.UnsupportedError("m")),
    NotConnectedError: ("MARU_ERR_CLOSED", lambda: NotConnectedError(13, "m")),
    PoolExhaustedError: ("MARU_ERR_NO_SPACE", lambda: PoolExhaustedError(7, "m")),
}


def header_statuses() -> dict:
    text = HEADER.read_text()
    body = re.search(r"^enum maru_status_t\b[^{]*\{(.*?)^\};", text, re.S | re.M)
    assert body is not None, "maru_status_t not found in include/maru.h"
    return {n: int(v) for n, v in re.findall(r"^\s*(MARU_\w+)\s*=\s*(\d+),", body.group(1), re.M)}


def all_exception_classes() -> set:
    """Every MaruError subclass the binding defines (maru and maru.compat)."""
    seen, todo = set(), [errors.MaruError]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            if s.__module__.startswith("maru.") and s not in seen:
                seen.add(s)
                todo.append(s)
    return seen | {errors.MaruError}


def test_every_header_status_has_one_row_and_every_row_is_in_the_header():
    header = header_statuses()
    assert header, "no status parsed from include/maru.h"
    assert set(header) == set(STATUSES), (
        f"in maru.h without a row: {sorted(set(header) - set(STATUSES))}; "
        f"rows not in maru.h: {sorted(set(STATUSES) - set(header))}"
    )
    for name, value in header.items():
        assert STATUSES[name][0] == value, name


def test_python_status_enum_is_the_header():
    assert {f"MARU_ERR_{s.name}" if s.name not in ("OK", "PENDING") else f"MARU_{s.name}": int(s)
            for s in errors.Status} == header_statuses()


def test_each_status_has_its_meaning_and_its_exception():
    for name, (value, meaning, exc) in STATUSES.items():
        assert status_str(value) == meaning, name
        if exc is None:
            assert not errors.is_error(value), name
            continue
        e = errors.error_for(value, "m")
        assert type(e) is exc, f"{name}: {type(e).__name__}, table says {exc.__name__}"
        assert e.code == value


def test_every_exception_class_has_its_status():
    by_status = {exc for (_, _, exc) in STATUSES.values() if exc is not None}
    classes = all_exception_classes()
    unmapped = classes - by_status - set(RAISED_BY_BINDING)
    assert not unmapped, f"exception classes without a status row: {sorted(c.__name__ for c in unmapped)}"
    for cls, (name, make) in RAISED_BY_BINDING.items():
        e = make()
        assert type(e) is cls
        assert e.code == STATUSES[name][0], cls.__name__
    # Each status-raised class is raised for the statuses its rows name, and no other.
    for cls in by_status - {errors.MaruError}:
        codes = {v for (v, _, exc) in STATUSES.values() if exc is cls}
        for value in codes:
            assert type(errors.error_for(value, "m")) is cls
    assert maru.compat.NotConnectedError is NotConnectedError
