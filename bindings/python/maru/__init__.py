"""The ``maru`` package: Python binding of libmaru.so (ctypes).

    from maru import MaruHandler, chunk_keys
    with MaruHandler({"backend": "remote_cxl", "server_url": "127.0.0.1:5555",
                      "engine_id": "engine-0"}) as h:
        h.store(key, data)
        data = h.retrieve(key)

Set MARU_LIB to the path of libmaru.so to pick a specific build.
"""

from .errors import (
    ClosedError,
    ConfigError,
    InvalidArgumentError,
    MaruError,
    MaruTimeoutError,
    NoSpaceError,
    NotFoundError,
    RefusedError,
    UnavailableError,
)
from .handler import MaruHandler
from .keys import chunk_keys

__all__ = [
    "MaruHandler",
    "chunk_keys",
    "MaruError",
    "ConfigError",
    "UnavailableError",
    "NotFoundError",
    "RefusedError",
    "NoSpaceError",
    "MaruTimeoutError",
    "InvalidArgumentError",
    "ClosedError",
]
