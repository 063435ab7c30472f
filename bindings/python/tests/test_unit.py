"""Parts of the binding that need no daemons: chunk keys, errors, buffers, finding the
library."""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import maru
from maru import _buffer, chunk_keys
from maru.errors import Status, error_for


def test_chunk_keys_share_prefixes_within_a_namespace():
    a = chunk_keys(list(range(1000)), 256, "llama")
    b = chunk_keys(list(range(768)) + [9] * 300, 256, "llama")
    assert len(a) == 3 and len(b) == 4  # full chunks only
    assert a == b[:3]
    assert chunk_keys(list(range(1000)), 256, "llama") == a  # deterministic
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in a)
    other = chunk_keys(list(range(1000)), 256, "other")
    assert not set(other) & set(a)
    assert chunk_keys(list(range(255)), 256, "llama") == []
    assert chunk_keys([], 4, "llama") == []


def test_chunk_keys_chain_the_prefix():
    t = list(range(12))
    changed = [99] + t[1:]
    ka, kb = chunk_keys(t, 4, "ns"), chunk_keys(changed, 4, "ns")
    assert all(x != y for x, y in zip(ka, kb))  # a change in chunk 0 changes every key
    # The documented formula.
    d0 = hashlib.sha256(b"maru-chunk-v1\0ns\0" + struct.pack("<4i", 0, 1, 2, 3)).digest()
    d1 = hashlib.sha256(d0 + struct.pack("<4i", 4, 5, 6, 7)).digest()
    assert ka[:2] == [d0.hex(), d1.hex()]
    assert chunk_keys([-1, 2**31 - 1], 2, "ns")  # int32 range
    with pytest.raises(ValueError):
        chunk_keys([2**31], 1, "ns")
    with pytest.raises(ValueError):
        chunk_keys(t, 0, "ns")


def test_status_codes_map_to_exceptions():
    cases = {
        1: maru.InvalidArgumentError,
        2: maru.InvalidArgumentError,
        3: maru.ConfigError,
        4: maru.UnavailableError,
        5: maru.NotFoundError,
        6: maru.RefusedError,
        7: maru.NoSpaceError,
        8: maru.MaruTimeoutError,
        9: maru.AuthError,
        13: maru.ClosedError,
        14: maru.BufferTooSmallError,
    }
    for code, cls in cases.items():
        e = error_for(code, f"message {code}")
        assert type(e) is cls and e.code == code and str(e) == f"message {code}"
        assert isinstance(e, maru.MaruError)
    for code in (10, 11, 15, 99, 1234):
        assert type(error_for(code, "m")) is maru.MaruError
    assert error_for(1234, "m").status is None and error_for(5, "m").status is Status.NOT_FOUND
    assert "NOT_FOUND" in repr(error_for(5, "m"))
    assert issubclass(maru.BufferTooSmallError, maru.InvalidArgumentError)


def test_library_versions():
    from maru import _lib

    assert _lib.lib.maru_abi_version() == maru.ABI_VERSION == 1
    assert maru.version()
    assert _lib.status_str(5) == "not found"
    assert Path(maru.library_path).name.startswith("libmaru")


def test_buffers_are_passed_in_place():
    ro = bytes(range(256)) * 4
    base = ctypes.cast(ctypes.c_char_p(ro), ctypes.c_void_p).value
    with _buffer.readable(ro) as (addr, n):
        assert (addr, n) == (base, len(ro))
    with _buffer.readable(memoryview(ro)[10:20]) as (addr, n):
        assert (addr, n) == (base + 10, 10)
        assert ctypes.string_at(addr, n) == ro[10:20]
    rw = bytearray(ro)
    rw_base = ctypes.addressof((ctypes.c_char * len(rw)).from_buffer(rw))
    with _buffer.readable(memoryview(rw)[100:]) as (addr, n):
        assert (addr, n) == (rw_base + 100, len(rw) - 100)
        with pytest.raises(BufferError):
            rw.append(1)  # exported while the call runs
    rw.append(1)  # released after
    with _buffer.writable(memoryview(rw)[4:8]) as (addr, n):
        ctypes.memmove(addr, b"WXYZ", 4)
    assert rw[4:8] == b"WXYZ"
    with pytest.raises(TypeError):
        with _buffer.writable(ro):
            pass
    with pytest.raises(ValueError):
        with _buffer.readable(memoryview(rw)[::2]):
            pass
    a = (ctypes.c_uint32 * 4)(1, 2, 3, 4)  # a multi-byte format is cast to bytes
    with _buffer.readable(a) as (addr, n):
        assert (addr, n) == (ctypes.addressof(a), 16)


