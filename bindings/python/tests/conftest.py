"""Real daemons on loopback for the binding's tests: RM (fake DAX in /dev/shm), a remote
CXL agent and maru-server, from the cargo build (MARU_BIN_DIR or target/debug)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest


def _bin_dir() -> Path:
    env = os.environ.get("MARU_BIN_DIR")
    if env:
        return Path(env)
    for d in (Path.cwd(), *Path(__file__).resolve().parents):
        cand = d / "target" / "debug"
        if (cand / "maru-server").is_file():
            return cand
    raise RuntimeError("daemons not built: run cargo build --workspace --bins or set MARU_BIN_DIR")


class Daemons:
    def __init__(self) -> None:
        self.bin = _bin_dir()
        self.work = Path(tempfile.mkdtemp(prefix="maru-pytest-"))
        self.pool = Path(f"/dev/shm/maru-pytest-{uuid.uuid4().hex[:8]}")
        self.procs: list[subprocess.Popen] = []
        self.key = self.work / "agent.key"
        subprocess.run([str(self.bin / "maru-rm-ctl"), "gen-key", str(self.key)], check=True, capture_output=True)

    def start(self, name: str, *args: str) -> str:
        ready = self.work / f"{name}.ready"
        p = subprocess.Popen(
            [str(self.bin / name), *args, "--port", "0", "--ready-file", str(ready)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.procs.append(p)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if ready.exists() and ready.read_text().endswith("\n"):
                return ready.read_text().strip()
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode} during start-up")
            time.sleep(0.02)
        raise RuntimeError(f"{name} did not start within 20 s")

    def stop(self) -> None:
        # Reverse order: maru-server gives its regions back while the agent and RM run.
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.pool.unlink(missing_ok=True)
        shutil.rmtree(self.work, ignore_errors=True)


@pytest.fixture(scope="session")
def daemons():
    d = Daemons()
    try:
        rm = d.start("maru-resource-manager", "--state-dir", str(d.work / "rm"), "--fake-dax", f"{d.pool}:256M")
        agent = d.start(
            "maru-remote-cxl-agent", "--rm-address", rm, "--key-file", str(d.key), "--device", str(d.pool), "--node", "pytest"
        )
        d.server = d.start(
            "maru-server", "--rm-address", rm, "--remote-cxl-agent", agent,
            "--remote-cxl-agent-key-file", str(d.key), "--region-size", "8M", "--chunk-size", "64K",
        )
        yield d
    finally:
        d.stop()


@pytest.fixture
def config(daemons):
    def make(backend: str, engine: str, **extra):
        c = {
            "backend": backend,
            "server_url": daemons.server,
            "engine_id": engine,
            "namespace": "pytest",
            "agent_key_file": str(daemons.key),
            "load_slots": 8,
            "store_slots": 8,
        }
        c.update(extra)
        return c

    return make
