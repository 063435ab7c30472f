"""examples/compat/lmcache_like.py, an adapter written for the upstream Maru API, runs
unchanged against the daemons on both backends and its checksums match."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CHUNK_SIZE

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "compat" / "lmcache_like.py"


@pytest.mark.parametrize("backend", ["remote_cxl", "cxl"])
def test_lmcache_like_example(backend, daemons):
    assert EXAMPLE.is_file(), EXAMPLE
    cmd = [sys.executable, str(EXAMPLE), "--server", f"tcp://{daemons.server}", "--chunk-size", str(CHUNK_SIZE),
           "--chunks", "12", "--storage-backend", backend, "--namespace", f"example-{backend}"]
    if backend == "remote_cxl":
        cmd += ["--agent-key-file", str(daemons.key)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["checksums"] == "match" and out["hits"] == out["chunks"] == 12 and out["mismatches"] == 0
    assert out["bytes_loaded"] == 11 * CHUNK_SIZE + CHUNK_SIZE // 3 + 1
