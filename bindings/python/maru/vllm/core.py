"""The vLLM connector's logic without vLLM or torch, scheduler side: settings, the
namespace digest, chunk keys, the handlers' placement and the scheduler's bookkeeping.
The worker's loads and stores are :mod:`maru.vllm.worker`. The vLLM class
(:mod:`maru.vllm.connector`) only converts vLLM's objects into the plain values these
take, so everything here is tested without vLLM installed.

A *chunk* is ``chunk_tokens`` consecutive tokens of a prompt (a multiple of vLLM's block
size) with the KV of all layers; it is stored as one Maru chunk under the key
``maru.chunk_keys(tokens, chunk_tokens, keyspace)[i]``, where the keyspace is
``"<maru_cache_namespace>/<digest>/tp<rank>"`` and the digest covers what makes KV bytes
interchangeable between engines (:func:`namespace_digest`). Only full chunks are
stored and loaded; a partial last chunk is always computed.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..errors import ConfigError, MaruError, Status
from ..key_files import check_key_file
from ..keys import chunk_keys

log = logging.getLogger("maru.vllm")

DEFAULT_CHUNK_TOKENS = 256
BACKENDS = ("cxl", "remote_cxl")
TRANSPORTS = ("soft", "verbs")
# How long a connector waits before it tries to open its handler again after maru-server
# was unreachable (meanwhile every lookup is a miss and nothing is stored).
REOPEN_BACKOFF_S = 5.0
# Warnings about chunks not stored (no free slot, maru-server or a pool away) and about
# reopening are logged at most this often each, with the count since the last one.
SKIP_LOG_INTERVAL_S = 60.0
# Bound on waiting for the stores still in flight when the worker shuts down.
SHUTDOWN_WAIT_S = 10.0
# A chunk planned for store is not planned again (by another request sharing it, in a
# later step) for this long: its store is in flight or done. If it failed, a request
# after that stores it.
RESTORE_AFTER_S = 10.0
# Bound on the chunks remembered for RESTORE_AFTER_S.
RECENT_STORES_MAX = 1 << 16
# Chunks read in place (cxl) under one lease request.
VIEW_BATCH = 64
# libmaru's default timeout_ms, for the waits on operations the connector submits.
DEFAULT_TIMEOUT_MS = 10_000
#: Status codes that no retry fixes: a handler that fails to open with one of them
#: stops the engine at start (a wrong setting or key).
FATAL_AT_START = (Status.CONFIG, Status.AUTH)

# Fields of a Hugging Face model config that do not change the KV bytes: where the
# model was loaded from, the library version, and generation-only settings. The digest
# leaves them out so engines loading one model from different paths share keys.
_NON_KV_CONFIG_FIELDS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "_attn_implementation_autoset",
        "_attn_implementation",
        "torch_dtype",
        "dtype",
        "use_cache",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "torchscript",
        "pruned_heads",
        "id2label",
        "label2id",
        "task_specific_params",
        "problem_type",
        "tokenizer_class",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
    }
)


# Where libmaru's threads run ----------------------------------------------------------


#: Names of the threads libmaru starts (``maru-handler``, ``maru-op-N``,
#: ``maru-prefault``, the transports').
LIBMARU_THREADS = ("maru-", "soft-transport", "verbs-")
# How long a new thread that still has its creator's name is looked at again: a thread
# libmaru starts names itself when it first runs, which on a busy compute core (the
# creator's, which it inherits) can come after several calls.
YOUNG_S = 10.0


class Placement:
    """The cores libmaru's threads in a worker run on. vLLM binds a CPU worker's main
    thread (its OpenMP master, which also runs the connector) to its compute cores, and
    a thread inherits the cores of the thread that starts it, so libmaru's threads
    (heartbeat, asynchronous operations, transport, prefault), started inside its
    calls, would take CPU from the forward pass. After each libmaru call that started a
    thread, libmaru's new threads are moved to ``cores`` (those the process may use that
    the compute does not); the threads they start inherit those. The calling thread
    itself stays where it is (moving it to another core and back costs a wait for that
    core at each call). ``cores`` None or empty: nothing changes."""

    def __init__(self, cores: Optional[Iterable[int]] = None):
        self.cores = frozenset(cores or ())
        self._seen: Set[int] = set()  # threads looked at (moved, or not libmaru's)
        self._young: Dict[int, float] = {}  # new threads still named as their creator -> first seen

    @staticmethod
    def off_compute(wider: Optional[Iterable[int]] = None) -> "Placement":
        """The cores of ``wider`` (by default those of the parent process: vLLM's
        engine-core process, which is not bound) that this thread is not bound to."""
        try:
            mine = os.sched_getaffinity(0)
            allowed = set(wider) if wider is not None else os.sched_getaffinity(os.getppid())
        except OSError:
            return Placement()
        return Placement(allowed - mine)

    def settle_started(self, timeout_s: float = 1.0) -> int:
        """``settle`` right after a call that started threads (the open): the threads
        it started may not have named themselves yet, and no later call may come to
        look again (a worker whose calls do not go through the handler's wrapper), so
        this looks again every 5 ms until no new thread is left unnamed, at most
        ``timeout_s``; returns how many it moved."""
        moved = self.settle()
        deadline = time.monotonic() + timeout_s
        while self._young and time.monotonic() < deadline:
            time.sleep(0.005)
            moved += self.settle()
        return moved

    def settle(self) -> int:
        """Moves libmaru's threads started since the last look to ``cores``; returns how
        many it moved. Cheap when no thread was started (one read of the thread list).
        A thread libmaru starts in the background (the transport's, started by an
        operation's thread) is moved at the next call. A new thread that still has its
        creator's name (it names itself once it runs) is looked at again at the next
        calls, for ``YOUNG_S`` seconds."""
        if not self.cores:
            return 0
        try:
            tids = set(map(int, os.listdir("/proc/self/task")))
            self._seen &= tids
            if not tids - self._seen:
                return 0
            with open("/proc/thread-self/comm") as f:
                inherited = f.read()
            moved = 0
            for tid in tids - self._seen:
                try:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        name = f.read()
                    if name.startswith(LIBMARU_THREADS):
                        os.sched_setaffinity(tid, self.cores)
                        moved += 1
                    elif name == inherited and time.monotonic() - self._young.setdefault(tid, time.monotonic()) < YOUNG_S:
                        continue
                except OSError:
                    pass  # gone meanwhile
                self._young.pop(tid, None)
                self._seen.add(tid)
            return moved
        except (OSError, ValueError):
            return 0

    def wrap(self, handler: Any) -> Any:
        """``handler`` whose method calls are followed by :meth:`settle` (itself when
        there are no cores to move threads to)."""
        return _Placed(handler, self) if self.cores else handler


class _Placed:
    """A handler whose method calls are followed by its :class:`Placement`'s settle."""

    def __init__(self, handler: Any, place: Placement):
        self._h = handler
        self._place = place

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._h, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self._place.settle()

        return call


# Logs ------------------------------------------------------------------------------


def log_through(engine_logger: str = "vllm") -> None:
    """Sends the records of the ``maru`` loggers (this connector's, ``maru.vllm``, and
    libmaru's own lines, ``maru.lib.*``) through the handlers of the engine's logger,
    so they come out in its format (vLLM's: process name and pid, level, time, where)
    at its level, once each: the ``maru`` logger takes the engine's handlers once per
    process, however many connectors the process makes (scheduler and worker in one
    process, several engines), and does not propagate (no second copy through the
    root logger). libmaru's lines are forwarded from the engine's level (INFO: pools
    going away and back, the staging buffer pinned)."""
    src = logging.getLogger(engine_logger)
    dst = logging.getLogger("maru")
    for h in src.handlers:
        if h not in dst.handlers:
            dst.addHandler(h)
    if not src.handlers:
        return  # the engine logs through the root logger: so does maru (propagation)
    dst.propagate = False
    if dst.level == logging.NOTSET:
        dst.setLevel(src.getEffectiveLevel())
    from .._log import set_log_level

    set_log_level(logging.getLogger(ROOT_LIB).getEffectiveLevel())


ROOT_LIB = "maru.lib"


# Settings --------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The connector's settings, from ``kv_connector_extra_config`` (keys ``maru_*``)."""

    server_url: str
    backend: str
    engine_id: str
    namespace: str = "default"
    agent_key_file: Optional[str] = None
    server_key_file: Optional[str] = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    load_slots: Optional[int] = None
    store_slots: Optional[int] = None
    timeout_ms: Optional[int] = None
    transport: Optional[str] = None
    stats_file: Optional[str] = None

    def handler_config(self, engine_id: str, layout: str, lookups_only: bool = False) -> Dict[str, Any]:
        """The libmaru handler configuration (docs/configuration.md) for one handler.

        ``lookups_only`` (the scheduler's, which only asks which keys are stored) and
        any ``cxl`` handler (it reads chunks in place and writes them into pages of its
        own regions) have no staging slots, hence no staging buffer; a ``remote_cxl``
        worker's has ``maru_load_slots`` / ``maru_store_slots`` (libmaru's defaults)."""
        cfg: Dict[str, Any] = {
            "backend": self.backend,
            "server_url": self.server_url,
            "engine_id": engine_id,
            "namespace": self.namespace,
            "layout": layout,
        }
        slots = (0, 0) if lookups_only or self.backend == "cxl" else (self.load_slots, self.store_slots)
        for key, value in (
            ("agent_key_file", self.agent_key_file),
            ("server_key_file", self.server_key_file),
            ("load_slots", slots[0]),
            ("store_slots", slots[1]),
            ("timeout_ms", self.timeout_ms),
            ("transport", self.transport),
        ):
            if value is not None:
                cfg[key] = value
        return cfg

    def key_files(self) -> List[Tuple[str, str]]:
        """``(setting, path)`` of each key file a handler of these settings proves: the
        agents' key (``remote_cxl``; libmaru's default path when unset) and maru-server's
        (``maru_server_key_file``, else the ``MARU_SERVER_KEY_FILE`` environment
        variable, else ``~/.maru/server.key`` when it exists: the key this host's
        maru-server made, libmaru's own order; else none)."""
        out: List[Tuple[str, str]] = []
        if self.backend == "remote_cxl":
            path = self.agent_key_file or os.path.join(os.environ.get("HOME") or "/root", ".maru", "remote-cxl-agent.key")
            out.append(("maru_remote_cxl_agent_key_file", path))
        if self.server_key_file:
            out.append(("maru_server_key_file", self.server_key_file))
        elif os.environ.get("MARU_SERVER_KEY_FILE"):
            out.append(("maru_server_key_file (unset: MARU_SERVER_KEY_FILE)", os.environ["MARU_SERVER_KEY_FILE"]))
        elif os.environ.get("HOME") and os.path.exists(os.path.join(os.environ["HOME"], ".maru", "server.key")):
            out.append(
                (
                    "maru_server_key_file (unset: this host's ~/.maru/server.key)",
                    os.path.join(os.environ["HOME"], ".maru", "server.key"),
                )
            )
        return out

    def check_key_files(self, check: Callable[[str], None] = check_key_file) -> None:
        """Stops at start (ValueError naming the setting and the file) when a key file
        is missing, unreadable, open to others or not a key (libmaru's own loader)."""
        for name, path in self.key_files():
            try:
                check(path)
            except ConfigError as e:
                raise _setting_error(f"{name} {path!r}: {e.message}") from None

    def start_error(self, what: str, e: MaruError) -> ValueError:
        """The error that stops the engine when a handler cannot open for a reason no
        retry fixes (``FATAL_AT_START``): it names the settings involved."""
        keys = "; ".join(f"{n} is {p!r}" for n, p in self.key_files()) or "maru_server_key_file is unset"
        if e.code == Status.AUTH:
            return ValueError(
                f"maru.vllm {what}: a daemon refused this engine's key at start: {e.message} ({keys}): "
                "give that setting the key file of the daemon the message names"
            )
        return ValueError(
            f"maru.vllm {what}: libmaru refused the settings at start: {e.message} "
            f"(a handler field <field> is the kv_connector_extra_config key maru_<field>; the key files: {keys})"
        )


# extra-config key -> (Settings field, kind)
_SETTING_KEYS: Dict[str, Tuple[str, str]] = {
    "maru_server_url": ("server_url", "str"),
    "maru_storage_backend": ("backend", "str"),
    "maru_engine_id": ("engine_id", "str"),
    "maru_cache_namespace": ("namespace", "str"),
    "maru_remote_cxl_agent_key_file": ("agent_key_file", "str"),
    "maru_server_key_file": ("server_key_file", "str"),
    "maru_chunk_tokens": ("chunk_tokens", "int"),
    "maru_load_slots": ("load_slots", "int"),
    "maru_store_slots": ("store_slots", "int"),
    "maru_timeout_ms": ("timeout_ms", "int"),
    "maru_transport": ("transport", "str"),
    "maru_stats_file": ("stats_file", "str"),
}


def _setting_error(msg: str) -> ValueError:
    return ValueError(f"maru.vllm: bad kv_connector_extra_config: {msg}")


def parse_settings(extra: Optional[Mapping[str, Any]], block_size: int) -> Settings:
    """Reads the connector's settings from vLLM's ``kv_connector_extra_config``.

    Raises ValueError naming the key for a missing required setting, an unknown
    ``maru_*`` key (a typo must not fall back to a default silently), a value of the
    wrong type, a backend other than ``cxl``/``remote_cxl``, or ``maru_chunk_tokens``
    that is not a positive multiple of ``block_size``. Keys without the ``maru_``
    prefix are left to other connectors.
    """
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k.startswith("maru_") and k not in _SETTING_KEYS)
    if unknown:
        raise _setting_error(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_SETTING_KEYS))}")
    values: Dict[str, Any] = {}
    for key, (name, kind) in _SETTING_KEYS.items():
        if key not in extra or extra[key] is None:
            continue
        v = extra[key]
        if kind == "int":
            if isinstance(v, bool) or not isinstance(v, (int, str)):
                raise _setting_error(f"{key} must be an integer, not {v!r}")
            try:
                v = int(v)
            except ValueError:
                raise _setting_error(f"{key} must be an integer, not {v!r}") from None
            if v <= 0:
                raise _setting_error(f"{key} must be positive, not {v}")
        else:
            if not isinstance(v, str) or not v.strip():
                raise _setting_error(f"{key} must be a non-empty string, not {v!r}")
            v = v.strip()
        values[name] = v
    if "server_url" not in values:
        raise _setting_error("maru_server_url is required (maru-server host:port, comma-separated for several pools)")
    if "backend" not in values:
        raise _setting_error(f"maru_storage_backend is required (one of {', '.join(BACKENDS)})")
    if values["backend"] not in BACKENDS:
        raise _setting_error(f"maru_storage_backend {values['backend']!r} is not one of {', '.join(BACKENDS)}")
    if values.get("transport", "soft") not in TRANSPORTS:
        raise _setting_error(f"maru_transport {values['transport']!r} is not one of {', '.join(TRANSPORTS)}")
    for key, name in (("maru_transport", "transport"), ("maru_load_slots", "load_slots"), ("maru_store_slots", "store_slots")):
        if name in values and values["backend"] != "remote_cxl":
            raise _setting_error(
                f"{key} applies to maru_storage_backend remote_cxl only (on cxl chunks move in place, without staging)"
            )
    if "engine_id" not in values:
        values["engine_id"] = f"vllm-{socket.gethostname()}-{os.getpid()}"
    if not isinstance(block_size, int) or block_size <= 0:
        raise _setting_error(f"vLLM block size {block_size!r} is not a positive integer")
    chunk = values.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)
    if chunk % block_size:
        raise _setting_error(
            f"maru_chunk_tokens {chunk} is not a multiple of vLLM's block size {block_size} "
            f"(use {max(block_size, chunk // block_size * block_size)})"
        )
    values["chunk_tokens"] = chunk
    return Settings(**values)


