"""The vLLM connector's logic without vLLM or torch: settings, the namespace digest,
chunk keys, the scheduler's bookkeeping and the worker's loads and stores. The vLLM
class (:mod:`maru.vllm.connector`) only converts vLLM's objects into the plain values
these take, so everything here is tested without vLLM installed.

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
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from ..copies import copy_ranges
from ..errors import ConfigError, MaruError, NoSpaceError, Status, UnavailableError
from ..key_files import check_key_file
from ..keys import chunk_keys
from ..slots import SlotPool

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


class KVBlocks:
    """What the worker core needs from the engine's KV cache: ``chunk_bytes`` (one
    chunk, all layers) and the copies between a chunk's blocks and ``size`` bytes of
    memory at an address (a staging slot, a page of an own region, a chunk read in
    place). ``blocks`` are ``(position in the chunk, block id)``."""

    chunk_bytes: int

    def copy_out(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        raise NotImplementedError

    def copy_in(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        raise NotImplementedError

    def copy_in_many(self, chunks: Sequence[Tuple[Sequence[Tuple[int, int]], int]], size: int) -> None:
        """:meth:`copy_in` of each ``(blocks, addr)``; at once where the cache can."""
        for blocks, addr in chunks:
            self.copy_in(blocks, addr, size)

    def host_moves(self, blocks: Sequence[Tuple[int, int]]) -> Optional[List[Tuple[int, int, int]]]:
        """For a cache in host memory: ``(offset in the chunk, address in the cache,
        bytes)`` of each piece that loads a chunk into ``blocks`` (libmaru then copies
        them itself, ``Handler.load_pieces``); None for a cache it cannot address (on a
        GPU: the loads go through :meth:`copy_in_many`)."""
        return None


@dataclass(frozen=True)
class LayerMemory:
    """One KV tensor of the engine's cache, as host memory: ``num_blocks`` blocks from
    ``addr``. ``pieces`` is 1 when the block index is the tensor's first dimension
    (vLLM's CPU layout ``[num_blocks, kv_heads, block_size, 2 * head_size]``: a block is
    ``piece`` contiguous bytes), or the size of the first dimension when the block
    index is the second (``[2, num_blocks, ...]``: a block is ``piece`` bytes in each
    of the K and V halves)."""

    addr: int
    num_blocks: int
    pieces: int
    piece: int

    @property
    def block_bytes(self) -> int:
        return self.pieces * self.piece


class PagedKV(KVBlocks):
    """A KV cache in host memory (``layers``, in layer order), copied by libmaru
    (:func:`maru.copy_ranges`: streaming stores for a large batch, one fence) in one call
    per chunk stored and per batch of chunks loaded: one piece per layer and piece of a block for each run of blocks that are
    consecutive both in the chunk and in the cache (usually the whole chunk), never a
    copy per token.

    A chunk is, for each layer, for each piece, its ``blocks_per_chunk`` blocks' bytes
    one after the other."""

    def __init__(self, layers: Sequence[LayerMemory], blocks_per_chunk: int):
        if not layers:
            raise ValueError("maru.vllm: no KV cache layer")
        if blocks_per_chunk <= 0:
            raise ValueError(f"blocks_per_chunk {blocks_per_chunk} is not positive")
        self.layers = list(layers)
        self.bpc = blocks_per_chunk
        self.chunk_bytes = sum(m.block_bytes for m in self.layers) * blocks_per_chunk
        self.copies = 0  # memmove calls made (for the tests: few large copies)
        self._blocks = min(m.num_blocks for m in self.layers)
        # Per layer and piece: (its offset in a chunk, the address of its block 0, its
        # bytes per block); a move of run (pos, b, n) is (off + pos * p, at + b * p, n * p).
        self._pieces: List[Tuple[int, int, int]] = []
        off = 0
        for m in self.layers:
            for i in range(m.pieces):
                self._pieces.append((off + i * self.bpc * m.piece, m.addr + i * m.num_blocks * m.piece, m.piece))
            off += m.block_bytes * self.bpc

    def _runs(self, blocks: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
        """``(first position, first block, count)`` of each run of blocks consecutive in
        the chunk and in the cache; refuses positions or block ids out of range (a
        wrong id must never write outside the cache)."""
        runs: List[Tuple[int, int, int]] = []
        nb = self._blocks
        for pos, b in blocks:
            if not (0 <= pos < self.bpc and 0 <= b < nb):
                raise ValueError(f"block {b} at position {pos} is outside the cache ({nb} blocks, {self.bpc} a chunk)")
            if runs and runs[-1][0] + runs[-1][2] == pos and runs[-1][1] + runs[-1][2] == b:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((pos, b, 1))
        return runs

    def moves(self, blocks: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, int]]:
        """``(offset in the chunk, address in the cache, bytes)`` of each copy."""
        runs = self._runs(blocks)
        if len(runs) == 1:  # the usual case: the chunk's blocks are consecutive
            pos, b, n = runs[0]
            return [(off + pos * p, at + b * p, n * p) for off, at, p in self._pieces]
        return [(off + pos * p, at + b * p, n * p) for off, at, p in self._pieces for pos, b, n in runs]

    def host_moves(self, blocks: Sequence[Tuple[int, int]]) -> Optional[List[Tuple[int, int, int]]]:
        return self.moves(blocks)

    def _check(self, size: int) -> None:
        if size != self.chunk_bytes:
            raise ValueError(f"a chunk here is {self.chunk_bytes} bytes, not {size}")

    def copy_out(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        """Into Maru's memory at ``addr`` (a page or a store slot, read by others)."""
        self._check(size)
        if [p for p, _ in blocks] != list(range(self.bpc)):
            raise ValueError("a stored chunk needs all its blocks")
        pieces = [(addr + off, at, n) for off, at, n in self.moves(blocks)]
        copy_ranges(pieces, into_shared=True)
        self.copies += len(pieces)

    def copy_in(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        self.copy_in_many([(blocks, addr)], size)

    def copy_in_many(self, chunks: Sequence[Tuple[Sequence[Tuple[int, int]], int]], size: int) -> None:
        """All the pieces of ``chunks`` in one call."""
        self._check(size)
        pieces = [(at, addr + off, n) for blocks, addr in chunks for off, at, n in self.moves(blocks)]
        copy_ranges(pieces)
        self.copies += len(pieces)


@dataclass
class WorkerStats:
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    chunks_load_failed: int = 0
    load_s: float = 0.0  # time spent loading (lookups of leases, transfers, copies)
    load_best_gbs: float = 0.0  # the fastest step's loads (bytes over their time)
    load_copy_s: float = 0.0  # of load_s, the copies into the blocks (with load_pieces: its calls, leases included)
    chunks_stored: int = 0
    bytes_stored: int = 0
    chunks_store_submitted: int = 0
    chunks_store_skipped: int = 0
    chunks_store_failed: int = 0
    store_s: float = 0.0  # time the step waited for stores (copies out of the cache, submits)

    def as_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["load_gbs"] = self.bytes_loaded / self.load_s / 1e9 if self.load_s > 0 else None
        return d


class WorkerCore:
    """The worker side of one tensor-parallel rank.

    Loads (synchronous, before the forward pass): into a cache in host memory (vLLM on
    CPU), on either backend, one libmaru call per batch of chunks (``load_pieces``)
    takes their leases and copies each chunk's pieces straight into the engine's blocks
    (on ``cxl`` from the CXL mapping, on ``remote_cxl`` from the staging buffer as each
    window of the transfer lands); libmaru gives the leases back after the call. Into a
    cache libmaru cannot address (a GPU's): on ``cxl`` each chunk is read in place
    (``acquire_spans``) and copied into the blocks; on ``remote_cxl`` the load slots are
    cut in two halves, so that one half's chunks are copied into the blocks while the
    other's transfer runs. Any
    chunk that is not loaded whole (a miss, a short chunk, an error) marks its blocks
    and those of every later chunk of the request as failed (:meth:`take_load_errors`):
    vLLM recomputes them, never uses wrong KV.

    Stores copy each completed chunk out of the blocks at once (so vLLM may reuse the
    blocks): on ``cxl`` straight into a page of an own region, published at once
    (``take_pages`` / ``publish_pages``); on ``remote_cxl`` into a store slot, submitted
    asynchronously. libmaru publishes a key only after its bytes are written. A
    request's chunks after one that found no room are skipped (without it they could
    never be found). Chunks not stored because maru-server or a pool is away, or for
    want of room, are counted and logged (rate-limited)."""

    def __init__(self, rank: int, handler: Any, kv: Optional[KVBlocks] = None,
                 clock: Callable[[], float] = time.monotonic, stats_file: Optional[str] = None,
                 in_place: bool = False, timeout_ms: Optional[int] = None):
        self.rank = rank
        self.handler = handler  # HandlerSlot
        self.kv = kv
        self.clock = clock
        self.in_place = in_place
        self.wait_s = 2 * (timeout_ms or DEFAULT_TIMEOUT_MS) / 1000 + 1
        self.stats = WorkerStats()
        self.stats_file = stats_file
        self.info: Dict[str, Any] = {}  # written with the stats (digest, chunk size, ...)
        self._errors: Set[int] = set()
        self._pending: List[Tuple[Any, List[Any]]] = []  # (Op, slots)
        self._skip = {why: RateLimited(clock=clock) for why in ("room", "away", "refused")}
        self._disabled: Optional[str] = None
        self._checked: Any = None  # the handler whose page size was checked

    def attach(self, kv: KVBlocks) -> None:
        self.kv = kv

    def disable(self, why: str) -> None:
        log.error("maru.vllm worker: connector disabled: %s", why)
        self._disabled = why

    def chunk_misfit(self, h: Any) -> Optional[str]:
        """Why chunks do not fit in ``h``'s pages (maru-server's ``--chunk-size``), or None."""
        page = h.chunk_size()
        if self.kv is not None and self.kv.chunk_bytes > page:
            return (f"a chunk is {self.kv.chunk_bytes} bytes, more than maru-server's chunk size {page} "
                    f"(--chunk-size): lower maru_chunk_tokens or raise --chunk-size")
        return None

    def _handler(self) -> Any:
        if self._disabled or self.kv is None or self.handler is None:
            return None
        h = self.handler.get()
        if h is not None and h is not self._checked:
            # Also for a handler opened late (maru-server was away at start).
            why = self.chunk_misfit(h)
            if why:
                self.disable(why)
                return None
            self._checked = h
        return h

    # Loads ----------------------------------------------------------------------

    def load(self, transfers: Sequence[ChunkTransfer]) -> None:
        step_start, step_bytes = self.clock(), self.stats.bytes_loaded
        for t in transfers:
            start = self.clock()
            failed_from = self._load_one(t)
            self.stats.load_s += self.clock() - start
            if failed_from is not None:
                lost = len(t.blocks) - failed_from
                self.stats.chunks_load_failed += lost
                self._errors |= t.block_ids_from(failed_from)
                log.warning("maru.vllm worker: request %s: %d of %d chunks not loaded (from chunk %d): recomputed",
                            t.req_id, lost, len(t.blocks), t.first_chunk + failed_from)
        if transfers:
            took = self.clock() - step_start
            if took > 0:
                rate = (self.stats.bytes_loaded - step_bytes) / took / 1e9
                self.stats.load_best_gbs = max(self.stats.load_best_gbs, rate)
            self.write_stats()

    def _load_one(self, t: ChunkTransfer) -> Optional[int]:
        """Loads ``t``'s chunks; returns the index of the first chunk not loaded, or None."""
        h = self._handler()
        if h is None:
            return 0
        try:
            if self.kv.host_moves(t.blocks[0]) is not None:
                return self._load_pieces(h, t)
            return self._load_in_place(h, t) if self.in_place else self._load_through_slots(h, t)
        except MaruError as e:
            log.warning("maru.vllm worker: load of request %s failed: %s", t.req_id, e)
            if isinstance(e, UnavailableError):
                self.handler.failed(e)
            return 0

    def _loaded(self, t: ChunkTransfer, first: int, found: Sequence[Tuple[Optional[int], int]]) -> Optional[int]:
        """Copies the leading whole chunks of ``found`` (``(length or None, address)`` of
        chunks ``first``, ``first + 1``, ...) into their blocks, in one call; returns the
        index of the first chunk not whole, or None."""
        size = self.kv.chunk_bytes
        whole = 0
        for n, _ in found:
            if n != size:
                if n is not None:
                    log.warning("maru.vllm worker: chunk %s has %d bytes, expected %d",
                                t.keys[self.rank][first + whole], n, size)
                break
            whole += 1
        if whole:
            start = self.clock()
            self.kv.copy_in_many([(t.blocks[first + j], addr) for j, (_, addr) in enumerate(found[:whole])], size)
            self.stats.load_copy_s += self.clock() - start
            self.stats.chunks_loaded += whole
            self.stats.bytes_loaded += whole * size
        return None if whole == len(found) else first + whole

    def _load_pieces(self, h: Any, t: ChunkTransfer) -> Optional[int]:
        """A cache in host memory, either backend: per batch of chunks one
        ``load_pieces`` call, the leases taken and the chunks' pieces copied straight
        into their blocks while held, inside libmaru, which gives the leases back after
        the call (the fixed cost of a load: one call, not three and the Python between
        them, and no wait for the release)."""
        keys = t.keys[self.rank]
        size = self.kv.chunk_bytes
        for i in range(0, len(keys), VIEW_BATCH):
            part = keys[i : i + VIEW_BATCH]
            pieces = [(j, off, at, n) for j in range(len(part)) for off, at, n in self.kv.host_moves(t.blocks[i + j]) or ()]
            start = self.clock()
            got = h.load_pieces(part, pieces, route_key=t.route_key)
            self.stats.load_copy_s += self.clock() - start
            whole = 0
            for copied, n in got:
                if not copied or n != size:
                    if n:
                        log.warning("maru.vllm worker: chunk %s has %d bytes, expected %d", part[whole], n, size)
                    break
                whole += 1
            self.stats.chunks_loaded += whole
            self.stats.bytes_loaded += whole * size
            if whole < len(part):
                return i + whole
        return None

    def _load_in_place(self, h: Any, t: ChunkTransfer) -> Optional[int]:
        """cxl: each chunk read in place under a lease (``acquire_spans``: the views'
        addresses, no View objects, as the bytes are copied at once), one copy into the
        blocks, then the leases given back in one call."""
        keys = t.keys[self.rank]
        for i in range(0, len(keys), VIEW_BATCH):
            spans = h.acquire_spans(keys[i : i + VIEW_BATCH], route_key=t.route_key)
            try:
                failed = self._loaded(t, i, [(None, 0) if s is None else (s[2], s[1]) for s in spans])
                if failed is not None:
                    return failed
            finally:
                try:
                    h.release_spans([s[0] for s in spans if s is not None])  # the leases in one call
                except Exception as e:  # noqa: BLE001 - released with the handler at the latest
                    log.warning("maru.vllm worker: cannot release views: %s", e)
        return None

    def _load_through_slots(self, h: Any, t: ChunkTransfer) -> Optional[int]:
        """remote_cxl, a cache libmaru cannot address: the load slots in two halves; a
        half's chunks are copied into the blocks while the other half's transfer runs,
        then it takes the next chunks."""
        keys = t.keys[self.rank]
        n = len(keys)
        try:
            slots = h.acquire_slots(SlotPool.LOAD, n, timeout=1.0)
        except MaruError as e:
            log.warning("maru.vllm worker: no load slot: %s", e)
            return 0
        half = (len(slots) + 1) // 2
        free: Deque[List[Any]] = collections.deque(g for g in (slots[:half], slots[half:]) if g)
        running: Deque[Tuple[int, Any, List[Any], int]] = collections.deque()  # (first chunk, op, slots, chunks)
        nxt, failed = 0, None
        try:
            while running or (nxt < n and failed is None):
                while free and nxt < n and failed is None:
                    group = free.popleft()
                    k = min(len(group), n - nxt)
                    op = h.submit_load_slots(keys[nxt : nxt + k], group[:k], route_key=t.route_key)
                    running.append((nxt, op, group, k))
                    nxt += k
                first, op, group, k = running.popleft()
                try:
                    lens = op.results(self.wait_s)
                finally:
                    _free_op(op)
                if failed is None:
                    failed = self._loaded(t, first, [(lens[j], group[j].address) for j in range(k)])
                free.append(group)
        finally:
            for _, op, _, _ in running:  # only after an error: let each end before its slots go
                try:
                    op.wait(self.wait_s)
                except MaruError:
                    pass
                _free_op(op)
            _release(slots)
        return failed

    def take_load_errors(self) -> Set[int]:
        out, self._errors = self._errors, set()
        return out

    # Stores ---------------------------------------------------------------------

    def store(self, transfers: Sequence[ChunkTransfer]) -> None:
        """The step's stores (``wait_for_save``); ``stats.store_s`` counts the time the
        step spends here when it has chunks to store."""
        self.poll()
        if not transfers:
            return
        start = self.clock()
        h = self._handler()
        if h is None:
            n = sum(len(t.blocks) for t in transfers)
            self.stats.chunks_store_skipped += n
            if not self._disabled:
                self._skip["away"](n, "maru.vllm worker: maru-server unreachable: %d chunks not stored", n)
        else:
            for t in transfers:
                if self.in_place:
                    self._store_in_place(h, t)
                else:
                    self._store_through_slots(h, t)
        self.stats.store_s += self.clock() - start
        self.write_stats()

    def _no_room(self, t: ChunkTransfer, n: int, what: str) -> None:
        self.stats.chunks_store_skipped += n
        self._skip["room"](n, "maru.vllm worker: no free %s: %d chunks of request %s not stored%s", what, n, t.req_id,
                           " (raise maru_store_slots)" if what == "store slot" else "")

    def _room(self, t: ChunkTransfer, take: Callable[[int], List[Any]], what: str) -> List[Any]:
        """Room for ``t``'s chunks (pages or store slots, ``take(n)`` gives up to ``n``);
        the chunks that find none are counted and logged."""
        n = len(t.blocks)
        try:
            room = take(n)
        except NoSpaceError:
            room = []
        except MaruError as e:
            self._store_failed(t, n, e)
            return []
        if len(room) < n:
            self._no_room(t, n - len(room), what)
        return room

    def _copy_out(self, t: ChunkTransfer, addrs: Sequence[int]) -> Optional[Exception]:
        """Copies ``t``'s first ``len(addrs)`` chunks out of the blocks to ``addrs``."""
        try:
            for addr, blocks in zip(addrs, t.blocks):
                self.kv.copy_out(blocks, addr, self.kv.chunk_bytes)
        except Exception as e:  # noqa: BLE001 - a failed store is a later miss, never a crash
            return e
        return None

    def _store_in_place(self, h: Any, t: ChunkTransfer) -> None:
        """cxl: each chunk copied straight into a page of an own region, then the
        request's pages published in one call."""
        keys = t.keys[self.rank]
        pages = self._room(t, lambda n: h.take_pages(n, route_key=t.route_key), "page in the pool")
        if not pages:
            return
        err = self._copy_out(t, [p.addr for p in pages])
        if err is None:
            self.stats.chunks_store_submitted += len(pages)
            try:
                ok = h.publish_pages(keys[: len(pages)], [(p.region_id, p.page) for p in pages],
                                     [self.kv.chunk_bytes] * len(pages))
            except MaruError as e:
                err = e
        if err is not None:
            self._give_back(h, pages)
            self._store_failed(t, len(pages), err)
            return
        self._stored(h, [bool(x) for x in ok])

    def _give_back(self, h: Any, pages: Sequence[Any]) -> None:
        try:
            h.give_back_pages([(p.region_id, p.page) for p in pages])
        except MaruError as e:
            log.warning("maru.vllm worker: pages not given back (the handler takes them back at close): %s", e)

    def _store_through_slots(self, h: Any, t: ChunkTransfer) -> None:
        """remote_cxl: each chunk copied into a store slot, submitted asynchronously."""
        keys = t.keys[self.rank]
        slots = self._room(t, lambda n: h.acquire_slots(SlotPool.STORE, n, timeout=0), "store slot")
        if not slots:
            return
        err = self._copy_out(t, [s.address for s in slots])
        if err is None:
            try:
                op = h.submit_store_slots(keys[: len(slots)], slots, lengths=self.kv.chunk_bytes, route_key=t.route_key)
            except MaruError as e:
                err = e
        if err is not None:
            _release(slots)
            self._store_failed(t, len(slots), err)
            return
        self.stats.chunks_store_submitted += len(slots)
        self._pending.append((op, slots))

    def _stored(self, h: Any, ok: List[bool]) -> None:
        """Counts a finished store; chunks libmaru skipped (a pool away, no room in it)
        are logged with the reason the handler's stats give."""
        n_ok = sum(1 for x in ok if x)
        self.stats.chunks_stored += n_ok
        self.stats.bytes_stored += n_ok * (self.kv.chunk_bytes if self.kv else 0)
        skipped = len(ok) - n_ok
        if not skipped:
            return
        self.stats.chunks_store_skipped += skipped
        away = pools_down(h)
        if away:
            self._skip["away"](skipped, "maru.vllm worker: %d chunks not stored: pool %s unavailable, its prefixes "
                               "miss until it is back", skipped, ", ".join(away))
        else:
            self._skip["refused"](skipped, "maru.vllm worker: %d chunks not stored (no room in the pool, or its "
                                  "region was lost meanwhile; libmaru's log says which)", skipped)

    def _store_failed(self, t: ChunkTransfer, n: int, e: Exception) -> None:
        self.stats.chunks_store_failed += n
        log.warning("maru.vllm worker: store of %d chunks of request %s failed: %s", n, t.req_id, e)
        if isinstance(e, UnavailableError):
            self.handler.failed(e)

    def poll(self, wait_s: float = 0.0) -> int:
        """Finishes the stores that are done (``wait_s``: how long to wait for the rest);
        returns how many are still in flight."""
        deadline = self.clock() + wait_s
        still: List[Tuple[Any, List[Any]]] = []
        for op, slots in self._pending:
            left = max(0.0, deadline - self.clock())
            try:
                done = op.wait(left) if left > 0 else op.poll()
            except MaruError as e:
                self.stats.chunks_store_failed += len(slots)
                log.warning("maru.vllm worker: asynchronous store failed: %s", e)
                done = True
                ok: Optional[List[bool]] = None
            else:
                ok = list(op.results(0)) if done else None
            if not done:
                still.append((op, slots))
                continue
            if ok is not None:
                self._stored(getattr(self.handler, "handler", None), ok)
            _free_op(op)
            _release(slots)
        changed = len(still) != len(self._pending)
        self._pending = still
        if changed:
            self.write_stats()
        return len(still)

    def write_stats(self) -> None:
        if not self.stats_file:
            return
        path = self.stats_file if self.rank == 0 else f"{self.stats_file}.rank{self.rank}"
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump({**self.info, **self.stats.as_dict()}, f)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("maru.vllm worker: cannot write %s: %s", path, e)

    def close(self) -> None:
        left = self.poll(SHUTDOWN_WAIT_S)
        if left:
            log.warning("maru.vllm worker: %d stores still in flight at shutdown", left)
        if self.handler is not None:
            self.handler.close()


def pools_down(h: Any) -> List[str]:
    """The pools of ``h`` that are unavailable now (from its stats), by URL."""
    try:
        return [p.get("url", "?") for p in h.stats().get("pools", []) if not p.get("up", True)]
    except Exception:  # noqa: BLE001 - only for a log line
        return []


def _free_op(op: Any) -> None:
    """Frees a finished operation; a failure is logged, never raised."""
    try:
        op.close()
    except Exception as e:  # noqa: BLE001
        log.warning("maru.vllm: cannot free %r: %s", op, e)


def _release(slots: Sequence[Any]) -> None:
    for s in slots:
        try:
            s.release()
        except Exception as e:  # noqa: BLE001 - a slot that cannot be released is logged, not fatal
            log.warning("maru.vllm: cannot release staging slot %s: %s", getattr(s, "id", "?"), e)
