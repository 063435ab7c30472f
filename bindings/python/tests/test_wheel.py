"""The platform wheel: built from the Rust sources by setuptools-rust (cargo's debug
profile, in target/wheel, so later runs are incremental), installed into a fresh venv
in a temporary directory, and imported from `/` with no MARU_LIB: the library inside
the wheel is the one loaded, and it works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PKG = HERE.parent
REPO = PKG.parent.parent


def test_the_wheel_carries_libmaru_and_imports_from_anywhere(tmp_path):
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed: the wheel builds libmaru from source")
    try:
        import setuptools_rust  # noqa: F401
    except ImportError:
        pytest.skip("setuptools-rust is not installed here (make test-python installs it)")
    env = {k: v for k, v in os.environ.items() if k not in ("MARU_LIB", "PYTHONPATH")}
    env.update(MARU_WHEEL_DEBUG="1", CARGO_TARGET_DIR=str(REPO / "target" / "wheel"))
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", str(wheels), str(PKG)],
        env=env, capture_output=True, text=True, timeout=1500,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = wheels.glob("maru-*.whl")
    assert not wheel.name.endswith("-none-any.whl"), f"{wheel.name} is not a platform wheel"
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("maru/libmaru") and n.endswith(".so") for n in names), names

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    code = (
        "import maru, maru.compat, maru_handler, maru_common, maru_lmcache, maru_sglang, maru_vllm; "
        "import maru_sglang.config, maru_handler.memory.types, maru_common.logging_setup; "
        "assert maru.MaruHandler is maru.compat.MaruHandler and maru_sglang.MaruSGLangConfig; "
        "print(maru.library_path); "
        "print(maru.chunk_keys([1, 2, 3, 4], 2, 'ns')[1])"
    )
    r = subprocess.run([str(py), "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    path, key = r.stdout.split()
    assert Path(path).resolve().is_relative_to(env_dir.resolve()), f"loaded {path}, not the wheel's library"
    assert len(key) == 64
