"""A key that does not prove raises AuthError (``MARU_ERR_AUTH``) at open: a wrong
agent key, and a wrong maru-server key (``server_key_file``, and
``MARU_SERVER_KEY_FILE`` when the configuration names none)."""

from __future__ import annotations

import subprocess

import pytest

import maru
from maru import AuthError, Handler


def gen_key(daemons, name: str) -> str:
    path = daemons.work / name
    subprocess.run(
        [str(daemons.bin / "maru-rm-ctl"), "gen-key", str(path)], check=True, capture_output=True, timeout=30
    )
    return str(path)


def keyed_server(daemons, key: str):
    """A maru-server of the session's RM that every worker must prove ``key`` to; its
    address while the block runs."""
    return daemons.extra_server("keyed-server", "--key-file", key)


def test_a_wrong_agent_key_is_an_auth_error(daemons, config):
    wrong = gen_key(daemons, "wrong-agent.key")
    with pytest.raises(AuthError) as e:
        Handler(config("remote_cxl", "auth-agent", agent_key_file=wrong))
    assert e.value.code == maru.Status.AUTH
    assert "agent" in e.value.message and "authentication" in e.value.message, e.value.message


def test_a_wrong_maru_server_key_is_an_auth_error(daemons, config, monkeypatch):
    key = gen_key(daemons, "keyed-server.key")
    wrong = gen_key(daemons, "wrong-server.key")
    with keyed_server(daemons, key) as keyed:
        with pytest.raises(AuthError) as e:
            Handler(config("cxl", "auth-server", server_url=keyed, server_key_file=wrong))
        assert e.value.code == maru.Status.AUTH
        assert "maru-server" in e.value.message and "key" in e.value.message, e.value.message
        # The same through the environment, for a configuration that names no key file.
        cfg = config("cxl", "auth-server", server_url=keyed)
        del cfg["server_key_file"]
        monkeypatch.setenv("MARU_SERVER_KEY_FILE", wrong)
        with pytest.raises(AuthError):
            Handler(cfg)
        # The right key opens.
        monkeypatch.setenv("MARU_SERVER_KEY_FILE", key)
        with Handler(cfg) as h:
            assert h.store("auth-k", b"bytes")
            assert h.retrieve("auth-k") == b"bytes"
