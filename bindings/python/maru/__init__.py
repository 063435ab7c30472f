"""The ``maru`` package: Python binding of libmaru.so (ctypes), for inference engines that
share KV cache chunks through Maru.

    from maru import Handler, chunk_keys
    cfg = {"backend": "remote_cxl", "server_url": "127.0.0.1:5555", "engine_id": "engine-0",
           "namespace": "llama-3.1-8b/bf16-b16-c256"}
    with Handler(cfg) as h:
        keys = chunk_keys(token_ids, 256, cfg["namespace"])
        h.store(keys[0], kv_bytes, route_key=keys[0])
        data = h.retrieve(keys[0], route_key=keys[0])   # None on a miss

Zero-copy staging slots: ``h.acquire_slots(SlotPool.STORE, n)``, ``h.store_slots``,
``h.load_slots`` and their asynchronous ``submit_*`` forms (:mod:`maru.slots`). On
``cxl``, chunks read in place: ``h.acquire_views(keys)`` (:mod:`maru.views`). Removing
this engine's keys: ``h.remove(key)`` / ``h.batch_remove(keys)`` (:class:`RemoveResult`).

``maru.Handler`` is the native handler (configured by a dict or JSON string).
``maru.MaruConfig`` and ``maru.MaruHandler`` are the upstream Maru package's API, as
upstream code imports it (``from maru import MaruConfig, MaruHandler``): the
compatible handler of :mod:`maru.compat`; see docs/migration.md.

The package carries libmaru.so (``pip install ./bindings/python`` builds it with
cargo); ``MARU_LIB`` names another build to use instead (see :mod:`maru._lib`).
libmaru's log messages go to the ``maru.lib`` loggers of :mod:`logging` (WARNING and
above; :func:`set_log_level` changes that).

Layers, each importing only those below it: ``_lib`` (the C library and its
prototypes), ``errors``, ``keys``; ``_capi`` (a typed wrapper of each C function, the
only module above ``_lib`` that calls C); ``_args`` (key arguments), ``_scoped``
(``with`` and garbage collection), ``_book`` (memory handed to Python), ``_log``,
``hook``; ``slots``, ``views``; ``handler_slots``, ``handler_place`` (the handler's
slot calls and calls on memory in place); ``handler``; ``compat`` (the
upstream-compatible package); this module on top.
"""

import logging as _logging

from ._lib import ABI_VERSION, version
from ._lib import path as library_path
from .errors import (
    AuthError,
    BufferTooSmallError,
    BusyError,
    ClosedError,
    ConfigError,
    InvalidArgumentError,
    MaruError,
    MaruTimeoutError,
    NoSpaceError,
    NotFoundError,
    RefusedError,
    SlotReleasedError,
    Status,
    UnavailableError,
    UnsupportedError,
    ViewExpiredError,
)
from .handler import Handler
from .hook import set_memory_hook, set_memory_hook_auto
from .keys import chunk_keys
from .key_files import check_key_file
from .copies import copy_ranges
from .slots import Op, Slot, SlotPool
from .views import RemoveResult, View
from ._log import set_log_level, stop_forwarding as stop_log_forwarding
from .compat import AllocHandle, MaruConfig, MaruHandler, MemoryInfo

# Forward libmaru's messages to logging from the start, at the level the "maru.lib"
# logger lets through now (WARNING unless the application configured it before).
set_log_level(_logging.getLogger("maru.lib").getEffectiveLevel())

__version__ = "0.1.0"

__all__ = [
    "ABI_VERSION",
    "AllocHandle",
    "AuthError",
    "BufferTooSmallError",
    "BusyError",
    "ClosedError",
    "ConfigError",
    "Handler",
    "InvalidArgumentError",
    "MaruConfig",
    "MaruError",
    "MaruHandler",
    "MaruTimeoutError",
    "MemoryInfo",
    "NoSpaceError",
    "NotFoundError",
    "Op",
    "RefusedError",
    "RemoveResult",
    "Slot",
    "SlotPool",
    "SlotReleasedError",
    "Status",
    "UnavailableError",
    "UnsupportedError",
    "View",
    "ViewExpiredError",
    "check_key_file",
    "chunk_keys",
    "copy_ranges",
    "library_path",
    "set_memory_hook",
    "set_log_level",
    "set_memory_hook_auto",
    "stop_log_forwarding",
    "version",
]
