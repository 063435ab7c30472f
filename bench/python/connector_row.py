"""The vLLM connector's row of make bench: what maru.vllm's worker does between Maru
and vLLM's paged KV cache, outside vLLM. The cache is vLLM's CPU layout in numpy
(16 layers, each ``[num_blocks, block bytes]``, blocks of 128 tokens, 2 blocks a chunk),
the handler the connector's own (``Settings.handler_config``: cxl writes chunks into
pages, remote_cxl stores through its staging slots; loads on both are one
``maru_load_pieces`` call per batch) and the copies the connector's (``PagedKV``,
``WorkerCore``).

Stores ``--stored`` chunks once (timed: the step's copies and submits, then until they
are published), checks one batch's bytes after a load, then loads batches of
``--batch`` chunks of them into other blocks for ``--secs`` (new blocks each batch).
Prints one JSON object: load {gbs, p50_us, ops, copy_gbs (the connector's
``maru_load_pieces`` calls alone: leases, transfers and copies into the blocks inside
libmaru)}, store {gbs, p50_us, ops}.

    python connector_row.py --config '{"backend": "cxl", "server_url": ...}' --chunk 2097152 --batch 32 --secs 4
"""

from __future__ import annotations

import argparse
import json
import random
import time
import uuid

import numpy as np

import maru
from maru.vllm.core import ChunkTransfer, handler_slot, keyspace, parse_settings
from maru.vllm.worker import LayerMemory, PagedKV, WorkerCore

LAYERS = 16
BLOCK_TOKENS = 128
BLOCKS_PER_CHUNK = 2


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a handler configuration of the bench's stack (JSON)")
    p.add_argument("--chunk", type=int, default=2 << 20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--stored", type=int, default=128, help="chunks stored, then loaded in turns")
    p.add_argument("--secs", type=float, default=4.0)
    a = p.parse_args()
    cfg = json.loads(a.config)
    backend = cfg["backend"]
    block_bytes = a.chunk // (LAYERS * BLOCKS_PER_CHUNK)
    extra = {
        "maru_server_url": cfg["server_url"],
        "maru_storage_backend": backend,
        "maru_cache_namespace": f"bench-connector-{uuid.uuid4().hex[:8]}",
        "maru_chunk_tokens": BLOCK_TOKENS * BLOCKS_PER_CHUNK,
        "maru_timeout_ms": 10000,
    }
    if cfg.get("server_key_file"):
        extra["maru_server_key_file"] = cfg["server_key_file"]
    if backend == "remote_cxl":
        # Store slots for two batches in flight: the row stores batch after batch, as a
        # long prefill does, and waits when both are still in flight (else the third
        # batch would find no slot and be skipped, as the connector does in vLLM).
        extra.update(maru_remote_cxl_agent_key_file=cfg["agent_key_file"], maru_load_slots=a.batch,
                     maru_store_slots=2 * a.batch)
    s = parse_settings(extra, BLOCK_TOKENS)
    s.check_key_files()
    digest = "bench"
    # The source blocks of the stored chunks, then as many blocks again that loads
    # rotate through (each batch into blocks no load touched just before).
    n_src = a.stored * BLOCKS_PER_CHUNK
    n_blocks = n_src + 4 * a.batch * BLOCKS_PER_CHUNK
    rng = np.random.default_rng(7)
    cache = [rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8) for _ in range(LAYERS)]
    kv = PagedKV([LayerMemory(c.ctypes.data, n_blocks, 1, block_bytes) for c in cache], BLOCKS_PER_CHUNK)
    assert kv.chunk_bytes == a.chunk
    tokens = [random.Random(3).randrange(1, 1 << 30) for _ in range(a.stored * BLOCK_TOKENS * BLOCKS_PER_CHUNK)]
    keys = maru.chunk_keys(tokens, BLOCK_TOKENS * BLOCKS_PER_CHUNK, keyspace(s.namespace, digest, 0))

    def blocks(first_block: int, n: int):
        return [[(j, first_block + i * BLOCKS_PER_CHUNK + j) for j in range(BLOCKS_PER_CHUNK)] for i in range(n)]

    in_place = backend == "cxl"
    writer = WorkerCore(0, handler_slot(s, "bench writer", s.handler_config("bench-connector-w", digest)), kv,
                        in_place=in_place, timeout_ms=10000)
    store_lat = []
    t0 = time.perf_counter()
    for i in range(0, a.stored, a.batch):
        t = time.perf_counter()
        part = keys[i : i + a.batch]
        if writer.poll() >= 2:
            writer.poll(60.0)
        # One request per batch (its own route key), as a step of a long prefill.
        writer.store([ChunkTransfer(f"s{i}", part[0], i, [part], blocks(i * BLOCKS_PER_CHUNK, len(part)))])
        store_lat.append((time.perf_counter() - t) * 1e6)
    if writer.poll(60.0):
        raise SystemExit("stores did not finish")
    store_s = time.perf_counter() - t0
    if writer.stats.chunks_stored != a.stored:
        raise SystemExit(f"stored {writer.stats.chunks_stored} of {a.stored} chunks: {writer.stats}")
    writer.close()

    reader = WorkerCore(0, handler_slot(s, "bench reader", s.handler_config("bench-connector-r", digest)), kv,
                        in_place=in_place, timeout_ms=10000)
    lat, ops, turn = [], 0, 0
    deadline = time.perf_counter() + a.secs
    while time.perf_counter() < deadline or ops == 0:
        i = (turn * a.batch) % a.stored
        part = keys[i : i + a.batch]
        dst = n_src + (turn % 4) * a.batch * BLOCKS_PER_CHUNK
        t = time.perf_counter()
        reader.load([ChunkTransfer(f"l{turn}", keys[i], i, [part], blocks(dst, len(part)))])
        lat.append((time.perf_counter() - t) * 1e6)
        if reader.take_load_errors():
            raise SystemExit(f"load of batch {turn} failed: {reader.stats}")
        if turn == 0:  # the bytes are the stored ones
            for c in cache:
                src_rows = c[i * BLOCKS_PER_CHUNK : (i + len(part)) * BLOCKS_PER_CHUNK]
                if not np.array_equal(c[dst : dst + len(part) * BLOCKS_PER_CHUNK], src_rows):
                    raise SystemExit("a loaded chunk differs from the stored one")
        ops += 1
        turn += 1
    st = reader.stats
    reader.close()
    print(json.dumps({
        "load": {"gbs": st.bytes_loaded / st.load_s / 1e9, "p50_us": pct(lat, 0.5), "ops": ops,
                 "copy_gbs": st.bytes_loaded / st.load_copy_s / 1e9 if st.load_copy_s > 0 else 0.0},
        "store": {"gbs": a.stored * a.chunk / store_s / 1e9, "p50_us": pct(store_lat, 0.5), "ops": len(store_lat)},
    }))


if __name__ == "__main__":
    main()
