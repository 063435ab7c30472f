"""scripts/py_import_cycles.py on tiny packages: a load-time circle fails, an import in
a function or under TYPE_CHECKING does not count.
Run: python3 -m pytest -q scripts/tests (or python3 scripts/tests/test_py_import_cycles.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "py_import_cycles.py"


def run(files: dict) -> subprocess.CompletedProcess:
    root = Path(tempfile.mkdtemp(prefix="py-import-cycles-test-"))
    try:
        for name, text in files.items():
            p = root / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True)
    finally:
        shutil.rmtree(root, True)


def test_a_load_time_circle_fails_naming_both_files():
    r = run({"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "from .a import f\n"})
    assert r.returncode == 1, r.stdout
    assert "pkg.a" in r.stdout and "pkg.b" in r.stdout


def test_imports_in_functions_and_under_type_checking_do_not_count():
    r = run(
        {
            "pkg/__init__.py": "from .a import f\n",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import g\ndef f():\n    from . import b\n",
            "pkg/b.py": "from .a import f\n",
        }
    )
    assert r.returncode == 0, r.stdout
    assert "0 found" in r.stdout


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
    print("ok")
