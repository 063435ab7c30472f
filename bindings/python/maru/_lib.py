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
from typing import Any, List, Optional

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

_H = ctypes.c_void_p  # maru_handler_t *
_S = ctypes.c_uint32  # maru_status_t


def _proto(name: str, argtypes: list, restype: Any = _S) -> None:
    """Declares libmaru's function `name`: its argument types and its result (a
    ``maru_status_t`` unless said); tests/test_abi.py checks each against maru.h."""
    f = getattr(lib, name)
    f.argtypes = argtypes
    f.restype = restype


_proto("maru_abi_version", [], ctypes.c_uint32)
_proto("maru_version_string", [], ctypes.c_char_p)
_proto("maru_last_error", [], ctypes.c_char_p)
_proto("maru_status_str", [ctypes.c_uint32], ctypes.c_char_p)

_proto("maru_handler_open", [ctypes.c_char_p, ctypes.POINTER(_H)])
_proto("maru_handler_close", [_H])
_proto("maru_handler_shutdown", [_H])
_proto("maru_handler_free", [_H])
_proto("maru_store", [_H, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, c_bool_p])
_proto("maru_store_batch", [_H, c_char_pp, c_void_pp, c_size_p, ctypes.c_size_t, ctypes.c_char_p, c_bool_p])
_proto("maru_load", [_H, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, c_size_p, ctypes.c_char_p])
_proto("maru_load_batch", [_H, c_char_pp, c_void_pp, c_size_p, c_size_p, c_bool_p, ctypes.c_size_t, ctypes.c_char_p])
_proto("maru_exists", [_H, ctypes.c_char_p, ctypes.c_char_p, c_bool_p])
_proto("maru_stats_json", [_H, ctypes.c_char_p, ctypes.c_size_t, c_size_p])
_proto("maru_chunk_size", [_H, ctypes.POINTER(ctypes.c_uint64)])

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

_proto("maru_exists_batch", [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, c_bool_p])
_proto(
    "maru_slots_acquire",
    [_H, ctypes.c_uint32, ctypes.c_size_t, ctypes.c_uint32, ctypes.POINTER(maru_slot_t), c_size_p],
)
_proto("maru_slots_release", [_H, c_u64_p, ctypes.c_size_t])
_proto("maru_store_slots", [_H, c_char_pp, c_u64_p, c_size_p, ctypes.c_size_t, ctypes.c_char_p, c_bool_p])
_proto("maru_load_slots", [_H, c_char_pp, c_u64_p, ctypes.c_size_t, ctypes.c_char_p, c_size_p, c_bool_p])
_proto(
    "maru_submit_store_slots",
    [_H, c_char_pp, c_u64_p, c_size_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(_OP)],
)
_proto("maru_submit_load_slots", [_H, c_char_pp, c_u64_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(_OP)])
_proto("maru_op_poll", [_OP])
_proto("maru_op_wait", [_OP, ctypes.c_uint32])
_proto("maru_op_results", [_OP, c_bool_p, c_size_p, ctypes.c_size_t])
_proto("maru_op_free", [_OP], None)
_proto("maru_set_memory_hook", [MEM_REGISTER_FN, MEM_UNREGISTER_FN, ctypes.c_void_p])
_proto("maru_set_memory_hook_auto", [])

# Removal of own keys, slot ownership after a call, and in-place views (cxl).


class maru_view_t(ctypes.Structure):
    """``maru_view_t``: a chunk read in place from this host's mapping (backend cxl)."""

    _fields_ = [
        ("id", ctypes.c_uint64),
        ("data", ctypes.c_void_p),
        ("len", ctypes.c_size_t),
        ("valid_ms", ctypes.c_uint64),
    ]


_proto("maru_remove_batch", [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32)])
_proto("maru_pin_batch", [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, c_bool_p])
_proto("maru_unpin_batch", [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, c_bool_p])
_proto("maru_slots_held", [_H, c_u64_p, ctypes.c_size_t, c_bool_p])
_proto("maru_views_acquire", [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(maru_view_t), c_bool_p])
_proto("maru_views_release", [_H, c_u64_p, ctypes.c_size_t])

# Logging and chunk keys.

#: ``maru_log_fn``: ``void (*)(void *ctx, maru_log_level_t level, const char *target,
#: const char *message)``.
LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_char_p)
_proto("maru_set_log_callback", [ctypes.c_uint32, LOG_FN, ctypes.c_void_p])

#: ``MARU_CHUNK_KEY_SIZE``: bytes of one key in ``maru_chunk_keys``' output.
CHUNK_KEY_SIZE = 65
_proto(
    "maru_chunk_keys",
    [
        ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_char_p,
        ctypes.c_size_t, c_size_p,
    ],
)
_proto("maru_key_file_check", [ctypes.c_char_p])


class maru_copy_t(ctypes.Structure):
    """``maru_copy_t``: one piece of a ``maru_copy``."""

    _fields_ = [("dst", ctypes.c_void_p), ("src", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_proto("maru_copy", [ctypes.POINTER(maru_copy_t), ctypes.c_size_t, ctypes.c_bool])


class maru_piece_t(ctypes.Structure):
    """``maru_piece_t``: one piece of a chunk that ``maru_load_pieces`` copies."""

    _fields_ = [("chunk", ctypes.c_size_t), ("offset", ctypes.c_size_t), ("dst", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_proto(
    "maru_load_pieces",
    [_H, c_char_pp, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(maru_piece_t), ctypes.c_size_t, c_size_p,
     c_bool_p],
)

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


_proto("maru_pages_take", [_H, ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(maru_page_t), c_size_p])
_proto("maru_pages_publish", [_H, c_char_pp, ctypes.POINTER(maru_page_t), c_size_p, ctypes.c_size_t, c_bool_p])
_proto("maru_pages_give_back", [_H, ctypes.POINTER(maru_page_t), ctypes.c_size_t])
_proto("maru_regions_list", [_H, ctypes.POINTER(maru_region_t), ctypes.c_size_t, c_size_p])
_proto("maru_region_view", [_H, ctypes.c_uint64, ctypes.POINTER(maru_region_t), c_bool_p])


class maru_staging_t(ctypes.Structure):
    """``maru_staging_t``: the handler's staging buffer and how it is cut into slots."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("len", ctypes.c_size_t),
        ("slot_size", ctypes.c_size_t),
        ("load_slots", ctypes.c_size_t),
        ("store_slots", ctypes.c_size_t),
    ]


_proto("maru_staging_buffer", [_H, ctypes.POINTER(maru_staging_t)])
