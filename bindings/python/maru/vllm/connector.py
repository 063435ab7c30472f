"""``MaruKVConnector``: vLLM's V1 KV connector API over the Maru binding. Load it with

    kv_transfer_config={"kv_connector": "MaruKVConnector",
                        "kv_connector_module_path": "maru.vllm",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"maru_server_url": "host:port",
                                                      "maru_storage_backend": "cxl", ...}}

See docs/integration.md for every setting. The logic lives in :mod:`maru.vllm.core`;
this module converts vLLM's objects into plain values and copies whole KV blocks
between the engine's cache and Maru's staging slots.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..hook import set_memory_hook_auto
from . import core
from .core import ChunkTransfer, SchedulerCore
from .worker import KVBlocks, LayerMemory, PagedKV, WorkerCore

log = core.log
# This connector's and libmaru's log lines in vLLM's format, once per process.
core.log_through("vllm")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class MaruConnectorMetadata(KVConnectorMetadata):
    """One step's loads and stores, sent from the scheduler to every worker."""

    loads: List[ChunkTransfer] = field(default_factory=list)
    stores: List[ChunkTransfer] = field(default_factory=list)


def _digest(vllm_config: "VllmConfig", chunk_tokens: int) -> str:
    mc = vllm_config.model_config
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else dict(vars(mc.hf_config))
    return core.namespace_digest(
        hf,
        dtype=str(mc.dtype),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        block_size=vllm_config.cache_config.block_size,
        chunk_tokens=chunk_tokens,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
    )


