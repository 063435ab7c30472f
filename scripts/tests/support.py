"""What the tests of scripts/ share: a tree of files in a scratch directory, one of the
scripts run on it, the check of its exit status and output, and running a test file's
tests without pytest (`python3 scripts/tests/test_<name>.py`)."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1]
#: Every scratch tree lies under this one directory, removed when the tests end.
ROOT = Path(tempfile.mkdtemp(prefix="scripts-test-"))
atexit.register(shutil.rmtree, ROOT, True)


def tree(files: dict) -> Path:
    """A fresh directory holding `files` (relative path: text)."""
    root = Path(tempfile.mkdtemp(dir=ROOT))
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    """scripts/`script` with `args`, its output captured."""
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True)


def expect(r: subprocess.CompletedProcess, status: int, *says: str) -> None:
    """The run exited with `status` and its output holds each of `says`."""
    assert r.returncode == status, r.stdout + r.stderr
    for text in says:
        assert text in r.stdout, f"{text!r} not in:\n{r.stdout}"


def main(names: dict) -> None:
    """Runs every `test_*` function of a test file's globals, in order."""
    for name, fn in list(names.items()):
        if name.startswith("test_"):
            fn()
            print("ok", name)
