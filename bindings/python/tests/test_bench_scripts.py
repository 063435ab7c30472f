"""The benchmark's Python rows (bench/python/*.py) import what they use from the package.

`make bench` runs these scripts as child processes and prints "not measured" when one
exits early, so a name moved inside ``maru`` (as ``LayerMemory`` did when ``maru.vllm.core``
was split) would otherwise only show up as a missing row in a benchmark table."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

BENCH_PY = pathlib.Path(__file__).resolve().parents[3] / "bench" / "python"
SCRIPTS = sorted(BENCH_PY.glob("*_row.py"))


def test_the_bench_rows_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"adapter_row.py", "connector_row.py", "mooncake_row.py"} <= names, names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_bench_row_imports(script: pathlib.Path):
    # Loaded under its own name, not "__main__": the module's imports and definitions run,
    # its benchmark does not.
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"