class MaruKVConnector(KVConnectorBase_V1):
    """Shares KV chunks between vLLM engines through Maru (backends ``cxl`` and
    ``remote_cxl``). Scheduler side: one ``batch_exists`` per new request finds its
    leading stored chunks; worker side: loads them into the request's blocks before
    the forward pass, and stores the chunks each prefill step completes."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        block_size = vllm_config.cache_config.block_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.settings = core.parse_settings(extra, block_size)
        pc = vllm_config.parallel_config
        if getattr(pc, "pipeline_parallel_size", 1) != 1:
            raise ValueError("maru.vllm: pipeline parallelism is not supported (pipeline_parallel_size must be 1)")
        self.tp_size = pc.tensor_parallel_size
        self.digest = _digest(vllm_config, self.settings.chunk_tokens)
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "maru.vllm: kv_load_failure_policy is %r: a chunk that fails to load fails its request; "
                "set \"kv_load_failure_policy\": \"recompute\" to recompute it instead",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) > 1:
            raise ValueError(
                f"maru.vllm: the model has {len(groups)} KV cache groups (hybrid attention); "
                "only models with one group are supported"
            )
        s = self.settings
        # Both sides, before anything opens: a key file that is missing, unreadable, open
        # to others or not a key stops the engine naming its setting.
        s.check_key_files()
        self._scheduler: Optional[SchedulerCore] = None
        self._worker: Optional[WorkerCore] = None
        if role == KVConnectorRole.SCHEDULER:
            # Lookups only: no staging slots, no staging buffer in this process.
            cfg = s.handler_config(f"{s.engine_id}-scheduler", self.digest, lookups_only=True)
            slot = core.handler_slot(s, "scheduler", cfg)
            slot.get()  # a refused setting or key stops the engine now
            keyspaces = [core.keyspace(s.namespace, self.digest, r) for r in range(self.tp_size)]
            self._scheduler = SchedulerCore(s.chunk_tokens, block_size, keyspaces, slot)
            log.info("maru.vllm scheduler: backend %s, server %s, namespace %s, digest %s, %d tokens a chunk",
                     s.backend, s.server_url, s.namespace, self.digest, s.chunk_tokens)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
            # The handler opens in register_kv_caches, once vLLM bound this process's
            # compute threads (Placement).
            self._worker = WorkerCore(self.rank, None, stats_file=s.stats_file,
                                      in_place=s.backend == "cxl", timeout_ms=s.timeout_ms)

    # Scheduler side ----------------------------------------------------------------

    @staticmethod
    def _shareable(request: Any) -> bool:
        """Requests whose KV depends on more than their token ids are neither looked up
        nor stored: multimodal inputs, prompt embeddings, LoRA adapters."""
        return not (
            getattr(request, "mm_features", None)
            or getattr(request, "prompt_embeds", None) is not None
            or getattr(request, "lora_request", None) is not None
        )

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        assert self._scheduler is not None
        if not self._shareable(request) or not request.prompt_token_ids:
            return 0, False
        n = self._scheduler.matched_tokens(request.request_id, request.prompt_token_ids, num_computed_tokens)
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        so = scheduler_output
        new = [
            (
                r.req_id,
                r.prompt_token_ids if self._shareable(r) and r.prompt_token_ids else None,
                r.block_ids[0],
                r.num_computed_tokens,
                so.num_scheduled_tokens.get(r.req_id, 0),
            )
            for r in so.scheduled_new_reqs
        ]
        c = so.scheduled_cached_reqs
        cached = [
            (
                req_id,
                None if c.new_block_ids[i] is None else c.new_block_ids[i][0],
                req_id in c.resumed_req_ids,
                c.num_computed_tokens[i],
                so.num_scheduled_tokens.get(req_id, 0),
            )
            for i, req_id in enumerate(c.req_ids)
        ]
        # A preempted request keeps its state: it comes back as a resumed cached request
        # with new blocks (and a new lookup, which may load again).
        plan = self._scheduler.plan(new, cached, so.finished_req_ids)
        return MaruConnectorMetadata(loads=plan.loads, stores=plan.stores)

    def request_finished(self, request: "Request", block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        # Stores copy the blocks into staging slots in the step that completes them, so
        # vLLM may free the blocks at once.
        if self._scheduler is not None:
            self._scheduler.forget(request.request_id)
        return False, None

    # Worker side ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        kv = TorchKVBlocks(kv_caches, self.settings.chunk_tokens // self._vllm_config.cache_config.block_size, num_blocks)
        self._worker.attach(kv)
        self._worker.info = {
            "digest": self.digest,
            "namespace": self.settings.namespace,
            "keyspace": core.keyspace(self.settings.namespace, self.digest, self.rank),
            "chunk_tokens": self.settings.chunk_tokens,
            "chunk_bytes": kv.chunk_bytes,
        }
        self._worker.write_stats()
        log.info("maru.vllm worker %d: %d layers, %d bytes a chunk (%s)", self.rank, len(kv.layers), kv.chunk_bytes, kv.describe())
        if kv.device.type == "cuda":
            # Pin the staging buffer (cudaHostRegister) so that the copies between the
            # GPU's blocks and the slots are DMA; process-wide, before the handler opens.
            set_memory_hook_auto()
        # libmaru's calls, and the threads it starts in them, off the compute cores.
        place = core.Placement.off_compute()
        s = self.settings
        cfg = s.handler_config(f"{s.engine_id}-worker{self.rank}", self.digest)
        self._worker.handler = core.handler_slot(s, f"worker {self.rank}", cfg, place)
        log.info("maru.vllm worker %d: libmaru's calls and threads on cores %s (this thread on %s)", self.rank,
                 sorted(place.cores) or "as this thread", sorted(os.sched_getaffinity(0)))
        h = self._worker.handler.get()  # a refused setting or key stops the engine now
        if h is not None:
            why = self._worker.chunk_misfit(h)
            if why:
                raise ValueError(f"maru.vllm: {why}")

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, MaruConnectorMetadata)
        if meta.loads:
            self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole chunks of all layers are stored in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, MaruConnectorMetadata)
        self._worker.store(meta.stores)

    def get_finished(self, finished_req_ids: set) -> Tuple[Optional[set], Optional[set]]:
        if self._worker is not None:
            self._worker.poll()
        return None, None

    def get_block_ids_with_load_errors(self) -> set:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


_LAYER_NUM = re.compile(r"layers\.(\d+)")


def _layer_order(name: str) -> Tuple[int, str]:
    m = _LAYER_NUM.search(name)
    return (int(m.group(1)) if m else 1 << 30, name)


class TorchKVBlocks(KVBlocks):
    """The engine's KV cache as whole blocks of bytes. A chunk is, for each layer (in
    layer order), its ``blocks_per_chunk`` blocks one after the other (each piece of
    them: see :class:`~maru.vllm.worker.LayerMemory`). A layer's tensor must be
    contiguous with the block index in dimension 0 (vLLM's CPU layout
    ``[num_blocks, kv_heads, block_size, 2*head_size]``) or 1 (``[2, num_blocks, ...]``:
    K blocks, then V blocks).

    On CPU the copies are :class:`~maru.vllm.worker.PagedKV`'s ``memmove`` of whole runs of
    blocks (loads: libmaru copies those pieces itself, :meth:`host_moves`; torch's index
    copies cost far more here); on another device each layer is
    copied with one ``index_select`` / ``index_copy_`` per chunk."""

    def __init__(self, kv_caches: Dict[str, torch.Tensor], blocks_per_chunk: int, num_blocks: Optional[int]):
        if not kv_caches:
            raise ValueError("maru.vllm: vLLM registered no KV cache layers")
        self.bpc = blocks_per_chunk
        self.layers: List[Tuple[str, torch.Tensor, int, int]] = []  # name, uint8 view, block dim, block bytes
        memory: List[LayerMemory] = []
        seen = set()
        for name in sorted(kv_caches, key=_layer_order):
            t = kv_caches[name]
            if t.data_ptr() in seen:
                continue  # a tensor shared by several layers is moved once
            seen.add(t.data_ptr())
            if not t.is_contiguous():
                raise ValueError(f"maru.vllm: KV cache of layer {name} is not contiguous ({tuple(t.shape)})")
            nb = num_blocks if num_blocks is not None else t.shape[0]
            if t.shape[0] == nb:
                dim = 0
                u8 = t.view(torch.uint8).reshape(nb, -1)
                pieces, piece = 1, u8.shape[1]
            elif t.dim() > 1 and t.shape[1] == nb:
                dim = 1
                u8 = t.view(torch.uint8).reshape(t.shape[0], nb, -1)
                pieces, piece = u8.shape[0], u8.shape[2]
            else:
                raise ValueError(
                    f"maru.vllm: cannot find the block dimension ({nb} blocks) of layer {name}'s KV cache {tuple(t.shape)}"
                )
            self.layers.append((name, u8, dim, pieces * piece))
            memory.append(LayerMemory(u8.data_ptr(), nb, pieces, piece))
        self.chunk_bytes = sum(bb for *_, bb in self.layers) * self.bpc
        self.device = self.layers[0][1].device
        self.host = PagedKV(memory, blocks_per_chunk) if self.device.type == "cpu" else None
        self._shapes = sorted({(tuple(kv_caches[n].shape[1:]), str(kv_caches[n].dtype)) for n, *_ in self.layers})

    def describe(self) -> str:
        t = self.layers[0][1]
        return f"block dim {self.layers[0][2]}, device {t.device}, layer shapes {self._shapes}"

    @staticmethod
    def _memory(addr: int, size: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_char * size).from_address(addr), dtype=torch.uint8)

    def host_moves(self, blocks: Sequence[Tuple[int, int]]) -> Optional[List[Tuple[int, int, int]]]:
        return self.host.moves(blocks) if self.host is not None else None

    def copy_out(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        if self.host is not None:
            self.host.copy_out(blocks, addr, size)
            return
        if [p for p, _ in blocks] != list(range(self.bpc)) or size != self.chunk_bytes:
            raise ValueError("a stored chunk needs all its blocks")
        out = self._memory(addr, size)
        ids = torch.tensor([b for _, b in blocks], dtype=torch.long, device=self.device)
        off = 0
        for _, u8, dim, bb in self.layers:
            n = bb * self.bpc
            out[off : off + n].copy_(u8.index_select(dim, ids).reshape(-1))
            off += n

    def copy_in(self, blocks: Sequence[Tuple[int, int]], addr: int, size: int) -> None:
        if self.host is not None:
            self.host.copy_in(blocks, addr, size)
            return
        if size != self.chunk_bytes:
            raise ValueError(f"a chunk here is {self.chunk_bytes} bytes, not {size}")
        data = self._memory(addr, size)
        pos = torch.tensor([p for p, _ in blocks], dtype=torch.long)
        ids = torch.tensor([b for _, b in blocks], dtype=torch.long, device=self.device)
        whole = len(blocks) == self.bpc
        off = 0
        for _, u8, dim, bb in self.layers:
            n = bb * self.bpc
            part = data[off : off + n]
            part = part.view(self.bpc, -1) if dim == 0 else part.view(u8.shape[0], self.bpc, -1)
            if not whole:
                part = part.index_select(dim, pos)
            u8.index_copy_(dim, ids, part.to(self.device))
            off += n
