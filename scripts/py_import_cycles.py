#!/usr/bin/env python3
"""Lists import circles between the Python files of a package tree: module A imports
module B at load time (``import x``, ``from x import y``, ``from . import y``, at the
top level or under a top-level ``if``/``try``) and B, directly or through others,
imports A. Imports inside functions and under ``if TYPE_CHECKING:`` run later or
never and are not counted; ``from pkg import name`` counts as importing ``pkg.name``
when that is a module, else ``pkg`` (its ``__init__``).

Usage: py_import_cycles.py ROOT [ROOT ...] (each ROOT the directory holding the
top-level packages, such as bindings/python). Files under ``tests`` are skipped.
Prints every circle and exits 1 when there is one.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_cycles import cycles  # noqa: E402  (the same Tarjan search as for Rust)


def modules(root: Path) -> Dict[str, Path]:
    out = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if "tests" in rel.parts:
            continue
        name = ".".join(rel.with_suffix("").parts)
        out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


def load_time_imports(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    for n in body:
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            yield n
        elif isinstance(n, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(n.test):
                yield from load_time_imports(n.body)
            yield from load_time_imports(n.orelse)
        elif isinstance(n, ast.Try):
            for part in (n.body, n.orelse, n.finalbody, *(h.body for h in n.handlers)):
                yield from load_time_imports(part)


def edges(mods: Dict[str, Path]) -> Dict[str, Set[str]]:
    out: Dict[str, Set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for n in load_time_imports(ast.parse(p.read_text(), str(p)).body):
            if isinstance(n, ast.Import):
                out[m].update(a.name for a in n.names if a.name in mods)
                continue
            if n.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                target = ".".join(base + ([n.module] if n.module else []))
            else:
                target = n.module or ""
            for a in n.names:
                sub = f"{target}.{a.name}"
                if sub in mods:
                    out[m].add(sub)
                elif target in mods:
                    out[m].add(target)
        out[m].discard(m)
    return out


def main(argv: List[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    total = 0
    for root in map(Path, argv):
        g = edges(modules(root))
        for c in cycles(g):
            total += 1
            print("CIRCLE: " + " , ".join(c))
            for a in c:
                print(f"    {a} imports {', '.join(sorted(b for b in g[a] if b in c))}")
    print(f"python import circles: {total} found")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