# Namespace digest --------------------------------------------------------------------


def model_kv_config(hf_config: Mapping[str, Any]) -> Dict[str, Any]:
    """The fields of a model's config that shape its KV: everything except where the
    model was loaded from, library versions and generation-only settings
    (``_NON_KV_CONFIG_FIELDS``), recursively for nested configs."""
    out: Dict[str, Any] = {}
    for k, v in hf_config.items():
        if k in _NON_KV_CONFIG_FIELDS:
            continue
        out[k] = model_kv_config(v) if isinstance(v, Mapping) else v
    return out


def namespace_digest(
    hf_config: Mapping[str, Any],
    dtype: str,
    kv_cache_dtype: str,
    block_size: int,
    chunk_tokens: int,
    tp_size: int,
) -> str:
    """32 hex digits over what makes KV chunks interchangeable: the model's
    architecture config (:func:`model_kv_config`), the model and KV-cache dtypes, vLLM's
    block size, the chunk size in tokens and the tensor-parallel size. Not the model
    path, not node-local fields. The tensor-parallel rank goes into the keyspace
    (:func:`keyspace`) instead, so that the scheduler finds every rank's chunks under
    one handler (the digest is also the handler's ``layout``)."""
    doc = {
        "v": 1,
        "model": model_kv_config(hf_config),
        "dtype": str(dtype),
        "kv_cache_dtype": str(kv_cache_dtype),
        "block_size": int(block_size),
        "chunk_tokens": int(chunk_tokens),
        "tp_size": int(tp_size),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def keyspace(namespace: str, digest: str, tp_rank: int) -> str:
    """The namespace string the chunk keys of one tensor-parallel rank are derived under."""
    return f"{namespace}/{digest}/tp{tp_rank}"


# Metadata passed from the scheduler to the workers -----------------------------------


@dataclass
class ChunkTransfer:
    """Chunks of one request to load or store in one step.

    ``keys[r][i]``: the key of chunk ``i`` for tensor-parallel rank ``r``; ``blocks[i]``:
    the vLLM blocks of chunk ``i`` as ``(position in the chunk, block id)`` (a load may
    skip leading positions that vLLM computed itself); ``first_chunk``: the index of
    chunk 0 here in the request's prompt; ``route_key``: the request's first chunk key
    (all its chunks go to one pool)."""

    req_id: str
    route_key: str
    first_chunk: int
    keys: List[List[str]]
    blocks: List[List[Tuple[int, int]]]

    def block_ids_from(self, i: int) -> Set[int]:
        """The block ids of chunk ``i`` and every later chunk."""
        return {b for chunk in self.blocks[i:] for _, b in chunk}


@dataclass
class StepPlan:
    loads: List[ChunkTransfer] = field(default_factory=list)
    stores: List[ChunkTransfer] = field(default_factory=list)


# Scheduler ---------------------------------------------------------------------------


class RateLimited:
    """A warning logged at most once per ``interval`` seconds, with how many times it
    happened since the last one (``clock`` injected for tests)."""

    def __init__(self, interval: float = SKIP_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 level: int = logging.WARNING):
        self.interval = interval
        self.clock = clock
        self.level = level
        self._next = float("-inf")
        self.count = 0  # occurrences not logged yet
        self.total = 0

    def __call__(self, n: int, msg: str, *args: Any) -> bool:
        """Counts ``n`` occurrences; logs ``msg % args`` (with the count) when due.
        Returns whether it logged."""
        self.count += n
        self.total += n
        now = self.clock()
        if now < self._next:
            return False
        self._next = now + self.interval
        log.log(self.level, msg + " (%d since the last such message; logged at most every %.0f s)",
                *args, self.count, self.interval)
        self.count = 0
        return True


class HandlerSlot:
    """Opens a handler lazily and again after maru-server was unreachable (with a
    backoff): an unreachable server means misses, not a crash.

    What no retry fixes (``FATAL_AT_START``: a configuration libmaru refuses, a key a
    daemon refuses) raises ``ValueError`` naming the settings (``start_error``) on the
    first open, which runs at the engine's start; after the start it is logged as an
    ERROR (rate-limited) and retried with the backoff, as the engine keeps serving."""

    def __init__(self, open_handler: Callable[[], Any], what: str, clock: Callable[[], float] = time.monotonic,
                 start_error: Optional[Callable[[str, MaruError], Exception]] = None,
                 place: Optional[Placement] = None):
        self._open = open_handler
        self._place = place or Placement()
        self._what = what
        self._clock = clock
        self._start_error = start_error
        self.handler: Any = None
        self._retry_at = 0.0
        self._started = False
        self._warn = RateLimited(clock=clock)
        self._error = RateLimited(clock=clock, level=logging.ERROR)

    @property
    def down(self) -> bool:
        """No handler now (maru-server unreachable, or a refused setting after start)."""
        return self.handler is None

    def get(self) -> Any:
        if self.handler is not None:
            return self.handler
        now = self._clock()
        if now < self._retry_at:
            return None
        first, self._started = not self._started, True
        try:
            self.handler = self._place.wrap(self._open())
            self._place.settle_started()  # the threads the open started
        except MaruError as e:
            self._retry_at = now + REOPEN_BACKOFF_S
            if e.code in FATAL_AT_START:
                if first:
                    if self._start_error is not None:
                        raise self._start_error(self._what, e) from e
                    raise
                self._error(1, "maru.vllm %s: cannot open a handler: %s; caching is off until it opens "
                            "(retried every %.0f s)", self._what, e, REOPEN_BACKOFF_S)
                return None
            self._warn(1, "maru.vllm %s: maru-server unreachable, lookups miss and nothing is stored "
                       "(retried every %.0f s): %s", self._what, REOPEN_BACKOFF_S, e)
            return None
        return self.handler

    def failed(self, e: Exception) -> None:
        """A call failed as if the server went away: close and reopen later."""
        self._warn(1, "maru.vllm %s: %s; reopening in %.0f s", self._what, e, REOPEN_BACKOFF_S)
        h, self.handler = self.handler, None
        self._retry_at = self._clock() + REOPEN_BACKOFF_S
        if h is not None:
            try:
                h.close()
            except Exception:  # noqa: BLE001 - closing a broken handler must not raise
                pass

    def close(self) -> None:
        h, self.handler = self.handler, None
        if h is not None:
            h.close()


def handler_slot(settings: Settings, what: str, config: Dict[str, Any], place: Optional[Placement] = None) -> HandlerSlot:
    """The handler of one side (``what``: "scheduler", "worker 0", ...) of an engine with
    these settings; its first ``get()``, at the engine's start, stops the engine naming
    the setting when a daemon refuses a key or libmaru the configuration. ``place``:
    the cores its calls (and the threads libmaru starts in them) run on."""
    from ..handler import Handler

    return HandlerSlot(lambda: Handler(config), what, start_error=settings.start_error, place=place)


@dataclass
class _Lookup:
    prompt_len: int
    hits: int  # leading full chunks stored in Maru for every rank
    keys: List[List[str]]  # [rank][chunk] over the looked-up chunks


@dataclass
class _Request:
    prompt: List[int]
    keys: List[List[str]]  # [rank][chunk], full chunks of the whole prompt
    blocks: List[int]
    next_store: int  # first chunk not yet stored or known to be stored


class SchedulerCore:
    """The scheduler side: one ``batch_exists`` per new request for its leading stored
    chunks, the load of those chunks into the blocks vLLM allocates, and the stores of
    the chunks each step completes (never those found stored).

    A chunk is planned for store once per step whatever the number of requests that
    share it (the first request of the step that completes it stores it), and not again
    for ``RESTORE_AFTER_S`` (its store is in flight or done).

    ``keyspaces[r]`` is the key namespace of tensor-parallel rank ``r``; ``handler``
    a :class:`HandlerSlot` (anything with ``get()`` returning a handler or None, and
    ``failed(e)``)."""

    def __init__(self, chunk_tokens: int, block_size: int, keyspaces: Sequence[str], handler: Any,
                 clock: Callable[[], float] = time.monotonic):
        if chunk_tokens <= 0 or chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens {chunk_tokens} is not a positive multiple of the block size {block_size}")
        if not keyspaces:
            raise ValueError("at least one keyspace (tensor-parallel rank) is needed")
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.keyspaces = list(keyspaces)
        self.handler = handler
        self._lookups: Dict[str, _Lookup] = {}
        self._load_after_alloc: Dict[str, Tuple[int, int]] = {}  # req -> (local computed, chunks)
        self._reqs: Dict[str, _Request] = {}
        self.clock = clock
        # Rank-0 key of each chunk planned for store -> when (oldest first).
        self._recent: "collections.OrderedDict[str, float]" = collections.OrderedDict()
        self.lookups = 0
        self.hit_chunks = 0
        self.stores_shared = 0  # chunks not planned again: another request stores them

    def _keys(self, tokens: Sequence[int]) -> List[List[str]]:
        return [chunk_keys(tokens, self.chunk_tokens, ks) for ks in self.keyspaces]

    # vLLM: get_num_new_matched_tokens
    def matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed: int) -> int:
        """Tokens beyond ``num_computed`` that can be loaded: the leading full chunks of
        the prompt (less its last token, which vLLM must compute) stored for every rank.
        A miss, or an unreachable maru-server, gives 0."""
        n_full = (len(prompt) - 1) // self.chunk_tokens if prompt else 0
        self._lookups.pop(req_id, None)
        if n_full <= 0:
            return 0
        keys = self._keys(prompt[: n_full * self.chunk_tokens])
        h = self.handler.get()
        if h is None:
            return 0
        flat = [k for rank_keys in keys for k in rank_keys]
        try:
            found = h.batch_exists(flat, route_key=keys[0][0])
        except MaruError as e:
            self.handler.failed(e)
            return 0
        hits = leading_hits(found, n_full, len(keys))
        self.lookups += 1
        self._lookups[req_id] = _Lookup(len(prompt), hits, keys)
        matched = hits * self.chunk_tokens
        if matched <= num_computed:
            return 0
        log.debug("maru.vllm: request %s: %d of %d chunks stored", req_id, hits, n_full)
        return matched - num_computed

    # vLLM: update_state_after_alloc
    def after_alloc(self, req_id: str, num_external: int) -> None:
        if num_external <= 0:
            return
        lk = self._lookups.get(req_id)
        if lk is None:
            raise RuntimeError(f"maru.vllm: vLLM allocated {num_external} external tokens for {req_id} without a lookup")
        matched = lk.hits * self.chunk_tokens
        self._load_after_alloc[req_id] = (matched - num_external, lk.hits)
        self.hit_chunks += lk.hits

    # vLLM: build_connector_meta
    def plan(
        self,
        new_reqs: Iterable[Tuple[str, Optional[Sequence[int]], Sequence[int], int, int]],
        cached_reqs: Iterable[Tuple[str, Optional[Sequence[int]], bool, int, int]],
        finished: Iterable[str] = (),
    ) -> StepPlan:
        """The loads and stores of one step.

        ``new_reqs``: ``(req_id, prompt token ids or None to skip the request, block ids,
        num_computed_tokens, num_scheduled_tokens)``; ``cached_reqs``: ``(req_id, new
        block ids or None, resumed, num_computed_tokens, num_scheduled_tokens)``;
        ``finished``: ids whose state goes."""
        plan = StepPlan()
        for req_id in finished:
            self.forget(req_id)
        for req_id, prompt, blocks, num_computed, num_sched in new_reqs:
            if prompt is None:
                self._load_after_alloc.pop(req_id, None)
                self._lookups.pop(req_id, None)
                continue
            self._start(req_id, list(prompt), list(blocks), plan)
            self._stores_due(req_id, num_computed + num_sched, plan)
        for req_id, new_blocks, resumed, num_computed, num_sched in cached_reqs:
            r = self._reqs.get(req_id)
            if r is None:
                continue
            if new_blocks is not None:
                if resumed:
                    r.blocks = list(new_blocks)
                else:
                    r.blocks.extend(new_blocks)
            if resumed and req_id in self._load_after_alloc:
                self._start(req_id, r.prompt, r.blocks, plan)
            self._stores_due(req_id, num_computed + num_sched, plan)
        for req_id in list(self._load_after_alloc):
            # Allocated but not scheduled this step: vLLM asks again (lookup, alloc).
            log.debug("maru.vllm: load of %s planned but not scheduled", req_id)
        self._load_after_alloc.clear()
        plan.stores = self._once(plan.stores)
        return plan

    def _once(self, stores: List[ChunkTransfer]) -> List[ChunkTransfer]:
        """Each chunk of ``stores`` once (the first transfer that has it keeps it), less
        the chunks planned in the last ``RESTORE_AFTER_S``; a transfer whose chunks are
        not all kept is cut into its runs of kept chunks."""
        now = self.clock()
        while self._recent and (len(self._recent) > RECENT_STORES_MAX
                                or next(iter(self._recent.values())) <= now - RESTORE_AFTER_S):
            self._recent.popitem(last=False)
        out: List[ChunkTransfer] = []
        for t in stores:
            run: List[int] = []
            for i, key in enumerate(t.keys[0]):
                if key in self._recent:
                    self.stores_shared += 1
                    out.extend(self._part(t, run))
                    run = []
                    continue
                self._recent[key] = now
                run.append(i)
            out.extend(self._part(t, run))
        return out

    @staticmethod
    def _part(t: ChunkTransfer, run: List[int]) -> List[ChunkTransfer]:
        if not run:
            return []
        if len(run) == len(t.blocks):
            return [t]
        a, b = run[0], run[-1] + 1
        return [ChunkTransfer(t.req_id, t.route_key, t.first_chunk + a, [k[a:b] for k in t.keys], t.blocks[a:b])]

    def _start(self, req_id: str, prompt: List[int], blocks: List[int], plan: StepPlan) -> None:
        lk = self._lookups.pop(req_id, None)
        n_store = len(prompt) // self.chunk_tokens
        if lk is not None and lk.prompt_len == len(prompt) and len(lk.keys[0]) == n_store:
            keys = lk.keys
        else:
            keys = self._keys(prompt[: n_store * self.chunk_tokens])
        hits = lk.hits if lk is not None else 0
        self._reqs[req_id] = _Request(prompt, keys, blocks, next_store=hits)
        load = self._load_after_alloc.pop(req_id, None)
        if load is None:
            return
        local, n_chunks = load
        bpc = self.blocks_per_chunk
        first = local // self.chunk_tokens
        skip_blocks = local // self.block_size  # vLLM's own blocks: never written
        chunk_blocks: List[List[Tuple[int, int]]] = []
        for c in range(first, n_chunks):
            row = [(j, blocks[c * bpc + j]) for j in range(bpc) if c * bpc + j >= skip_blocks and c * bpc + j < len(blocks)]
            chunk_blocks.append(row)
        plan.loads.append(
            ChunkTransfer(req_id, keys[0][0], first, [k[first:n_chunks] for k in keys], chunk_blocks)
        )

    def _stores_due(self, req_id: str, tokens_done: int, plan: StepPlan) -> None:
        r = self._reqs.get(req_id)
        if r is None:
            return
        bpc = self.blocks_per_chunk
        end = min(len(r.keys[0]), tokens_done // self.chunk_tokens, len(r.blocks) // bpc)
        if end <= r.next_store:
            return
        first = r.next_store
        blocks = [[(j, r.blocks[c * bpc + j]) for j in range(bpc)] for c in range(first, end)]
        plan.stores.append(ChunkTransfer(req_id, r.keys[0][0], first, [k[first:end] for k in r.keys], blocks))
        r.next_store = end

    def forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._load_after_alloc.pop(req_id, None)

    def close(self) -> None:
        self.handler.close()


def leading_hits(found: Sequence[bool], n_chunks: int, n_ranks: int) -> int:
    """Leading chunks present for every rank, from ``batch_exists`` over the keys of
    rank 0, then rank 1, ... (``n_chunks`` each)."""
    if len(found) != n_chunks * n_ranks:
        raise ValueError(f"batch_exists returned {len(found)} answers for {n_chunks * n_ranks} keys")
    for i in range(n_chunks):
        if not all(found[r * n_chunks + i] for r in range(n_ranks)):
            return i
    return n_chunks


# Worker ------------------------------------------------------------------------------
