"""The ctypes prototypes of ``maru._lib`` against ``include/maru.h``: every function the
package calls is declared in the header, and every prototype and struct the binding
writes by hand has the header's types, argument by argument and field by field. A
prototype that drifts from the header (an argument added in Rust, a ``size_t`` that
became a ``uint64_t *``) would otherwise pass arguments the library reads wrongly."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from maru import _lib

HEADER = Path(__file__).resolve().parents[3] / "include" / "maru.h"
PACKAGE = Path(_lib.__file__).resolve().parent

pytestmark = pytest.mark.skipif(not HEADER.is_file(), reason=f"no {HEADER} (not a source tree)")

#: The header's integer types (its enums are uint32_t in C) and the ctypes type each is.
SCALARS = {
    "uint8_t": ctypes.c_uint8,
    "int32_t": ctypes.c_int32,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "bool": ctypes.c_bool,
    "maru_status_t": ctypes.c_uint32,
    "maru_log_level_t": ctypes.c_uint32,
    "maru_slot_pool_t": ctypes.c_uint32,
    "maru_remove_result_t": ctypes.c_uint32,
}
#: Opaque handles: a pointer to one is passed as ``c_void_p``.
OPAQUE = {"maru_handler_t", "maru_op_t"}


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def _split_params(params: str) -> List[str]:
    params = params.strip()
    if params in ("", "void"):
        return []
    return [p.strip() for p in params.split(",")]


def _param_type(param: str) -> str:
    """``const struct maru_slot_t *out`` -> ``maru_slot_t *`` (the name dropped,
    ``const`` and ``struct`` dropped, stars kept)."""
    p = re.sub(r"\b(const|struct)\b", " ", param)
    stars = p.count("*")
    words = p.replace("*", " ").split()
    # The last word is the parameter's name unless the parameter is a bare type.
    base = words[0] if len(words) == 1 else words[-2]
    return base + " " + "*" * stars if stars else base


class Header:
    """The functions, function pointer types and structs of maru.h, parsed from the
    text cbindgen writes (one declaration per statement, no macros in prototypes)."""

    def __init__(self, text: str) -> None:
        code = _strip_comments(text)
        code = re.sub(r"#[^\n]*", " ", code)  # preprocessor lines
        self.functions: Dict[str, Tuple[str, List[str]]] = {}
        self.fn_types: Dict[str, Tuple[str, List[str]]] = {}
        self.structs: Dict[str, List[Tuple[str, str]]] = {}
        for m in re.finditer(r"typedef\s+([\w\s\*]+?)\(\s*\*\s*(\w+)\s*\)\s*\(([^)]*)\)\s*;", code):
            ret, name, params = m.groups()
            self.fn_types[name] = (_param_type(ret.strip() + " x"), [_param_type(p) for p in _split_params(params)])
        for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{([^}]*)\}\s*(\w+)\s*;", code):
            _, body, name = m.groups()
            fields = []
            for decl in body.split(";"):
                decl = decl.strip()
                if decl:
                    fields.append((decl.replace("*", " ").split()[-1], _param_type(decl)))
            self.structs[name] = fields
        # Prototypes: `RET NAME(PARAMS);` outside typedefs.
        for stmt in re.split(r"[;{}]", code):
            m = re.fullmatch(r"\s*([\w\s\*]+?)\b(maru_\w+)\s*\(([^()]*)\)\s*", stmt)
            if m is None or "typedef" in m.group(1):
                continue
            ret, name, params = m.groups()
            self.functions[name] = (_param_type(ret.strip() + " x"), [_param_type(p) for p in _split_params(params)])


@pytest.fixture(scope="module")
def header() -> Header:
    return Header(HEADER.read_text())


def expected(header: Header, ctype: str, where: str):
    """The ctypes type the C type ``ctype`` (as :func:`_param_type` writes it) must be
    given as; None for ``void``."""
    base, _, stars = ctype.partition(" ")
    n = len(stars)
    if base == "void" and n == 0:
        return None
    if base in OPAQUE:
        t = ctypes.c_void_p
        n -= 1
    elif base in ("void", "uint8_t") and n >= 1:
        # Bytes of the caller's or libmaru's memory: an address.
        t = ctypes.c_void_p
        n -= 1
    elif base == "char" and n >= 1:
        t = ctypes.c_char_p
        n -= 1
    elif base in SCALARS:
        t = SCALARS[base]
    elif base in header.structs:
        t = getattr(_lib, base, None)
        assert t is not None, f"{where}: maru._lib has no ctypes.Structure named {base}"
    else:
        raise AssertionError(f"{where}: a C type this test does not know: {ctype!r}")
    for _ in range(n):
        t = ctypes.POINTER(t)
    return t


def _same(got, want) -> bool:
    if got is want:
        return True
    # c_char_p for a `char *` the library writes into (maru_stats_json's buffer) and
    # c_void_p for it are the same register; both are accepted.
    return {got, want} == {ctypes.c_char_p, ctypes.c_void_p}


def _name(t) -> str:
    return "void" if t is None else getattr(t, "__name__", repr(t))


def _fn_type_of(header: Header, t) -> Optional[str]:
    """The header's function pointer typedef that the CFUNCTYPE ``t`` matches."""
    for name, (ret, params) in header.fn_types.items():
        if _same_or_none(t._restype_, expected(header, ret, name)) and len(t._argtypes_) == len(params) and all(
            _same(a, expected(header, p, name)) for a, p in zip(t._argtypes_, params)
        ):
            return name
    return None


