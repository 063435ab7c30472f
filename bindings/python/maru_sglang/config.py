"""``MaruSGLangConfig``: the ``maru_*`` keys of SGLang's
``--hicache-storage-backend-extra-config``, upstream's and this package's."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Union

from maru.compat import MaruConfig

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(size: Union[str, int, float]) -> int:
    """Bytes of ``4G``, ``512M``, ``1.5G``, ``64KB`` or a plain number."""
    if isinstance(size, bool):
        raise ValueError(f"Invalid size: {size!r}")
    if isinstance(size, (int, float)):
        return int(size)
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)B?\s*", str(size).upper())
    if not m:
        raise ValueError(f"Invalid size: {size!r} (a number of bytes, or with K, M, G, T)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass
class MaruSGLangConfig:
    """What :class:`~maru_sglang.maru_storage.MaruStorage` connects with.

    Upstream's keys (``maru_`` + the field): ``server_url``, ``pool_size``,
    ``chunk_size_bytes`` (sizes as ``4G``/``1M`` or bytes), ``instance_id``,
    ``timeout_ms``, ``use_async_rpc``, ``max_inflight``, ``eager_map``. This package's:
    ``storage_backend`` (``cxl`` or ``remote_cxl``; default the ``MARU_STORAGE_BACKEND``
    environment variable, else ``cxl``), ``agent_key_file`` (remote_cxl),
    ``server_key_file`` (maru-server's key, or the engine's tenant's; unset:
    ``MARU_SERVER_KEY_FILE``, else ``~/.maru/server.key`` when it exists),
    ``cache_namespace``, ``engine_id``, ``transport``, ``load_slots``, ``store_slots``
    (see :class:`maru.MaruConfig`)."""

    server_url: str = "tcp://localhost:5555"
    pool_size: int = 4 << 30
    chunk_size_bytes: int = 1 << 20
    instance_id: Optional[str] = None
    timeout_ms: int = 2000
    use_async_rpc: bool = True
    max_inflight: int = 64
    eager_map: bool = True
    storage_backend: Optional[str] = None
    agent_key_file: Optional[str] = None
    server_key_file: Optional[str] = None
    cache_namespace: Optional[str] = None
    engine_id: Optional[str] = None
    transport: Optional[str] = None
    load_slots: int = 32
    store_slots: int = 32
    extra: Dict[str, Any] = field(default_factory=dict)

    _SIZES = ("pool_size", "chunk_size_bytes")

    @staticmethod
    def from_extra_config(extra: Optional[Dict[str, Any]]) -> "MaruSGLangConfig":
        """From SGLang's extra config dict: each field from its ``maru_`` key; other
        keys (SGLang's own: ``backend_name``, ``module_path``, ...) are not ours."""
        c = MaruSGLangConfig()
        for f in fields(MaruSGLangConfig):
            key = f"maru_{f.name}"
            if f.name == "extra" or not extra or key not in extra:
                continue
            v = extra[key]
            if f.name in MaruSGLangConfig._SIZES:
                v = parse_size(v)
            elif f.name in ("timeout_ms", "max_inflight", "load_slots", "store_slots"):
                v = int(v)
            setattr(c, f.name, v)
        return c

    def maru_config(self) -> MaruConfig:
        """The handler configuration (checked: ValueError naming the bad field): every
        field but ``extra`` under its own name (each is a :class:`maru.MaruConfig`
        field), the pool at least one chunk, not connected yet."""
        given = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        given["pool_size"] = max(self.pool_size, self.chunk_size_bytes)
        return MaruConfig(auto_connect=False, **given)
