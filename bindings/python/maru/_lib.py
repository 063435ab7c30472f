"""Finding and loading libmaru.so, and the C prototypes of include/maru.h. With
:mod:`maru._capi` (typed wrappers of every C function) it is the C-call layer that
every other module builds on: no other module calls libmaru.

The library is looked for, in order:

1. ``$MARU_LIB`` (a path to the ``.so``, or a directory holding ``libmaru.so``); when it
   is set and wrong, the import fails instead of falling back to another build;
2. the library inside this package (``maru/libmaru*.so``): the wheel built by
   ``pip install ./bindings/python`` carries it;
3. ``ctypes.util.find_library("maru")``: a system install (``make install``).

The current directory is never searched (a library planted there is never loaded).
Importing checks ``maru_abi_version()`` against :data:`ABI_VERSION`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import List, Optional

#: The C ABI version this binding was written for (``MARU_ABI_VERSION`` in maru.h).
ABI_VERSION = 1

c_bool_p = ctypes.POINTER(ctypes.c_bool)
c_size_p = ctypes.POINTER(ctypes.c_size_t)
c_char_pp = ctypes.POINTER(ctypes.c_char_p)
c_void_pp = ctypes.POINTER(ctypes.c_void_p)


def candidates() -> List[Path]:
    """The libraries inside this package, in the order they are tried (without
    ``$MARU_LIB``): ``libmaru.so``, then a build backend's ``libmaru.*.so``."""
    here = Path(__file__).resolve().parent
    return [here / "libmaru.so", *sorted(here.glob("libmaru.*.so"))]


def _open(path: str) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(f"cannot load libmaru from {path}: {e}") from e


def _load() -> ctypes.CDLL:
    env = os.environ.get("MARU_LIB")
    if env:
        p = Path(env)
        if not p.is_absolute():
            # dlopen would resolve a relative path against the working directory of
            # the moment (`sub/../libmaru.so`) or, without a slash (`./` is dropped by
            # Path), search the loader's path for a bare name: neither is where it says.
            raise ImportError(
                f"MARU_LIB={env} is a relative path: give the absolute path of libmaru.so "
                "or of the directory holding it (or unset MARU_LIB to use the package's own library)"
            )
        if p.is_dir():
            p = p / "libmaru.so"
        if not p.is_file():
            raise ImportError(f"MARU_LIB={env} is not libmaru.so (no such file: {p})")
        return _open(str(p))
    tried = candidates()
    for p in tried:
        if p.is_file():
            return _open(str(p))
    found = ctypes.util.find_library("maru")
    if found:
        return _open(found)
    raise ImportError(
        "libmaru.so not found: install the package with its library (pip install ./bindings/python, "
        "which builds it with cargo), install libmaru (make install), or set MARU_LIB to its path.\n"
        "Looked in (MARU_LIB unset):\n  "
        + "\n  ".join(str(p) for p in tried)
        + '\n  ctypes.util.find_library("maru") (nothing)'
    )


lib = _load()
#: The file the library was loaded from (or the name ``find_library`` gave).
path: str = lib._name

lib.maru_abi_version.argtypes = []
lib.maru_abi_version.restype = ctypes.c_uint32
lib.maru_version_string.argtypes = []
lib.maru_version_string.restype = ctypes.c_char_p
lib.maru_last_error.argtypes = []
lib.maru_last_error.restype = ctypes.c_char_p
lib.maru_status_str.argtypes = [ctypes.c_uint32]
lib.maru_status_str.restype = ctypes.c_char_p

_H = ctypes.c_void_p
_S = ctypes.c_uint32
lib.maru_handler_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(_H)]
lib.maru_handler_open.restype = _S
lib.maru_handler_close.argtypes = [_H]
lib.maru_handler_close.restype = _S
lib.maru_handler_shutdown.argtypes = [_H]
lib.maru_handler_shutdown.restype = _S
lib.maru_handler_free.argtypes = [_H]
lib.maru_handler_free.restype = _S
lib.maru_store.argtypes = [_H, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, c_bool_p]
lib.maru_store.restype = _S
lib.maru_store_batch.argtypes = [_H, c_char_pp, c_void_pp, c_size_p, ctypes.c_size_t, ctypes.c_char_p, c_bool_p]
lib.maru_store_batch.restype = _S
lib.maru_load.argtypes = [_H, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, c_size_p, ctypes.c_char_p]
lib.maru_load.restype = _S
lib.maru_load_batch.argtypes = [_H, c_char_pp, c_void_pp, c_size_p, c_size_p, c_bool_p, ctypes.c_size_t, ctypes.c_char_p]
lib.maru_load_batch.restype = _S
lib.maru_exists.argtypes = [_H, ctypes.c_char_p, ctypes.c_char_p, c_bool_p]
lib.maru_exists.restype = _S
lib.maru_stats_json.argtypes = [_H, ctypes.c_char_p, ctypes.c_size_t, c_size_p]
lib.maru_stats_json.restype = _S
lib.maru_chunk_size.argtypes = [_H, ctypes.POINTER(ctypes.c_uint64)]
lib.maru_chunk_size.restype = _S

