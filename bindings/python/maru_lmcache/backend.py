"""``MaruPluginBackend``: LMCache's own ``MaruBackend`` as an LMCache storage plugin
whose Maru settings all come from LMCache's ``extra_config``.

LMCache's built-in path (``maru_path``) builds its ``MaruConfig`` from a fixed set of
keys (``maru_instance_id``, ``maru_timeout_ms``, ...), so the backend, the agent key and
maru-server's key reach it only through the environment (``MARU_STORAGE_BACKEND``,
``MARU_AGENT_KEY_FILE``, ``MARU_SERVER_KEY_FILE``). Loaded as a plugin instead, every
``maru_<field>`` key of ``extra_config`` is read (:meth:`maru.MaruConfig.from_extra_config`):
``maru_server_url``, ``maru_storage_backend``, ``maru_agent_key_file``,
``maru_server_key_file``, ``maru_cache_namespace``, ``maru_engine_id``,
``maru_transport``, ``maru_load_slots``, ``maru_store_slots``, ``maru_timeout_ms``, ...::

    storage_plugins: ["maru"]
    extra_config:
      storage_plugin.maru.module_path: maru_lmcache.backend
      storage_plugin.maru.class_name: MaruPluginBackend
      maru_server_url: maru://10.0.0.3:5555
      maru_storage_backend: remote_cxl
      maru_agent_key_file: /etc/maru/remote-cxl-agent.key
      maru_server_key_file: /etc/maru/tenant-a.key

Leave ``maru_path`` unset with the plugin (set, LMCache starts its built-in backend
beside it). Everything else is LMCache's ``MaruBackend``, unedited.
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.storage_backend.maru_backend import MaruBackend

from maru.compat import MaruConfig, MaruHandler

__all__ = ["MaruPluginBackend", "handler_config"]


def handler_config(extra: Any, chunk_size_bytes: int, pool_size: int) -> MaruConfig:
    """The handler's configuration from LMCache's ``extra_config``: ``maru_server_url``
    (``maru://`` or ``tcp://`` host:port) required; LMCache's chunk size and pool size
    as LMCache's built-in backend passes them."""
    extra = dict(extra or {})
    url = extra.get("maru_server_url")
    if not url:
        raise ValueError("maru_lmcache.backend: extra_config needs maru_server_url (maru://host:port)")
    url = str(url)
    if url.startswith("maru://"):
        url = "tcp://" + url[len("maru://") :]
    return MaruConfig.from_extra_config(
        extra,
        server_url=url,
        chunk_size_bytes=chunk_size_bytes,
        pool_size=max(pool_size, chunk_size_bytes),
        auto_connect=False,
        timeout_ms=int(extra.get("maru_timeout_ms", 5000)),
    )


class MaruPluginBackend(MaruBackend):
    """LMCache's ``MaruBackend`` taking its settings from ``extra_config`` (module
    docstring). LMCache builds plugins with keyword arguments."""

    def __init__(self, config: Any, metadata: Any, loop: Any, dst_device: str = "cuda", **_: Any) -> None:
        super().__init__(config, metadata, loop, dst_device)

    def _create_handler(self, config: Any) -> MaruHandler:
        pool = int(float(getattr(config, "maru_pool_size", 0) or 0) * 1024**3)
        handler = MaruHandler(handler_config(config.extra_config, self._full_chunk_size_bytes, pool))
        if not handler.connect():
            raise RuntimeError(f"maru_lmcache: cannot connect to {config.extra_config.get('maru_server_url')}")
        return handler
