"""A key that does not prove raises AuthError (``MARU_ERR_AUTH``) at open: a wrong
agent key, and a wrong maru-server key (``MARU_SERVER_KEY_FILE``)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from typing import Iterator

import pytest

import maru
from maru import AuthError, MaruHandler


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
        MaruHandler(config("remote_cxl", "auth-agent", agent_key_file=wrong))
    assert e.value.code == maru.Status.AUTH
    assert "agent" in e.value.message and "authentication" in e.value.message, e.value.message


def test_a_wrong_maru_server_key_is_an_auth_error(daemons, config, monkeypatch):
    key = gen_key(daemons, "server.key")
    wrong = gen_key(daemons, "wrong-server.key")
    with keyed_server(daemons, key) as keyed:
        monkeypatch.setenv("MARU_SERVER_KEY_FILE", wrong)
        with pytest.raises(AuthError) as e:
            MaruHandler(config("cxl", "auth-server", server_url=keyed))
        assert e.value.code == maru.Status.AUTH
        assert "maru-server" in e.value.message and "key" in e.value.message, e.value.message
        # The right key opens.
        monkeypatch.setenv("MARU_SERVER_KEY_FILE", key)
        with MaruHandler(config("cxl", "auth-server", server_url=keyed)) as h:
            assert h.store("auth-k", b"bytes")
            assert h.retrieve("auth-k") == b"bytes"
