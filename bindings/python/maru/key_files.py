"""Checking a key file before a handler proves it, so that a caller (a connector, a
command-line tool) stops at start naming its own setting when the file is missing,
unreadable, open to others or not a key."""

from __future__ import annotations

import os
from typing import Union

from . import _capi


def check_key_file(path: Union[str, "os.PathLike[str]"]) -> None:
    """Checks that ``path`` holds a key a handler can prove (an agent key file,
    maru-server's key file): readable, mode 0600, a key in hex, by libmaru's own loader
    (``maru_key_file_check``). Raises :class:`~maru.ConfigError` naming the file and
    what to do. Whether a daemon holds the same key shows when a handler opens (status
    ``AUTH``)."""
    _capi.key_file_check(os.fspath(path))