def _import_in_subprocess(env_extra, cwd):
    env = {k: v for k, v in os.environ.items() if k != "MARU_LIB"}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", "import maru; print(maru.library_path)"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_maru_lib_overrides_and_a_wrong_one_is_an_import_error(tmp_path):
    real = maru.library_path
    ok = _import_in_subprocess({"MARU_LIB": real}, tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == real
    bad = _import_in_subprocess({"MARU_LIB": str(tmp_path / "nope.so")}, tmp_path)
    assert bad.returncode != 0
    assert "ImportError" in bad.stderr and "MARU_LIB" in bad.stderr and "nope.so" in bad.stderr


def test_not_found_lists_where_it_looked_and_never_searches_the_working_directory(tmp_path):
    # A copy of the package without its library, imported from a directory that holds a
    # planted target/debug/libmaru.so: it must not be loaded.
    import shutil

    pkg = tmp_path / "site" / "maru"
    shutil.copytree(
        Path(maru.__file__).resolve().parent, pkg, ignore=shutil.ignore_patterns("libmaru*.so", "__pycache__")
    )
    planted = tmp_path / "target" / "debug"
    planted.mkdir(parents=True)
    shutil.copy(maru.library_path, planted / "libmaru.so")
    env = {k: v for k, v in os.environ.items() if k not in ("MARU_LIB", "PYTHONPATH")}
    code = f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r}); import maru; print(maru.library_path)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    if r.returncode == 0:
        assert str(planted) not in r.stdout, "a library in the working directory was loaded"
        assert False, "libmaru was found outside the package (installed system-wide?): " + r.stdout
    assert "libmaru.so not found" in r.stderr and "MARU_LIB" in r.stderr
    assert str(pkg.resolve() / "libmaru.so") in r.stderr
    assert str(planted) not in r.stderr


def test_the_c_and_python_chunk_keys_are_equal():
    """maru_chunk_keys (C) and maru.chunk_keys (Python) give the same keys."""
    import random

    from maru import _capi

    rng = random.Random(7)
    cases = [([], 4, "m"), (list(range(10)), 4, "m/l"), ([-(2**31), 2**31 - 1, 0, 5], 2, "ns é")]
    cases += [
        ([rng.randrange(-(2**31), 2**31) for _ in range(rng.randrange(0, 600))], rng.choice([1, 16, 256]), f"ns{i}")
        for i in range(20)
    ]
    for tokens, chunk, ns in cases:
        c_keys = _capi.chunk_keys(tokens, chunk, ns)  # maru_chunk_keys, each key NUL-terminated
        assert len(c_keys) == len(tokens) // chunk
        assert c_keys == chunk_keys(tokens, chunk, ns), (len(tokens), chunk, ns)
    with pytest.raises(maru.InvalidArgumentError):
        _capi.chunk_keys([1, 2], 0, "m")  # a failed status becomes the package's exception


