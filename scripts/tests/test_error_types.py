"""scripts/error_types.py on tiny crates: an error type deriving thiserror passes, one
with a hand-written Display or impl Error fails, an allowed one is reported without
failing. Run: python3 -m pytest -q scripts/tests (or python3 scripts/tests/test_error_types.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "error_types.py"


def run(lib_rs: str, *extra: str) -> subprocess.CompletedProcess:
    root = Path(tempfile.mkdtemp(prefix="error-types-test-"))
    try:
        (root / "lib.rs").write_text(lib_rs)
        return subprocess.run([sys.executable, str(SCRIPT), *extra, str(root)], capture_output=True, text=True)
    finally:
        shutil.rmtree(root, True)


DERIVED = """
use thiserror::Error;

/// A failure.
#[derive(Debug, Clone,
         Error)]
pub enum GoodError {
    #[error("bad")]
    Bad,
}

#[derive(Debug, thiserror::Error)]
#[error("also {0}")]
pub(crate) struct OtherError(String);
"""

HAND_WRITTEN = """
#[derive(Debug)]
pub enum HandError { Bad }
impl std::fmt::Display for HandError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { write!(f, "bad") }
}
"""

HAND_IMPL = """
#[derive(Debug)]
pub struct Oops;
impl std::error::Error for Oops {}
"""


def test_types_deriving_thiserror_pass():
    r = run(DERIVED)
    assert r.returncode == 0, r.stdout
    assert "0 found" in r.stdout


def test_a_hand_written_error_type_fails_naming_it():
    r = run(HAND_WRITTEN)
    assert r.returncode == 1
    assert "HandError" in r.stdout


def test_a_hand_written_impl_error_fails():
    r = run(HAND_IMPL)
    assert r.returncode == 1
    assert "Oops (hand-written impl Error)" in r.stdout


def test_an_allowed_type_is_reported_without_failing():
    r = run(HAND_WRITTEN, "--allow", "HandError")
    assert r.returncode == 0, r.stdout
    assert "HandError" in r.stdout and "allowed" in r.stdout


if __name__ == "__main__":
    for name, fn in list(globals().items()):
        if name.startswith("test_"):
            fn()
    print("ok")
