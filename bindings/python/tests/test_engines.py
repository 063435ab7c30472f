"""LMCache's and SGLang's own Maru backends, unedited, on this package alone (its
maru, maru_lmcache and maru_sglang), between two processes, on both backends, against
the daemons of conftest.py. Run where LMCache and SGLang are installed (make test-vllm
installs them into the vLLM venv); skipped elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COMPAT = ROOT / "examples" / "compat"
TIMEOUT_S = 300

BACKENDS = ["cxl", "remote_cxl"]


def run(script: str, daemons, backend: str, *args: str, keys_from_env: bool = True) -> str:
    env = dict(os.environ, MARU_STORAGE_BACKEND=backend, MARU_AGENT_KEY_FILE=str(daemons.key))
    if not keys_from_env:
        # Only the engine's own configuration names the key files: no variable, and a
        # HOME without ~/.maru (libmaru's defaults would find nothing).
        for var in ("MARU_AGENT_KEY_FILE", "MARU_SERVER_KEY_FILE"):
            env.pop(var, None)
        env["HOME"] = str(daemons.work)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bindings" / "python"), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, str(COMPAT / script), "--server", daemons.server, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{script} {' '.join(args)} failed ({p.returncode}):\n{out[-4000:]}"
    return out


#: An upstream engine's storage backend, written by one process and read by another:
#: its example script, the engine's module, and per role what the script prints.
ENGINES = {
    "lmcache": ("lmcache_backend.py", "lmcache.v1.storage_backend.maru_backend", ("store", "stored 8 chunks"), ("load", "every byte equal")),
    "sglang": ("sglang_storage.py", "sglang.srt.mem_cache.storage.backend_factory", ("set", "set 6 pages"), ("get", "every byte equal")),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_an_engine_storage_backend_between_two_processes(engine, backend, daemons):
    """LMCache's MaruBackend and SGLang's storage backend factory: what one process
    stores, another loads, every byte equal."""
    script, module, *roles = ENGINES[engine]
    pytest.importorskip("torch")
    pytest.importorskip(module)
    ns = f"{engine}-{backend}-{uuid.uuid4().hex[:8]}"
    for role, says in roles:
        assert says in run(script, daemons, backend, "--role", role, "--ns", ns)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lmcache_plugin_and_sglang_take_both_keys_from_their_extra_config(backend, daemons):
    """LMCache (maru_lmcache.backend.MaruPluginBackend) and SGLang (maru_sglang) with the
    agent key and maru-server's key named only in their extra config."""
    pytest.importorskip("torch")
    pytest.importorskip("lmcache.v1.storage_backend.maru_backend")
    pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")
    keys = ["--agent-key-file", str(daemons.key), "--server-key-file", str(daemons.server_key)]
    ns = f"lmc-plugin-{backend}-{uuid.uuid4().hex[:8]}"
    lmc = ["--plugin", "--plugin-backend", backend, *keys]
    out = run("lmcache_backend.py", daemons, backend, "--role", "store", "--ns", ns, *lmc, keys_from_env=False)
    assert "stored 8 chunks" in out
    out = run("lmcache_backend.py", daemons, backend, "--role", "load", "--ns", ns, *lmc, keys_from_env=False)
    assert "every byte equal" in out
    ns = f"sgl-keys-{backend}-{uuid.uuid4().hex[:8]}"
    assert "set 6 pages" in run("sglang_storage.py", daemons, backend, "--role", "set", "--ns", ns, *keys, keys_from_env=False)
    assert "every byte equal" in run("sglang_storage.py", daemons, backend, "--role", "get", "--ns", ns, *keys, keys_from_env=False)


def test_maru_vllm_is_the_connector_vllm_loads_by_upstreams_module_name():
    pytest.importorskip("vllm")
    import importlib

    import maru.vllm.connector

    # What vLLM does with "kv_connector_module_path": "maru_vllm", "kv_connector": "MaruKVConnector".
    cls = getattr(importlib.import_module("maru_vllm"), "MaruKVConnector")
    assert cls is maru.vllm.connector.MaruKVConnector
    assert importlib.import_module("maru_vllm.connector").MaruKVConnector is cls
