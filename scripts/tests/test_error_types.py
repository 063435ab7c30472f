"""scripts/error_types.py on tiny crates: an error type deriving thiserror passes, one
with a hand-written Display or impl Error fails, an allowed one is reported without
failing. Run: python3 -m pytest -q scripts/tests (or python3 scripts/tests/test_error_types.py)."""

from __future__ import annotations

from support import expect, main, run, tree


def check(lib_rs: str, *extra: str) -> object:
    return run("error_types.py", *extra, str(tree({"lib.rs": lib_rs})))


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
    expect(check(DERIVED), 0, "0 found")


def test_a_hand_written_error_type_fails_naming_it():
    expect(check(HAND_WRITTEN), 1, "HandError")


def test_a_hand_written_impl_error_fails():
    expect(check(HAND_IMPL), 1, "Oops (hand-written impl Error)")


def test_an_allowed_type_is_reported_without_failing():
    expect(check(HAND_WRITTEN, "--allow", "HandError"), 0, "HandError", "allowed")


if __name__ == "__main__":
    main(globals())
