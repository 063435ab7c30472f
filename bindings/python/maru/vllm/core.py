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

import hashlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..errors import ConfigError, MaruError, NoSpaceError, UnavailableError
from ..keys import chunk_keys
from ..slots import SlotPool

log = logging.getLogger("maru.vllm")

DEFAULT_CHUNK_TOKENS = 256
BACKENDS = ("cxl", "remote_cxl")
# How long a connector waits before it tries to open its handler again after maru-server
# was unreachable (meanwhile every lookup is a miss and nothing is stored).
REOPEN_BACKOFF_S = 5.0
# A store that finds no free store slot skips the chunk; the warning is logged at most
# this often.
SKIP_LOG_INTERVAL_S = 60.0
# Bound on waiting for the stores still in flight when the worker shuts down.
SHUTDOWN_WAIT_S = 10.0

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


# Settings --------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The connector's settings, from ``kv_connector_extra_config`` (keys ``maru_*``)."""

    server_url: str
    backend: str
    engine_id: str
    namespace: str = "default"
    agent_key_file: Optional[str] = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    load_slots: Optional[int] = None
    store_slots: Optional[int] = None
    timeout_ms: Optional[int] = None
    transport: Optional[str] = None
    stats_file: Optional[str] = None

    def handler_config(self, engine_id: str, layout: str) -> Dict[str, Any]:
        """The libmaru handler configuration (docs/configuration.md) for one handler."""
        cfg: Dict[str, Any] = {
            "backend": self.backend,
            "server_url": self.server_url,
            "engine_id": engine_id,
            "namespace": self.namespace,
            "layout": layout,
        }
        for key, value in (
            ("agent_key_file", self.agent_key_file),
            ("load_slots", self.load_slots),
            ("store_slots", self.store_slots),
            ("timeout_ms", self.timeout_ms),
            ("transport", self.transport),
        ):
            if value is not None:
                cfg[key] = value
        return cfg


# extra-config key -> (Settings field, kind)
_SETTING_KEYS: Dict[str, Tuple[str, str]] = {
    "maru_server_url": ("server_url", "str"),
    "maru_storage_backend": ("backend", "str"),
    "maru_engine_id": ("engine_id", "str"),
    "maru_cache_namespace": ("namespace", "str"),
    "maru_remote_cxl_agent_key_file": ("agent_key_file", "str"),
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


class HandlerSlot:
    """Opens a handler lazily and again after maru-server was unreachable (with a
    backoff): an unreachable server means misses, not a crash. A configuration error
    (``ConfigError``) is raised: it does not go away by retrying."""

    def __init__(self, open_handler: Callable[[], Any], what: str, clock: Callable[[], float] = time.monotonic):
        self._open = open_handler
        self._what = what
        self._clock = clock
        self.handler: Any = None
        self._retry_at = 0.0

    def get(self) -> Any:
        if self.handler is not None:
            return self.handler
        now = self._clock()
        if now < self._retry_at:
            return None
        try:
            self.handler = self._open()
        except ConfigError:
            raise
        except MaruError as e:
            self._retry_at = now + REOPEN_BACKOFF_S
            log.warning("maru.vllm %s: maru-server unreachable, treating lookups as misses for %.0f s: %s",
                        self._what, REOPEN_BACKOFF_S, e)
            return None
        return self.handler

    def failed(self, e: Exception) -> None:
        """A call failed as if the server went away: close and reopen later."""
        log.warning("maru.vllm %s: %s; reopening in %.0f s", self._what, e, REOPEN_BACKOFF_S)
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

    ``keyspaces[r]`` is the key namespace of tensor-parallel rank ``r``; ``handler``
    a :class:`HandlerSlot` (anything with ``get()`` returning a handler or None, and
    ``failed(e)``)."""

    def __init__(self, chunk_tokens: int, block_size: int, keyspaces: Sequence[str], handler: Any):
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
        self.lookups = 0
        self.hit_chunks = 0

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
        return plan

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
    """What the worker core needs from the engine's KV cache (the torch side implements
    it): ``chunk_bytes`` (one chunk, all layers) and the copies between a chunk's
    blocks and a staging slot's memoryview."""

    chunk_bytes: int

    def copy_out(self, blocks: Sequence[Tuple[int, int]], dst: memoryview) -> None:
        raise NotImplementedError

    def copy_in(self, blocks: Sequence[Tuple[int, int]], src: memoryview) -> None:
        raise NotImplementedError


@dataclass
class WorkerStats:
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    chunks_load_failed: int = 0
    load_s: float = 0.0
    chunks_stored: int = 0
    bytes_stored: int = 0
    chunks_store_skipped: int = 0
    chunks_store_failed: int = 0

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


