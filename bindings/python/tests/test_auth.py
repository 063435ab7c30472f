"""A key that does not prove raises AuthError (``MARU_ERR_AUTH``) at open: a wrong
agent key, and a wrong maru-server key (``server_key_file``)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from typing import Iterator

import pytest

import maru
from maru import AuthError, Handler


def gen_key(daemons, name: str) -> str:
    path = daemons.work / name
    subprocess.run(
        [str(daemons.bin / "maru-rm-ctl"), "gen-key", str(path)], check=True, capture_output=True, timeout=30
    )
    return str(path)


@contextlib.contextmanager
def keyed_server(daemons, key: str) -> Iterator[str]:
    """A maru-server of the session's RM that every worker must prove ``key`` to; its
    address."""
    ready = daemons.work / "keyed-server.ready"
    p = subprocess.Popen(
        [
            str(daemons.bin / "maru-server"),
            "--rm-address", daemons.rm,
            "--rm-key-file", str(daemons.work / "rm" / "rm.key"),
            "--key-file", key,
            "--region-size", "8M",
            "--chunk-size", "64K",
            "--port", "0",
            "--in-memory",
            "--ready-file", str(ready),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while not (ready.exists() and ready.read_text().endswith("\n")):
            assert p.poll() is None and time.monotonic() < deadline, "the keyed maru-server did not start"
            time.sleep(0.02)
        yield ready.read_text().strip()
    finally:
        p.terminate()
        p.wait(timeout=15)


def test_a_wrong_agent_key_is_an_auth_error(daemons, config):
    wrong = gen_key(daemons, "wrong-agent.key")
    with pytest.raises(AuthError) as e:
        Handler(config("remote_cxl", "auth-agent", agent_key_file=wrong))
    assert e.value.code == maru.Status.AUTH
    assert "agent" in e.value.message and "authentication" in e.value.message, e.value.message


def test_a_wrong_maru_server_key_is_an_auth_error(daemons, config):
    # The session's daemons already have a server.key: this server gets its own.
    key = gen_key(daemons, "keyed-server.key")
    wrong = gen_key(daemons, "wrong-server.key")
    with keyed_server(daemons, key) as keyed:
        with pytest.raises(AuthError) as e:
            Handler(config("cxl", "auth-server", server_url=keyed, server_key_file=wrong))
        assert e.value.code == maru.Status.AUTH
        assert "maru-server" in e.value.message and "key" in e.value.message, e.value.message
        # The right key opens.
        with Handler(config("cxl", "auth-server", server_url=keyed, server_key_file=key)) as h:
            assert h.store("auth-k", b"bytes")
            assert h.retrieve("auth-k") == b"bytes"
