"""Upstream's ``MaruConfig``: its fields, its environment overrides and their checks."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional


def _env_bool(name: str) -> Optional[bool]:
    """An optional boolean environment variable, as upstream reads them: None when
    unset; ValueError for a value that is not 1/0, true/false, yes/no, on/off."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    v = raw.strip().lower()
    if v in {"1", "true", "yes", "on"}:
        return True
    if v in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{name} must be one of: 1/0, true/false, yes/no, on/off (got {raw!r})")


#: MaruConfig fields an environment variable sets when the field is not given.
_ENV_FIELDS = (
    ("storage_backend", "MARU_STORAGE_BACKEND"),
    ("agent_key_file", "MARU_AGENT_KEY_FILE"),
    ("cache_namespace", "MARU_CACHE_NAMESPACE"),
    ("transport", "MARU_TRANSPORT"),
    ("rdma_device", "MARU_RDMA_DEVICE"),
)


def _parse_server_url(url: str) -> str:
    """``tcp://host:port`` (upstream's form) or ``host:port``, comma-separated for
    several pools, as libmaru's ``host:port[,host:port...]``."""
    out = []
    for part in str(url).split(","):
        p = part.strip()
        if p.startswith("tcp://"):
            p = p[len("tcp://") :]
        if not p or ":" not in p:
            raise ValueError(f"server_url {url!r}: each pool must be host:port or tcp://host:port")
        out.append(p)
    return ",".join(out)


