"""Finding and loading libmaru.so, and the C prototypes of include/maru.h."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path
from typing import List, Optional

ABI_VERSION = 1

c_bool_p = ctypes.POINTER(ctypes.c_bool)
c_size_p = ctypes.POINTER(ctypes.c_size_t)


def _candidates() -> List[Path]:
    out: List[Path] = []
    env = os.environ.get("MARU_LIB")
    if env:
        out.append(Path(env))
    here = Path(__file__).resolve().parent
    out.append(here / "libmaru.so")
    for start in (Path.cwd(), here):
        for d in (start, *start.parents):
            for profile in ("release", "debug"):
                out.append(d / "target" / profile / "libmaru.so")
    return out


def _load() -> ctypes.CDLL:
    tried = []
    for p in _candidates():
        tried.append(str(p))
        if p.is_file():
            return ctypes.CDLL(str(p))
        if os.environ.get("MARU_LIB") and str(p) == os.environ["MARU_LIB"]:
            raise ImportError(f"MARU_LIB={p} does not exist")
    found = ctypes.util.find_library("maru")
    if found:
        return ctypes.CDLL(found)
    raise ImportError(
        "libmaru.so not found; build it (cargo build -p maru) or set MARU_LIB. Looked in: "
        + ", ".join(tried[:6])
        + (" ..." if len(tried) > 6 else "")
    )


lib = _load()

lib.maru_abi_version.restype = ctypes.c_uint32
lib.maru_last_error.restype = ctypes.c_char_p
lib.maru_status_str.argtypes = [ctypes.c_uint32]
lib.maru_status_str.restype = ctypes.c_char_p

_H = ctypes.c_void_p
lib.maru_handler_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(_H)]
lib.maru_handler_open.restype = ctypes.c_uint32
lib.maru_handler_close.argtypes = [_H]
lib.maru_handler_close.restype = ctypes.c_uint32
lib.maru_store.argtypes = [_H, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, c_bool_p]
lib.maru_store.restype = ctypes.c_uint32
lib.maru_load.argtypes = [_H, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, c_size_p, ctypes.c_char_p]
lib.maru_load.restype = ctypes.c_uint32
lib.maru_exists.argtypes = [_H, ctypes.c_char_p, ctypes.c_char_p, c_bool_p]
lib.maru_exists.restype = ctypes.c_uint32
lib.maru_stats_json.argtypes = [_H, ctypes.c_char_p, ctypes.c_size_t, c_size_p]
lib.maru_stats_json.restype = ctypes.c_uint32
lib.maru_chunk_size.argtypes = [_H, ctypes.POINTER(ctypes.c_uint64)]
lib.maru_chunk_size.restype = ctypes.c_uint32

if lib.maru_abi_version() != ABI_VERSION:
    raise ImportError(
        f"libmaru ABI {lib.maru_abi_version()} does not match this binding's {ABI_VERSION}: "
        "install the binding that came with the library"
    )


def last_error() -> str:
    msg: Optional[bytes] = lib.maru_last_error()
    return msg.decode("utf-8", "replace") if msg else ""
