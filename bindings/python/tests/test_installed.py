"""When the tests run against an installed wheel (scripts/wheel-test.sh sets
MARU_EXPECT_INSTALLED to the venv), the package and libmaru.so they use are the
wheel's, not the source tree's or a cargo build's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import maru


def test_the_package_under_test_is_the_installed_wheel():
    venv = os.environ.get("MARU_EXPECT_INSTALLED")
    if not venv:
        pytest.skip("not a run against an installed wheel (scripts/wheel-test.sh)")
    venv_dir = Path(venv).resolve()
    assert Path(maru.__file__).resolve().is_relative_to(venv_dir), maru.__file__
    assert Path(maru.library_path).resolve().is_relative_to(venv_dir), maru.library_path
    assert "MARU_LIB" not in os.environ