@dataclass
class MaruConfig:
    """The upstream ``MaruConfig`` (same fields, defaults and checks), plus libmaru's
    own settings. Upstream fields without an effect on libmaru are accepted and
    validated, then ignored (see the module docstring).

    Upstream fields: ``server_url`` ("tcp://localhost:5555"; also "host:port", or
    several comma-separated pools), ``instance_id`` (random UUID; the libmaru
    ``engine_id`` unless ``engine_id`` is given), ``pool_size`` (100 MiB; ignored),
    ``chunk_size_bytes`` (1 MiB; must not exceed maru-server's ``--chunk-size``, and
    bounds ``alloc``), ``auto_connect`` (True: the ``with`` block connects),
    ``timeout_ms`` (2000: libmaru's control-call and transfer-batch timeout, also how
    long ``alloc`` waits for a slot), ``use_async_rpc``, ``max_inflight``, ``eager_map``,
    ``auto_expand``, ``expand_size``, ``rm_address``, ``enable_stats`` (ignored),
    ``storage_backend`` / ``engine_id`` / ``cache_namespace`` (later upstream names:
    backend, engine id, namespace).

    libmaru's: ``backend`` ("cxl" or "remote_cxl"; default ``storage_backend`` or
    "cxl"), ``transport`` ("soft" or "verbs", remote_cxl), ``rdma_device``,
    ``agent_key_file`` (remote_cxl; default ``~/.maru/remote-cxl-agent.key``),
    ``server_key_file`` (maru-server's key, or the engine's tenant's; default
    ``MARU_SERVER_KEY_FILE``, else ``~/.maru/server.key`` when it exists: libmaru's
    order, docs/configuration.md), ``layout`` (KV-layout digest), ``load_slots`` / ``store_slots`` (32 each: retrieved
    views on ``remote_cxl`` and outstanding ``alloc`` handles held at once; the staging
    buffer is chunk size × their sum), ``max_views`` (256: retrieved in-place views held
    at once on ``cxl``, each a lease at maru-server), ``retrieve_recycle`` (True: see
    ``MaruHandler.retrieve``), ``retrieve_writable`` (True: ``cxl`` in-place views are
    exported writable, as upstream's, so ``ctypes.c_char.from_buffer(info.view)`` works;
    the memory stays mapped read-only, so a write through them kills the process
    instead of changing another engine's chunk; False: read-only memoryviews, a write
    raises TypeError).
    """

    server_url: str = "tcp://localhost:5555"
    instance_id: Optional[str] = None
    pool_size: int = 1024 * 1024 * 100
    chunk_size_bytes: int = 1024 * 1024
    auto_connect: bool = True
    timeout_ms: int = 2000
    use_async_rpc: bool = True
    max_inflight: int = 64
    eager_map: bool = True
    auto_expand: bool = True
    expand_size: Optional[int] = None
    rm_address: str = "127.0.0.1:9850"
    enable_stats: bool = False
    storage_backend: Optional[str] = None
    engine_id: Optional[str] = None
    cache_namespace: Optional[str] = None
    # libmaru's own settings.
    backend: Optional[str] = None
    transport: Optional[str] = None
    rdma_device: Optional[str] = None
    agent_key_file: Optional[str] = None
    server_key_file: Optional[str] = None
    layout: Optional[str] = None
    load_slots: int = 32
    store_slots: int = 32
    max_views: int = 256
    retrieve_recycle: bool = True
    retrieve_writable: bool = True
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # As upstream: MARU_EAGER_MAP=1/0 (true/false, yes/no, on/off) overrides the
        # field; any other value is an error.
        env = _env_bool("MARU_EAGER_MAP")
        if env is not None:
            self.eager_map = env
        # MARU_STAT=1/0 overrides enable_stats, as upstream (other values: ValueError).
        env = _env_bool("MARU_STAT")
        if env is not None:
            self.enable_stats = env
        # Settings upstream's adapters have no key for (LMCache's MaruBackend builds its
        # MaruConfig with a fixed set): environment variables give them when unset.
        for name, var in _ENV_FIELDS:
            if getattr(self, name) is None and os.environ.get(var):
                if name == "storage_backend" and self.backend is not None:
                    continue  # the backend was given
                setattr(self, name, os.environ[var])
        if self.instance_id is None:
            self.instance_id = str(uuid.uuid4())
        if self.chunk_size_bytes <= 0:
            raise ValueError(f"chunk_size_bytes must be positive, got {self.chunk_size_bytes}")
        if self.pool_size < 0:
            raise ValueError("pool_size must be nonnegative")
        if self.pool_size < self.chunk_size_bytes:
            raise ValueError(f"pool_size ({self.pool_size}) must be >= chunk_size_bytes ({self.chunk_size_bytes})")
        if self.expand_size is not None:
            if not self.auto_expand:
                raise ValueError("expand_size requires auto_expand=True")
            if self.expand_size < self.chunk_size_bytes:
                raise ValueError(
                    f"expand_size ({self.expand_size}) must be >= chunk_size_bytes ({self.chunk_size_bytes})"
                )
        if self.backend and self.storage_backend and self.backend != self.storage_backend:
            raise ValueError(f"backend {self.backend!r} and storage_backend {self.storage_backend!r} disagree")
        b = self.backend or self.storage_backend or "cxl"
        if b in ("cpu", "mixed"):
            raise ValueError(
                f"storage_backend {b!r} is not offered by libmaru: use 'cxl' (this host maps the CXL device) "
                "or 'remote_cxl' (memory nodes' CXL over RDMA)"
            )
        if b not in ("cxl", "remote_cxl"):
            raise ValueError(f"backend must be 'cxl' or 'remote_cxl', not {b!r}")
        self.backend = b
        if self.timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive")
        for name in ("load_slots", "store_slots", "max_views"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, not {v!r}")
        _parse_server_url(self.server_url)

    @classmethod
    def from_extra_config(cls, extra: Optional[Dict[str, Any]], **given: Any) -> "MaruConfig":
        """A configuration from an engine's extra config (LMCache's ``extra_config``,
        SGLang's extra config): each field from its ``maru_<field>`` key
        (``maru_storage_backend``, ``maru_agent_key_file``, ``maru_server_key_file``,
        ``maru_cache_namespace``, ...); ``given`` (what the engine itself derives, such
        as ``server_url`` and ``chunk_size_bytes``) wins over the extra config. Other
        keys are the engine's own and are left alone. A value of the wrong kind is a
        ValueError naming the key."""
        kinds = {f.name: f.type for f in fields(cls) if f.name != "extra"}
        kw: Dict[str, Any] = {}
        for name, kind in kinds.items():
            key = f"maru_{name}"
            if not extra or key not in extra or name in given:
                continue
            v = extra[key]
            if "int" in str(kind) and not isinstance(v, bool):
                try:
                    v = int(v)
                except (TypeError, ValueError):
                    raise ValueError(f"extra config {key} must be an integer, not {v!r}") from None
            elif "str" in str(kind) and v is not None and not isinstance(v, str):
                raise ValueError(f"extra config {key} must be a string, not {v!r}")
            kw[name] = v
        kw.update(given)
        return cls(**kw)

    def to_libmaru(self) -> Dict[str, Any]:
        """The libmaru handler configuration (docs/configuration.md) this stands for."""
        c: Dict[str, Any] = {
            "backend": self.backend,
            "server_url": _parse_server_url(self.server_url),
            "engine_id": self.engine_id or self.instance_id,
            "load_slots": self.load_slots,
            "store_slots": self.store_slots,
            "timeout_ms": self.timeout_ms,
        }
        for ours, theirs in (
            ("namespace", self.cache_namespace),
            ("layout", self.layout),
            ("agent_key_file", self.agent_key_file),
            ("server_key_file", self.server_key_file),
            ("transport", self.transport),
            ("rdma_device", self.rdma_device),
        ):
            if theirs is not None:
                c[ours] = theirs
        c.update(self.extra)
        return c
