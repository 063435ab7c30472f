"""One-host key discovery: maru-server started with its defaults (no ``--key-file``)
makes ``~/.maru/server.key`` (0600) at first start; an engine on the same host whose
configuration names no key (no ``server_key_file``, no ``MARU_SERVER_KEY_FILE``) finds
that file, opens, stores and says which file it used; with the file's mode 0644 the
open is refused with a message naming the file.

The engine runs in a child process so that its ``HOME`` and environment are exactly
those of a fresh shell on that host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINE = r"""
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
logging.getLogger("maru.lib").setLevel(logging.INFO)
import maru
cfg = json.loads(sys.argv[1])
try:
    with maru.Handler(cfg) as h:
        ok = h.store("host-key-k", b"host key bytes")
        back = h.retrieve("host-key-k")
        print(json.dumps({"stored": ok, "back": back.decode() if back else None}))
except maru.MaruError as e:
    print(json.dumps({"error": type(e).__name__, "message": e.message}))
"""


def _engine(daemons, home: Path, server: str) -> tuple:
    cfg = {
        "backend": "cxl",
        "server_url": server,
        "engine_id": "host-key-engine",
        "namespace": "pytest-host-key",
        "timeout_ms": 5000,
    }
    env = {k: v for k, v in os.environ.items() if k != "MARU_SERVER_KEY_FILE"}
    env["HOME"] = str(home)
    r = subprocess.run(
        [sys.executable, "-c", ENGINE, json.dumps(cfg)], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_an_engine_with_no_key_setting_finds_its_hosts_server_key(daemons):
    home = Path(tempfile.mkdtemp(prefix="maru-home-", dir=daemons.work))
    env = {k: v for k, v in os.environ.items() if k != "MARU_SERVER_KEY_FILE"}
    env.update(HOME=str(home), RUST_LOG="warn")
    # maru-server with its defaults: no --key-file, so it makes and uses ~/.maru/server.key.
    with daemons.extra_server("host-key-server", env=env) as server:
        key = home / ".maru" / "server.key"
        assert key.exists() and (key.stat().st_mode & 0o777) == 0o600

        out, err = _engine(daemons, home, server)
        assert out == {"stored": True, "back": "host key bytes"}, (out, err[-2000:])
        # It says which key file it used, once.
        used = [line for line in err.splitlines() if "maru-server key" in line and str(key) in line]
        assert len(used) == 1, err[-2000:]

        # Open to others: refused, naming the file and what to do.
        key.chmod(0o644)
        out, err = _engine(daemons, home, server)
        assert out.get("error") and str(key) in out["message"], out
        assert "chmod 600" in out["message"] and "server_key_file" in out["message"], out

        # No key file at all: no proof, so a keyed server refuses with AuthError.
        key.chmod(0o600)
        key.rename(home / "elsewhere.key")
        out, _ = _engine(daemons, home, server)
        assert out.get("error") == "AuthError", out
