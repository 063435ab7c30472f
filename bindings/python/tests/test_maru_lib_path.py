"""MARU_LIB names the library by an absolute path: a relative one would be resolved by
dlopen against the working directory of the moment (``sub/../libmaru.so``) or, as a
bare name, searched on the loader's path (``./libmaru.so`` becomes ``libmaru.so`` for
``pathlib``), so a library planted where the process happens to run could be loaded."""

import shutil

import maru
from test_unit import _import_in_subprocess


def _import_with(maru_lib, cwd):
    return _import_in_subprocess({"MARU_LIB": maru_lib}, cwd)


def test_a_relative_maru_lib_is_refused_even_when_it_names_a_real_library(tmp_path):
    # A library planted in the working directory (and one level down) that the relative
    # forms below would reach.
    (tmp_path / "sub").mkdir()
    shutil.copy(maru.library_path, tmp_path / "libmaru.so")
    for rel in ["sub/../libmaru.so", "./libmaru.so", "libmaru.so", ".", "sub/.."]:
        r = _import_with(rel, tmp_path)
        assert r.returncode != 0, f"MARU_LIB={rel} loaded {r.stdout.strip()}"
        assert "ImportError" in r.stderr, r.stderr
        assert f"MARU_LIB={rel} is a relative path" in r.stderr, r.stderr
        assert "absolute path" in r.stderr, r.stderr


def test_an_absolute_maru_lib_still_loads_as_a_file_or_a_directory(tmp_path):
    shutil.copy(maru.library_path, tmp_path / "libmaru.so")
    for given in [str(tmp_path / "libmaru.so"), str(tmp_path), str(tmp_path / "sub" / ".." / "libmaru.so")]:
        if "sub" in given:
            (tmp_path / "sub").mkdir(exist_ok=True)
        r = _import_with(given, "/")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().endswith("libmaru.so"), r.stdout
