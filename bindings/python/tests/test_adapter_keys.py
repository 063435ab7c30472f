"""The adapters take maru-server's key (and the agent key, the backend) from their own
configuration: SGLang's extra config (``MaruSGLangConfig``), LMCache's ``extra_config``
through ``MaruConfig.from_extra_config`` (what ``maru_lmcache.backend`` uses), and a
handler opened from them proves the key named there. No torch or engine needed."""

from __future__ import annotations

import pytest

import maru
from maru.compat import MaruConfig
from maru_sglang.config import MaruSGLangConfig


def test_sglang_extra_config_names_both_keys():
    c = MaruSGLangConfig.from_extra_config(
        {
            "backend_name": "maru",
            "maru_server_url": "tcp://10.0.0.3:5555",
            "maru_storage_backend": "remote_cxl",
            "maru_agent_key_file": "/etc/maru/agent.key",
            "maru_server_key_file": "/etc/maru/tenant-a.key",
            "maru_chunk_size_bytes": "1M",
        }
    )
    lib = c.maru_config().to_libmaru()
    assert (lib["backend"], lib["agent_key_file"], lib["server_key_file"]) == (
        "remote_cxl",
        "/etc/maru/agent.key",
        "/etc/maru/tenant-a.key",
    )
    # Unset: no field, so libmaru's own order applies (MARU_SERVER_KEY_FILE, ~/.maru/server.key).
    assert "server_key_file" not in MaruSGLangConfig.from_extra_config({}).maru_config().to_libmaru()


def test_lmcache_extra_config_names_both_keys():
    extra = {
        "storage_plugin.maru.module_path": "maru_lmcache.backend",  # LMCache's own key: ignored
        "maru_storage_backend": "remote_cxl",
        "maru_agent_key_file": "/a.key",
        "maru_server_key_file": "/s.key",
        "maru_cache_namespace": "llama",
        "maru_load_slots": "8",
        "maru_timeout_ms": 9000,
    }
    c = MaruConfig.from_extra_config(extra, server_url="tcp://h:1", chunk_size_bytes=1 << 20, timeout_ms=5000)
    lib = c.to_libmaru()
    assert (lib["backend"], lib["agent_key_file"], lib["server_key_file"], lib["namespace"]) == (
        "remote_cxl",
        "/a.key",
        "/s.key",
        "llama",
    )
    # What the engine derives wins over the extra config; ints are converted.
    assert (lib["timeout_ms"], lib["load_slots"], lib["server_url"]) == (5000, 8, "h:1")
    with pytest.raises(ValueError, match="maru_server_key_file"):
        MaruConfig.from_extra_config({"maru_server_key_file": 3})
    with pytest.raises(ValueError, match="maru_load_slots"):
        MaruConfig.from_extra_config({"maru_load_slots": "many"})


def test_the_key_named_in_the_extra_config_is_the_one_proved(daemons, tmp_path, monkeypatch):
    """With MARU_SERVER_KEY_FILE naming a wrong key, the extra config's key opens and
    stores; without it the wrong one is proved and the open fails with AuthError."""
    wrong = tmp_path / "wrong.key"
    import subprocess

    subprocess.run([str(daemons.bin / "maru-rm-ctl"), "gen-key", str(wrong)], check=True, capture_output=True, timeout=30)
    monkeypatch.setenv("MARU_SERVER_KEY_FILE", str(wrong))
    base = {"maru_server_url": f"tcp://{daemons.server}", "maru_chunk_size_bytes": "64K", "maru_cache_namespace": "pytest-keys"}
    good = MaruSGLangConfig.from_extra_config({**base, "maru_server_key_file": str(daemons.server_key)})
    h = maru.MaruHandler(good.maru_config())
    assert h.connect()
    try:
        assert h.store("extra-key-k", b"x" * 100)
        assert h.exists("extra-key-k")
    finally:
        h.close()
    with pytest.raises(maru.AuthError):
        maru.Handler(MaruSGLangConfig.from_extra_config(base).maru_config().to_libmaru())