if lib.maru_abi_version() != ABI_VERSION:
    raise ImportError(
        f"libmaru at {path} has ABI {lib.maru_abi_version()}, this binding needs {ABI_VERSION}: "
        "install the binding that came with the library (or point MARU_LIB at a matching build)"
    )


def last_error() -> str:
    """This thread's last libmaru error message ("" when the last call succeeded)."""
    msg: Optional[bytes] = lib.maru_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def status_str(code: int) -> str:
    """libmaru's short description of a status code, such as ``"not found"``."""
    s: Optional[bytes] = lib.maru_status_str(code)
    return s.decode("utf-8", "replace") if s else "unknown status"


def version() -> str:
    """libmaru's version, such as ``"0.1.0"``."""
    v: Optional[bytes] = lib.maru_version_string()
    return v.decode("utf-8", "replace") if v else ""

# The zero-copy slot API, asynchronous operations, batched exists and the memory hook.


class maru_slot_t(ctypes.Structure):
    """``maru_slot_t``: one staging slot held by the caller."""

    _fields_ = [("id", ctypes.c_uint64), ("data", ctypes.c_void_p), ("capacity", ctypes.c_size_t)]


c_u64_p = ctypes.POINTER(ctypes.c_uint64)
_OP = ctypes.c_void_p  # maru_op_t *
#: ``maru_mem_register_fn``: ``int32_t (*)(void *ctx, void *ptr, size_t len)``.
MEM_REGISTER_FN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
#: ``maru_mem_unregister_fn``: ``void (*)(void *ctx, void *ptr, size_t len)``.
MEM_UNREGISTER_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

lib.maru_exists_batch.argtypes = [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, c_bool_p]
lib.maru_exists_batch.restype = _S
lib.maru_slots_acquire.argtypes = [
    _H, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_uint32, ctypes.POINTER(maru_slot_t), c_size_p
]
lib.maru_slots_acquire.restype = _S
lib.maru_slots_release.argtypes = [_H, c_u64_p, ctypes.c_size_t]
lib.maru_slots_release.restype = _S
lib.maru_store_slots.argtypes = [_H, c_char_pp, c_u64_p, c_size_p, ctypes.c_size_t, ctypes.c_char_p, c_bool_p]
lib.maru_store_slots.restype = _S
lib.maru_load_slots.argtypes = [_H, c_char_pp, c_u64_p, ctypes.c_size_t, ctypes.c_char_p, c_size_p, c_bool_p]
lib.maru_load_slots.restype = _S
lib.maru_submit_store_slots.argtypes = [
    _H, c_char_pp, c_u64_p, c_size_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(_OP)
]
lib.maru_submit_store_slots.restype = _S
lib.maru_submit_load_slots.argtypes = [_H, c_char_pp, c_u64_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(_OP)]
lib.maru_submit_load_slots.restype = _S
lib.maru_op_poll.argtypes = [_OP]
lib.maru_op_poll.restype = _S
lib.maru_op_wait.argtypes = [_OP, ctypes.c_uint32]
lib.maru_op_wait.restype = _S
lib.maru_op_results.argtypes = [_OP, c_bool_p, c_size_p, ctypes.c_size_t]
lib.maru_op_results.restype = _S
lib.maru_op_free.argtypes = [_OP]
lib.maru_op_free.restype = None
lib.maru_set_memory_hook.argtypes = [MEM_REGISTER_FN, MEM_UNREGISTER_FN, ctypes.c_void_p]
lib.maru_set_memory_hook.restype = _S
lib.maru_set_memory_hook_auto.argtypes = []
lib.maru_set_memory_hook_auto.restype = _S

# Removal of own keys, slot ownership after a call, and in-place views (cxl).


class maru_view_t(ctypes.Structure):
    """``maru_view_t``: a chunk read in place from this host's mapping (backend cxl)."""

    _fields_ = [
        ("id", ctypes.c_uint64),
        ("data", ctypes.c_void_p),
        ("len", ctypes.c_size_t),
        ("valid_ms", ctypes.c_uint64),
    ]