def test_libmaru_messages_reach_logging(caplog):
    """libmaru's warnings (here: the open of a pool nobody serves) reach the maru.lib loggers."""
    import logging

    with caplog.at_level(logging.WARNING, logger="maru.lib"):
        with pytest.raises(maru.UnavailableError):
            maru.Handler({"backend": "cxl", "server_url": "127.0.0.1:1", "engine_id": "e", "timeout_ms": 300})
    msgs = [r for r in caplog.records if r.name.startswith("maru.lib.")]
    assert any("127.0.0.1:1" in r.getMessage() and r.levelno == logging.WARNING for r in msgs), caplog.text
    # Below the level set, nothing is forwarded.
    maru.set_log_level(logging.ERROR)
    try:
        caplog.clear()
        with pytest.raises(maru.UnavailableError):
            maru.Handler({"backend": "cxl", "server_url": "127.0.0.1:1", "engine_id": "e", "timeout_ms": 300})
        assert not [r for r in caplog.records if r.name.startswith("maru.lib.")]
    finally:
        maru.set_log_level(logging.WARNING)


def test_the_package_imports_one_way():
    """Each module imports only modules of lower layers (no cycle, no reaching up)."""
    import ast

    layer = {
        "_lib": 0, "errors": 0, "_buffer": 0, "keys": 0, "_scoped": 0,
        "_capi": 1, "_args": 1,
        "_book": 2, "_log": 2, "hook": 2, "key_files": 2, "copies": 2,
        "slots": 3, "views": 3,
        "handler_slots": 4, "handler_place": 4,
        "handler": 5,
        "compat": 6,
        "__init__": 7,
    }
    root = Path(maru.__file__).resolve().parent
    for path in [*root.glob("*.py"), root / "compat" / "__init__.py"]:
        name = "compat" if path.parent.name == "compat" else path.stem
        if name not in layer:  # modules added by others (maru.vllm*) sit on top
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                node.body = []  # annotations only
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = node.module.split(".")[0] if node.module else None
            targets = [base] if base else [a.name for a in node.names]
            for t in targets:
                if t in layer:
                    assert layer[t] < layer[name], f"{path.name} ({name}) imports {t}: not a lower layer"


#: The C-call layer: the only modules that may call libmaru's functions.
C_LAYER = {"_lib", "_capi"}