class WorkerCore:
    """The worker side of one tensor-parallel rank.

    Loads (synchronous, before the forward pass) go in batches of as many load slots
    as libmaru lends, each copied into the engine's blocks and released before the next;
    any chunk that is not loaded whole (a miss, a short chunk, an error) marks its
    blocks and those of every later chunk of the request as failed
    (:meth:`take_load_errors`): vLLM recomputes them, never uses wrong KV.
    Stores copy each completed chunk from the blocks into store slots at once (so vLLM
    may reuse the blocks), then submit them asynchronously; libmaru publishes a key only
    after its bytes are written. A request's chunks after one that found no free store
    slot are skipped (without it they could never be found)."""

    def __init__(self, rank: int, handler: Any, kv: Optional[KVBlocks] = None,
                 clock: Callable[[], float] = time.monotonic, stats_file: Optional[str] = None):
        self.rank = rank
        self.handler = handler  # HandlerSlot
        self.kv = kv
        self.clock = clock
        self.stats = WorkerStats()
        self.stats_file = stats_file
        self.info: Dict[str, Any] = {}  # written with the stats (digest, chunk size, ...)
        self._errors: Set[int] = set()
        self._pending: List[Tuple[Any, List[Any]]] = []  # (Op, slots)
        self._last_skip_log = -SKIP_LOG_INTERVAL_S
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

    def warm_up(self, h: Any) -> int:
        """Touches every load slot once, so that the first request's load does not pay
        for faulting the staging buffer in (a cxl handler's is allocated lazily);
        returns the slots touched."""
        try:
            slots = h.acquire_slots(SlotPool.LOAD, 1 << 12, timeout=0)
        except MaruError as e:
            log.warning("maru.vllm worker: load slots not warmed up: %s", e)
            return 0
        try:
            for s in slots:
                v = s.view
                v[:] = bytes(len(v))
        finally:
            _release(slots)
        return len(slots)

    def _handler(self) -> Any:
        if self._disabled or self.kv is None:
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
            self.write_stats()

    def _load_one(self, t: ChunkTransfer) -> Optional[int]:
        """Loads ``t``'s chunks; returns the index of the first chunk not loaded, or None."""
        h = self._handler()
        if h is None:
            return 0
        keys = t.keys[self.rank]
        size = self.kv.chunk_bytes
        i = 0
        while i < len(keys):
            try:
                slots = h.acquire_slots(SlotPool.LOAD, len(keys) - i, timeout=1.0)
            except MaruError as e:
                log.warning("maru.vllm worker: no load slot: %s", e)
                return i
            try:
                lens = h.load_slots(keys[i : i + len(slots)], slots, route_key=t.route_key)
                for j, (slot, n) in enumerate(zip(slots, lens)):
                    if n != size:
                        if n is not None:
                            log.warning("maru.vllm worker: chunk %s has %d bytes, expected %d", keys[i + j], n, size)
                        return i + j
                    mv = slot.view
                    self.kv.copy_in(t.blocks[i + j], mv[:size])
                    self.stats.chunks_loaded += 1
                    self.stats.bytes_loaded += size
            except MaruError as e:
                log.warning("maru.vllm worker: load of request %s failed: %s", t.req_id, e)
                if isinstance(e, UnavailableError):
                    self.handler.failed(e)
                return i
            finally:
                _release(slots)
            i += len(slots)
        return None

    def take_load_errors(self) -> Set[int]:
        out, self._errors = self._errors, set()
        return out

    # Stores ---------------------------------------------------------------------

    def store(self, transfers: Sequence[ChunkTransfer]) -> None:
        self.poll()
        if not transfers:
            return
        h = self._handler()
        if h is None:
            return
        size = self.kv.chunk_bytes
        for t in transfers:
            keys = t.keys[self.rank]
            try:
                slots = h.acquire_slots(SlotPool.STORE, len(keys), timeout=0)
            except NoSpaceError:
                slots = []
            except MaruError as e:
                self._store_failed(t, len(keys), e)
                continue
            if len(slots) < len(keys):
                self.stats.chunks_store_skipped += len(keys) - len(slots)
                self._log_skip(t, len(keys) - len(slots))
            if not slots:
                continue
            try:
                for slot, blocks in zip(slots, t.blocks):
                    self.kv.copy_out(blocks, slot.view[:size])
                op = h.submit_store_slots(keys[: len(slots)], slots, lengths=size, route_key=t.route_key)
            except Exception as e:  # noqa: BLE001 - a failed store is a later miss, never a crash
                _release(slots)
                self._store_failed(t, len(slots), e)
                continue
            self._pending.append((op, slots))
        self.write_stats()

    def _store_failed(self, t: ChunkTransfer, n: int, e: Exception) -> None:
        self.stats.chunks_store_failed += n
        log.warning("maru.vllm worker: store of %d chunks of request %s failed: %s", n, t.req_id, e)
        if isinstance(e, UnavailableError):
            self.handler.failed(e)

    def _log_skip(self, t: ChunkTransfer, n: int) -> None:
        now = self.clock()
        if now - self._last_skip_log >= SKIP_LOG_INTERVAL_S:
            self._last_skip_log = now
            log.warning("maru.vllm worker: no free store slot: %d chunks of request %s not stored "
                        "(raise maru_store_slots; logged at most once a minute)", n, t.req_id)

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
                ok: List[bool] = []
            else:
                ok = list(op.results(0)) if done else []
            if not done:
                still.append((op, slots))
                continue
            n_ok = sum(1 for x in ok if x)
            self.stats.chunks_stored += n_ok
            self.stats.bytes_stored += n_ok * (self.kv.chunk_bytes if self.kv else 0)
            self.stats.chunks_store_skipped += len(ok) - n_ok
            try:
                op.close()
            except Exception:  # noqa: BLE001
                pass
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
        self.handler.close()


def _release(slots: Sequence[Any]) -> None:
    for s in slots:
        try:
            s.release()
        except Exception as e:  # noqa: BLE001 - a slot that cannot be released is logged, not fatal
            log.warning("maru.vllm: cannot release staging slot %s: %s", getattr(s, "id", "?"), e)
