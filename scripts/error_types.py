#!/usr/bin/env python3
"""Lists the Rust error types that do not derive ``thiserror::Error``.

An error type is an ``enum`` or ``struct`` whose name ends in ``Error``, or any
type with a hand-written ``impl std::error::Error`` / ``impl Error``. Each must carry ``#[derive(...)]``
naming ``thiserror::Error`` (or ``Error`` where the file imports
``thiserror::Error``), so that messages and typed sources come from one place.

Usage: error_types.py [--allow NAME ...] SRC_DIR [SRC_DIR ...]
Prints each offender as ``file:line: Name`` and exits 1 when one is not allowed
(an allowed name is a type known to be fixed on another branch: reported, not failed).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TYPE_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:enum|struct)\s+(\w+Error)\b", re.M)
HAND_IMPL_RE = re.compile(r"^\s*impl(?:<[^>]*>)?\s+(?:std::error::|error::)?Error\s+for\s+(\w+)", re.M)
DERIVE_RE = re.compile(r"#\[derive\(([^)]*)\)\]", re.S)


def derives_thiserror(text: str, start: int, imports_thiserror: bool) -> bool:
    """Whether the attributes just above the item at `start` (back to the end of the
    item before it) derive thiserror's Error."""
    before = text[:start]
    head = before[max(before.rfind("}\n"), before.rfind(";\n"), before.rfind("\n\n")) + 1 :]
    for m in DERIVE_RE.finditer(head):
        names = [n.strip() for n in m.group(1).split(",")]
        if "thiserror::Error" in names or (imports_thiserror and "Error" in names):
            return True
    return False


def offenders(src: Path):
    for path in sorted(src.rglob("*.rs")):
        text = path.read_text()
        imports_thiserror = bool(re.search(r"use\s+thiserror::(Error|\{[^}]*\bError\b)", text))
        for m in TYPE_RE.finditer(text):
            if not derives_thiserror(text, m.start(), imports_thiserror):
                yield path, text.count("\n", 0, m.start()) + 1, m.group(1)
        for m in HAND_IMPL_RE.finditer(text):
            yield path, text.count("\n", 0, m.start()) + 1, f"{m.group(1)} (hand-written impl Error)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--allow", action="append", default=[], metavar="NAME")
    ap.add_argument("src", nargs="+", type=Path)
    a = ap.parse_args(argv)
    bad = 0
    found = 0
    for src in a.src:
        for path, line, name in offenders(src):
            found += 1
            allowed = name.split(" ")[0] in a.allow
            bad += not allowed
            print(f"{path}:{line}: {name}{' (allowed: known, fixed on another branch)' if allowed else ''}")
    print(f"error types without thiserror: {found} found, {bad} not allowed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