def _c_calls(source: str) -> list:
    """Where ``source`` reaches libmaru's C functions itself: an attribute ``maru_*``
    that is not a type (``lib.maru_store``, ``_lib.lib.maru_op_free``), a
    ``getattr(x, "maru_...")``, the library object (``from ._lib import lib``,
    ``_lib.lib``, ``_capi.lib``), or a library loader of its own (``ctypes.CDLL``,
    ``find_library``)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        where = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute):
            if node.attr.startswith("maru_") and not node.attr.endswith("_t"):
                found.append((where, f".{node.attr}"))
            if node.attr == "lib" and ast.unparse(node.value).endswith(("_lib", "_capi")):
                found.append((where, f"{ast.unparse(node)}"))
            if node.attr in ("CDLL", "cdll", "PyDLL", "LibraryLoader", "find_library"):
                found.append((where, f".{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in C_LAYER:
            found += [(where, f"import of {a.name} from {node.module}") for a in node.names if a.name in ("lib", "*")]
        elif isinstance(node, ast.ImportFrom) and node.module == "ctypes":
            found += [(where, f"import of ctypes.{a.name}") for a in node.names if a.name in ("CDLL", "cdll", "PyDLL", "*")]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and str(node.args[1].value).startswith("maru_")
        ):
            found.append((where, f"{node.func.id}(..., {node.args[1].value!r})"))
    return sorted(found)


def test_only_the_c_layer_calls_libmaru():
    """Every C call goes through the typed wrappers of the C-call layer (maru._lib,
    maru._capi): no other module of the package (maru.vllm* and maru.compat included)
    touches a maru_* function or the library object itself."""
    # The scan sees what it must (else this test would pass on anything).
    assert _c_calls("lib.maru_store(h, k)") and _c_calls("_lib.lib.maru_op_free(p)")
    assert _c_calls("from ._lib import lib") and _c_calls("from maru import _lib\n_lib.lib")
    assert _c_calls("from ._capi import lib") and _c_calls("maru._capi.lib") and _c_calls("from maru._lib import *")
    assert _c_calls("getattr(lib, 'maru_store')")
    assert _c_calls("ctypes.CDLL('libmaru.so')") and _c_calls("from ctypes import CDLL")
    assert _c_calls("x = _lib.maru_slot_t() ; '``maru_store``'") == []  # types and docstrings are fine
    root = Path(maru.__file__).resolve().parent
    assert len(_c_calls((root / "_capi.py").read_text())) > 20  # the wrappers call C this way
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) == 1 and path.stem in C_LAYER:
            continue
        bad += [f"{rel}:{line}: {what}" for line, what in _c_calls(path.read_text())]
    assert not bad, "C calls outside maru._lib / maru._capi (use a wrapper of maru._capi):\n" + "\n".join(bad)


def test_check_key_file_names_the_file_and_what_is_wrong(tmp_path):
    """maru.check_key_file is libmaru's own key-file loader (maru_key_file_check): a
    good key passes; a missing, too open or malformed file is a ConfigError naming it."""
    import os

    good = tmp_path / "good.key"
    good.write_text("00112233445566778899aabbccddeeff\n")
    os.chmod(good, 0o600)
    maru.check_key_file(good)
    missing, open_, junk = tmp_path / "missing.key", tmp_path / "open.key", tmp_path / "junk.key"
    open_.write_text(good.read_text())
    os.chmod(open_, 0o644)
    junk.write_text("not a key\n")
    os.chmod(junk, 0o600)
    for bad, words in ((missing, "missing.key"), (open_, "chmod 600"), (junk, "junk.key")):
        with pytest.raises(maru.ConfigError) as e:
            maru.check_key_file(bad)
        assert words in e.value.message, e.value.message


def test_copy_ranges_copies_every_piece_in_one_call():
    """maru.copy_ranges (maru_copy): every piece lands, large ones (streamed) and
    small; a NULL address fails the call before anything is copied."""
    src = bytearray(os.urandom(700 << 10))
    dst = bytearray(len(src))
    a = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
    b = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
    cut = [0, 10, 300 << 10, 700 << 10]
    pieces = [(b + x, a + x, y - x) for x, y in zip(cut, cut[1:])][::-1]
    for shared in (False, True):
        dst[:] = bytes(len(dst))
        maru.copy_ranges(pieces, into_shared=shared)
        assert dst == src
    dst[:] = bytes(len(dst))
    with pytest.raises(maru.MaruError) as e:
        maru.copy_ranges([(b, a, 8), (0, a, 8)])
    assert "copies[1]" in e.value.message and dst[:8] == bytes(8)
    # Pieces that are not three non-negative integers are refused before any copy.
    for bad in ([(b, a, 8), (-1, a, 8)], [(b, a, 8), (b, a)], [(b, a), (b, a, 8, 8)], [(b, a, 8), (b, a, "8")]):
        with pytest.raises(ValueError, match="maru_copy"):
            maru.copy_ranges(bad)
        assert dst[:8] == bytes(8)


def test_view_expiry_thread_is_woken_only_for_an_earlier_deadline():
    """maru._book._Expirer: adding views that expire after those queued wakes nobody
    (a load's views, every load: waking the thread took the GIL from the loading
    thread); a view that expires first wakes it, and it is expired on time."""
    import threading
    import time

    from maru._book import _Expirer

    class Handler:
        def __init__(self):
            self.expired = []

        def _expire_view(self, v):
            self.expired.append(v)

    class V:
        def __init__(self, in_s):
            self._deadline = time.monotonic() + in_s
            self._state = "held"

    class Counting(threading.Condition):
        notified = 0

        def notify(self, n=1):
            Counting.notified += 1
            super().notify(n)

    h = Handler()
    e = _Expirer(h)
    e._cv = Counting()
    keep = [V(60)]
    e.add(keep)  # starts the thread
    for i in range(5):
        keep.append(V(61 + i))
        e.add(keep[-1:])
    assert Counting.notified == 0
    soon = V(0.1)
    e.add([soon])
    assert Counting.notified == 1
    deadline = time.monotonic() + 5
    while not h.expired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h.expired == [soon]
    e.stop()
