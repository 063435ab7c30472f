"""scripts/import_cycles.py on tiny crates: a circle fails, a facade and a child's
test module do not, an allowed pair is reported without failing.
Run: python3 -m pytest -q scripts/tests (or python3 scripts/tests/test_import_cycles.py)."""

from __future__ import annotations

import atexit
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "import_cycles.py"
#: Every fixture tree lies under this one directory, removed when the tests end.
ROOT = Path(tempfile.mkdtemp(prefix="import-cycles-test-"))
atexit.register(shutil.rmtree, ROOT, True)


def crate(files: dict) -> Path:
    root = Path(tempfile.mkdtemp(dir=ROOT)) / "src"
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def run(src: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *extra, str(src)], capture_output=True, text=True)


def test_a_circle_between_two_files_fails():
    src = crate({
        "lib.rs": "mod a;\nmod b;\n",
        "a.rs": "use crate::b::B;\npub struct A;\n",
        "b.rs": "pub struct B;\nfn f() { let _ = super::a::A; }\n",
    })
    r = run(src)
    assert r.returncode == 1, r.stdout
    assert "a.rs" in r.stdout and "b.rs" in r.stdout


def test_a_circle_through_three_files_and_a_brace_list_fails():
    src = crate({
        "lib.rs": "mod m;\n",
        "m/mod.rs": "mod x;\nmod y;\nmod z;\n",
        "m/x.rs": "use super::{y::Y, other};\npub struct X;\n",
        "m/y.rs": "use crate::m::z::Z;\npub struct Y;\n",
        "m/z.rs": "use super::x::X as Renamed;\npub struct Z;\n",
    })
    r = run(src)
    assert r.returncode == 1, r.stdout
    assert "1 found" in r.stdout


def test_a_facade_re_export_and_a_test_module_are_not_circles():
    src = crate({
        "lib.rs": "pub mod m;\n",
        "m/mod.rs": "mod core;\nmod ops;\npub use core::Core;\npub use ops::op;\npub fn helper() {}\n",
        "m/core.rs": "pub struct Core;\nfn g() { super::helper(); }\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        "m/ops.rs": "use crate::m::Core;\npub fn op(_: &Core) {}\n",
    })
    r = run(src)
    assert r.returncode == 0, r.stdout
    assert "0 found" in r.stdout


def test_an_allowed_pair_is_reported_not_failed():
    src = crate({
        "lib.rs": "mod a;\nmod b;\n",
        "a.rs": "use crate::b::B;\npub struct A;\n",
        "b.rs": "use crate::a::A;\npub struct B;\n",
    })
    r = run(src, "--allow", f"{src / 'a.rs'}<->{src / 'b.rs'}")
    assert r.returncode == 0, r.stdout
    assert "known (allowed)" in r.stdout


if __name__ == "__main__":
    for name, f in list(globals().items()):
        if name.startswith("test_"):
            f()
            print("ok", name)