lib.maru_remove_batch.argtypes = [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32)]
lib.maru_remove_batch.restype = _S
lib.maru_pin_batch.argtypes = [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, c_bool_p]
lib.maru_pin_batch.restype = _S
lib.maru_unpin_batch.argtypes = [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, c_bool_p]
lib.maru_unpin_batch.restype = _S
lib.maru_slots_held.argtypes = [_H, c_u64_p, ctypes.c_size_t, c_bool_p]
lib.maru_slots_held.restype = _S
lib.maru_views_acquire.argtypes = [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(maru_view_t), c_bool_p]
lib.maru_views_acquire.restype = _S
lib.maru_views_release.argtypes = [_H, c_u64_p, ctypes.c_size_t]
lib.maru_views_release.restype = _S

# Logging and chunk keys.

#: ``maru_log_fn``: ``void (*)(void *ctx, maru_log_level_t level, const char *target,
#: const char *message)``.
LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_char_p)
lib.maru_set_log_callback.argtypes = [ctypes.c_uint32, LOG_FN, ctypes.c_void_p]
lib.maru_set_log_callback.restype = _S

#: ``MARU_CHUNK_KEY_SIZE``: bytes of one key in ``maru_chunk_keys``' output.
CHUNK_KEY_SIZE = 65
lib.maru_chunk_keys.argtypes = [
    ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t, ctypes.c_size_t, ctypes.c_char_p,
    ctypes.c_char_p, ctypes.c_size_t, c_size_p,
]
lib.maru_chunk_keys.restype = _S
lib.maru_key_file_check.argtypes = [ctypes.c_char_p]
lib.maru_key_file_check.restype = _S


class maru_copy_t(ctypes.Structure):
    """``maru_copy_t``: one piece of a ``maru_copy``."""

    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("len", ctypes.c_size_t)]


lib.maru_copy.argtypes = [ctypes.POINTER(maru_copy_t), ctypes.c_size_t, ctypes.c_bool]
lib.maru_copy.restype = _S


class maru_piece_t(ctypes.Structure):
    """``maru_piece_t``: one piece of a chunk that ``maru_load_pieces`` copies."""

    _fields_ = [("chunk", ctypes.c_size_t), ("offset", ctypes.c_size_t), ("dst", ctypes.c_void_p), ("len", ctypes.c_size_t)]


lib.maru_load_pieces.argtypes = [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(maru_piece_t),
                                 ctypes.c_size_t, c_size_p, c_bool_p]
lib.maru_load_pieces.restype = _S

# Writes in place and region views (cxl).


class maru_page_t(ctypes.Structure):
    """``maru_page_t``: a page of an own region taken for writing a chunk in place."""

    _fields_ = [
        ("region_id", ctypes.c_uint64),
        ("page", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("data", ctypes.c_void_p),
        ("capacity", ctypes.c_size_t),
    ]


class maru_region_t(ctypes.Structure):
    """``maru_region_t``: a region this host maps (backend cxl)."""

    _fields_ = [
        ("region_id", ctypes.c_uint64),
        ("data", ctypes.c_void_p),
        ("len", ctypes.c_size_t),
        ("page_size", ctypes.c_uint64),
        ("page_count", ctypes.c_uint64),
        ("writable", ctypes.c_bool),
    ]


lib.maru_pages_take.argtypes = [_H, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(maru_page_t), c_size_p]
lib.maru_pages_take.restype = _S
lib.maru_pages_publish.argtypes = [_H, c_char_pp, ctypes.POINTER(maru_page_t), c_size_p, ctypes.c_size_t, c_bool_p]
lib.maru_pages_publish.restype = _S
lib.maru_pages_give_back.argtypes = [_H, ctypes.POINTER(maru_page_t), ctypes.c_size_t]
lib.maru_pages_give_back.restype = _S
lib.maru_regions_list.argtypes = [_H, ctypes.POINTER(maru_region_t), ctypes.c_size_t, c_size_p]
lib.maru_regions_list.restype = _S
lib.maru_region_view.argtypes = [_H, ctypes.c_uint64, ctypes.POINTER(maru_region_t), c_bool_p]
lib.maru_region_view.restype = _S


class maru_staging_t(ctypes.Structure):
    """``maru_staging_t``: the handler's staging buffer and how it is cut into slots."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("len", ctypes.c_size_t),
        ("slot_size", ctypes.c_size_t),
        ("load_slots", ctypes.c_size_t),
        ("store_slots", ctypes.c_size_t),
    ]


lib.maru_staging_buffer.argtypes = [_H, ctypes.POINTER(maru_staging_t)]
lib.maru_staging_buffer.restype = _S
