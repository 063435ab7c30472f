#!/usr/bin/env python3
"""Counts the non-test lines of libmaru/src/worker/ at a commit (or the work tree).

Non-test: every .rs file under the folder except *_tests.rs and files under a tests/
folder, less each ``#[cfg(test)]`` item (a module block or a single item: the
attribute line, any attributes after it, and the item's braces counted to their
close). Prints two figures: all lines (blank and comment lines too) and code lines
(neither blank nor only a comment), and the plain ``wc -l`` of the same files.

Usage: worker_lines.py [COMMIT] [--dir libmaru/src/worker]
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def files_at(commit: str | None, folder: str) -> dict[str, str]:
    if commit is None:
        out = subprocess.run(
            ["git", "ls-files", folder], capture_output=True, text=True, check=True
        ).stdout.split()
        return {p: open(p, encoding="utf-8").read() for p in out}
    out = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", commit, folder],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {
        p: subprocess.run(
            ["git", "show", f"{commit}:{p}"], capture_output=True, text=True, check=True
        ).stdout
        for p in out
    }


def is_test_file(path: str) -> bool:
    return path.endswith("_tests.rs") or "/tests/" in path


def strip_cfg_test(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    kept: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].strip().startswith("#[cfg(test)]"):
            depth = 0
            opened = False
            while i < len(lines):
                code = lines[i].split("//")[0]
                depth += code.count("{") - code.count("}")
                opened = opened or "{" in code
                ended = (opened and depth <= 0) or (
                    not opened and code.rstrip().endswith(";")
                )
                i += 1
                if ended:
                    break
            continue
        kept.append(lines[i])
        i += 1
    return kept


def is_code(line: str) -> bool:
    s = line.strip()
    return bool(s) and not s.startswith("//")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("commit", nargs="?")
    ap.add_argument("--dir", default="libmaru/src/worker")
    a = ap.parse_args()
    files = {p: t for p, t in files_at(a.commit, a.dir).items() if p.endswith(".rs")}
    all_lines = code = wc = 0
    for path, text in sorted(files.items()):
        if is_test_file(path):
            continue
        wc += text.count("\n")
        kept = strip_cfg_test(text)
        all_lines += len(kept)
        code += sum(is_code(line) for line in kept)
    print(f"{a.commit or 'work tree'}: non-test lines {all_lines}, code lines {code}, "
          f"wc -l of non-test files {wc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