def _same_or_none(got, want) -> bool:
    return (got is None and want is None) or (got is not None and want is not None and _same(got, want))


def used_functions() -> Dict[str, List[str]]:
    """Every ``lib.maru_*`` the package's modules name, with the files that name it."""
    used: Dict[str, List[str]] = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        for name in set(re.findall(r"\blib\.(maru_\w+)", f.read_text())):
            used.setdefault(name, []).append(str(f.relative_to(PACKAGE)))
    return used


def test_the_header_parses(header):
    # A parser that silently found nothing would make the tests below vacuous.
    # Every `maru_x(` that begins a declaration's line outside comments is a prototype.
    code = _strip_comments(HEADER.read_text())
    declared = set(re.findall(r"^[A-Za-z][\w \*]*?\b(maru_\w+)\(", code, flags=re.M))
    assert len(declared) >= 40, sorted(declared)
    assert set(header.functions) == declared
    assert {"maru_log_fn", "maru_mem_register_fn", "maru_mem_unregister_fn"} <= set(header.fn_types)
    assert {"maru_slot_t", "maru_view_t", "maru_page_t", "maru_region_t", "maru_staging_t", "maru_copy_t"} <= set(
        header.structs
    )
    assert header.functions["maru_store"] == (
        "maru_status_t",
        ["maru_handler_t *", "char *", "uint8_t *", "size_t", "char *", "bool *"],
    )
    assert header.functions["maru_op_free"] == ("void", ["maru_op_t *"])
    assert header.functions["maru_abi_version"] == ("uint32_t", [])


def test_every_function_the_package_calls_is_declared_with_a_prototype(header):
    used = used_functions()
    assert len(used) >= 30, used
    undeclared = {n: fs for n, fs in used.items() if n not in header.functions}
    assert not undeclared, f"called from Python but not in include/maru.h: {undeclared}"
    no_proto = [n for n in used if getattr(_lib.lib, n).argtypes is None]
    assert not no_proto, f"called without argtypes set in maru/_lib.py: {no_proto}"


def test_every_prototype_matches_the_header(header):
    checked = 0
    wrong = []
    for name, (ret, params) in sorted(header.functions.items()):
        fn = getattr(_lib.lib, name, None)
        assert fn is not None, f"{name} is declared in include/maru.h but libmaru at {_lib.path} does not export it"
        if fn.argtypes is None:
            continue  # not used by the binding (test above)
        checked += 1
        want_ret = expected(header, ret, name)
        if not _same_or_none(fn.restype, want_ret):
            wrong.append(f"{name}: restype {_name(fn.restype)}, the header returns {ret} ({_name(want_ret)})")
        if len(fn.argtypes) != len(params):
            wrong.append(f"{name}: {len(fn.argtypes)} argtypes, the header has {len(params)} parameters {params}")
            continue
        for i, (got, p) in enumerate(zip(fn.argtypes, params)):
            if hasattr(got, "_argtypes_"):  # a callback: compare with the typedef
                if _fn_type_of(header, got) is None or p.split()[0] not in header.fn_types:
                    wrong.append(f"{name}: argument {i} is a callback matching no typedef, the header has {p}")
                elif _fn_type_of(header, got) != p.split()[0]:
                    wrong.append(f"{name}: argument {i} is {_fn_type_of(header, got)}, the header has {p}")
                continue
            want = expected(header, p, f"{name} argument {i}")
            if not _same(got, want):
                wrong.append(f"{name}: argument {i} is {_name(got)}, the header has {p} ({_name(want)})")
    assert checked >= 30
    assert not wrong, "maru/_lib.py differs from include/maru.h:\n  " + "\n  ".join(wrong)


def test_every_struct_matches_the_header(header):
    wrong = []
    for name, fields in sorted(header.structs.items()):
        cls = getattr(_lib, name, None)
        if cls is None:
            continue  # a struct of a function the binding does not call
        got = [(f, t) for f, t in cls._fields_]
        if [f for f, _ in got] != [f for f, _ in fields]:
            wrong.append(f"{name}: fields {[f for f, _ in got]}, the header has {[f for f, _ in fields]}")
            continue
        for (f, t), (_, ct) in zip(got, fields):
            want = expected(header, ct, f"{name}.{f}")
            if not _same(t, want):
                wrong.append(f"{name}.{f}: {_name(t)}, the header has {ct} ({_name(want)})")
    assert not wrong, "maru/_lib.py's structs differ from include/maru.h:\n  " + "\n  ".join(wrong)


def test_callback_types_match_the_header(header):
    assert _fn_type_of(header, _lib.LOG_FN) == "maru_log_fn"
    assert _fn_type_of(header, _lib.MEM_REGISTER_FN) == "maru_mem_register_fn"
    assert _fn_type_of(header, _lib.MEM_UNREGISTER_FN) == "maru_mem_unregister_fn"


def test_a_drifted_prototype_is_caught(header, monkeypatch):
    # The check itself: an argument of the wrong width and a missing argument are
    # both reported.
    monkeypatch.setattr(
        _lib.lib.maru_chunk_size, "argtypes", [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    )
    with pytest.raises(AssertionError, match=r"maru_chunk_size: argument 1"):
        test_every_prototype_matches_the_header(header)
    monkeypatch.setattr(_lib.lib.maru_chunk_size, "argtypes", [ctypes.c_void_p])
    with pytest.raises(AssertionError, match=r"maru_chunk_size: 1 argtypes"):
        test_every_prototype_matches_the_header(header)
