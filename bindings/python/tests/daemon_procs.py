"""Starting a Maru daemon on a free port and stopping it: what the Python tests
(``conftest.py``) and the vLLM end-to-end run (``examples/vllm/e2e.py``) share.

A daemon started with ``--port 0 --ready-file F`` writes its address to F, as one
line, once it listens; :func:`start_ready` waits for that line (bounded), and says
why when the daemon exits first or stays silent, with the end of its log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0


def log_tail(path: Path, n: int = 2000) -> str:
    """The last ``n`` characters of a log ("" when it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def start_ready(
    argv: Sequence[str],
    ready: Path,
    log_path: Path,
    env: Optional[Dict[str, str]] = None,
    timeout: float = START_TIMEOUT_S,
) -> Tuple[subprocess.Popen, str]:
    """Starts ``argv`` with ``--port 0 --ready-file ready`` added, its output appended
    to ``log_path``, and returns the process and the address it listens on. Raises
    ``RuntimeError`` (the process killed) when it exits or stays silent for ``timeout``
    seconds. ``env`` defaults to this process's with ``RUST_LOG`` at ``warn``."""
    if env is None:
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
    ready.unlink(missing_ok=True)
    name = Path(argv[0]).name
    with open(log_path, "ab") as log:
        p = subprocess.Popen(
            [*argv, "--port", "0", "--ready-file", str(ready)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            text = ready.read_text()
            if text.endswith("\n") and text.strip():
                return p, text.strip()
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with {p.returncode} during start-up:\n{log_tail(log_path)}")
        time.sleep(0.02)
    stop(p)
    raise RuntimeError(f"{name} did not start within {timeout} s:\n{log_tail(log_path)}")


def stop(p: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout)
