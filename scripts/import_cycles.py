#!/usr/bin/env python3
"""Lists import circles between the Rust files of a crate: file A uses a path that
lands in file B (``use crate::...``, ``super::``, ``self::``, or a ``crate::`` path
written inline) and B, directly or through other files, uses A.

Each path is resolved to the file of the longest module prefix it names; a name a
module re-exports (``pub use child::Name``) is followed to the file that defines it,
so going through a ``mod.rs`` facade is not a circle. ``mod x;`` declarations are not
imports, nor are re-exports themselves. Code inside an inline ``mod name { ... }`` (tests) resolves ``super::`` to
the file itself.

Usage: import_cycles.py [--allow A<->B ...] SRC_DIR [SRC_DIR ...]
(each SRC_DIR a crate's src/, holding lib.rs or main.rs). Prints every circle (its
files in order) and exits 1 when one is found that --allow does not name (an allowed
pair is a circle known to be broken on another branch: reported, not failed).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

Mod = Tuple[str, ...]

USE_RE = re.compile(r"\buse\s+([^;]+);", re.S)
INLINE_PATH_RE = re.compile(r"\b((?:crate|super|self)(?:::\w+)+)")
REEXPORT_RE = re.compile(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", re.S)


def module_of(src: Path, f: Path) -> Mod:
    rel = f.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return re.sub(r"//[^\n]*", "", text)


def expand_use(tree: str) -> List[List[str]]:
    """`a::b::{c, d::{e, f}}` -> [[a,b,c],[a,b,d,e],[a,b,d,f]] (`x as y` -> x)."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)
    out: List[List[str]] = []

    def walk(prefix: List[str], s: str) -> None:
        depth, items, cur = 0, [], ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                items.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            items.append(cur)
        for it in items:
            if "{" in it:
                head, rest = it.split("{", 1)
                head_parts = [p for p in head.split("::") if p]
                walk(prefix + head_parts, rest[: rest.rfind("}")])
            else:
                out.append(prefix + [p for p in it.split("::") if p])

    walk([], tree)
    return out


class Crate:
    def __init__(self, src: Path) -> None:
        self.src = src
        self.files: Dict[Mod, Path] = {}
        for f in sorted(src.rglob("*.rs")):
            self.files[module_of(src, f)] = f
        self.reexports: Dict[Mod, Dict[str, Mod]] = {}
        for m, f in self.files.items():
            text = strip_comments(f.read_text(errors="replace"))
            names: Dict[str, Mod] = {}
            for tree in REEXPORT_RE.findall(text):
                for path in expand_use(tree):
                    if not path or path[-1] == "*":
                        continue
                    full = self.absolute(m, path)
                    if full is not None:
                        names[path[-1]] = full
            self.reexports[m] = names

    def absolute(self, here: Mod, path: List[str]) -> Optional[Mod]:
        """A path as written in module `here`, from the crate root (None: not ours)."""
        p = list(path)
        if p[0] == "crate":
            return tuple(p[1:])
        base = list(here)
        if p[0] == "self":
            p = p[1:]
        elif p[0] == "super":
            while p and p[0] == "super":
                if not base:
                    return None
                base.pop()
                p = p[1:]
        elif (tuple(base) + (p[0],)) in self.files:
            pass  # a child module named without self::
        else:
            return None
        return tuple(base + p)

    def file_of(self, path: Mod, depth: int = 0) -> Optional[Mod]:
        """The module whose file defines what `path` names."""
        for n in range(len(path), -1, -1):
            m = path[:n]
            if m in self.files:
                rest = path[n:]
                if rest and depth < 8:
                    target = self.reexports.get(m, {}).get(rest[0])
                    if target is not None and target != path:
                        deeper = self.file_of(target + tuple(rest[1:]), depth + 1)
                        if deeper is not None:
                            return deeper
                return m
        return None

    def edges(self) -> Dict[Mod, Set[Mod]]:
        out: Dict[Mod, Set[Mod]] = {m: set() for m in self.files}
        for m, f in self.files.items():
            text = strip_comments(f.read_text(errors="replace"))
            # A re-export (`pub use child::Name`) passes a name on; what uses it is
            # followed to the defining file instead (see file_of).
            text = REEXPORT_RE.sub("", text)
            for here, chunk in self.scopes(m, text):
                paths: List[List[str]] = []
                for tree in USE_RE.findall(chunk):
                    paths.extend(expand_use(tree))
                chunk_no_use = USE_RE.sub("", chunk)
                paths.extend(p.split("::") for p in INLINE_PATH_RE.findall(chunk_no_use))
                for p in paths:
                    if not p or p[0] not in ("crate", "super", "self") and (tuple(here) + (p[0],)) not in self.files:
                        continue
                    if p[-1] == "*":
                        p = p[:-1]
                    full = self.absolute(here, p)
                    if full is None:
                        continue
                    target = self.file_of(full)
                    if target is not None and target != m:
                        out[m].add(target)
        return out

    @staticmethod
    def scopes(m: Mod, text: str) -> List[Tuple[Mod, str]]:
        """The file's text split by inline `mod name {` blocks, each with its module."""
        res: List[Tuple[Mod, str]] = []
        stack: List[Tuple[Mod, int]] = [(m, 0)]
        depth, start, i = 0, 0, 0
        opener = re.compile(r"\bmod\s+(\w+)\s*\{")
        while i < len(text):
            mo = opener.match(text, i)
            if mo:
                res.append((stack[-1][0], text[start:i]))
                depth += 1
                stack.append((stack[-1][0] + (mo.group(1),), depth))
                i = start = mo.end()
                continue
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                if len(stack) > 1 and stack[-1][1] == depth:
                    res.append((stack[-1][0], text[start:i]))
                    stack.pop()
                    start = i + 1
                depth -= 1
            i += 1
        res.append((stack[-1][0], text[start:]))
        return res


def cycles(edges: Dict[Mod, Set[Mod]]) -> List[List[Mod]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index: Dict[Mod, int] = {}
    low: Dict[Mod, int] = {}
    on: Set[Mod] = set()
    stack: List[Mod] = []
    out: List[List[Mod]] = []
    counter = [0]

    def visit(v: Mod) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--allow", action="append", default=[], metavar="A<->B",
                    help="a pair of files (paths as printed) whose circle is reported, not failed")
    ap.add_argument("src", nargs="+", type=Path)
    args = ap.parse_args(argv)
    allowed = {frozenset(a.split("<->")) for a in args.allow}
    failed = found = 0
    for src in args.src:
        crate = Crate(src)
        edges = crate.edges()
        for comp in cycles(edges):
            found += 1
            names = [str(crate.files[m]) for m in comp]
            pairs = [
                f"{crate.files[a]} <-> {crate.files[b]}"
                for i, a in enumerate(comp) for b in comp[i + 1:]
                if b in edges[a] and a in edges[b]
            ]
            known = any(frozenset(p.split(" <-> ")) in allowed for p in pairs)
            tag = "known (allowed)" if known else "CIRCLE"
            print(f"{tag}: {' , '.join(names)}")
            for p in pairs:
                print(f"    imports each other: {p}")
            if not known:
                failed += 1
    print(f"import circles: {found} found, {failed} not allowed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
