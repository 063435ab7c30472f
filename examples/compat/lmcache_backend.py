"""LMCache's own MaruBackend (lmcache.v1.storage_backend.maru_backend, unedited) on
this package's maru / maru_lmcache, one role per process:

  store  allocates pages through the backend's CxlMemoryAdapter (batched), fills them
         (torch fill, the GPU copy's stand-in), puts them (batched_submit_put_task) and
         a single put of a partial chunk, waits for the puts, closes;
  load   (another process) finds the keys (batched_contains), reads them
         (batched_get_blocking and get_blocking) and checks every byte, then checks
         that a retrieved chunk's lease ends when LMCache drops its memory object.

The backend is the MARU_STORAGE_BACKEND environment variable (cxl or remote_cxl; the
agent key is MARU_AGENT_KEY_FILE), as LMCache's MaruBackend passes no backend. Exit 0
when every check held, 1 otherwise (the failed check printed). With --plugin the backend
is maru_lmcache.backend.MaruPluginBackend (an LMCache storage plugin) and the backend
and key files come from extra_config (--plugin-backend, --agent-key-file,
--server-key-file) instead of the environment.

    python lmcache_backend.py --role store|load --server HOST:PORT --chunk-tokens 16 \
        --keys 8 --seed 1 --ns NAME
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.maru_backend import MaruBackend

LAYERS, KV_HEADS, HEAD = 2, 2, 64  # one chunk: 2 x layers x tokens x (heads x head) bf16


def key(ns: str, i: int) -> CacheEngineKey:
    return CacheEngineKey(ns, 1, 0, 0x1000 + i, torch.bfloat16)


def chunk_bytes(seed: int, i: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _metadata_and_loop(args: argparse.Namespace) -> tuple:
    """The engine's metadata (one worker, bfloat16 KV of the example's shape) and an
    event loop running on a thread of its own, as LMCache gives a backend."""
    meta = LMCacheMetadata(
        model_name=args.ns,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(LAYERS, 2, args.chunk_tokens, KV_HEADS, HEAD),
        chunk_size=args.chunk_tokens,
    )
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return meta, loop


def backend(args: argparse.Namespace) -> tuple:
    if args.plugin:
        return plugin_backend(args)
    cfg = LMCacheEngineConfig(
        chunk_size=args.chunk_tokens,
        local_cpu=False,
        max_local_cpu_size=0,
        maru_path=f"maru://{args.server}",
        maru_pool_size=0.0625,
        extra_config={"maru_instance_id": f"{args.ns}-{args.role}", "maru_timeout_ms": 5000},
    )
    meta, loop = _metadata_and_loop(args)
    return MaruBackend(cfg, meta, loop, "cpu"), loop


def plugin_backend(args: argparse.Namespace) -> tuple:
    """maru_lmcache.backend.MaruPluginBackend as LMCache builds a storage plugin: every
    Maru setting (backend, key files) from extra_config, no maru_path."""
    import importlib

    extra = {
        "storage_plugin.maru.module_path": "maru_lmcache.backend",
        "storage_plugin.maru.class_name": "MaruPluginBackend",
        "maru_server_url": f"maru://{args.server}",
        "maru_instance_id": f"{args.ns}-{args.role}",
        "maru_timeout_ms": 5000,
        "maru_storage_backend": args.plugin_backend,
        "maru_agent_key_file": args.agent_key_file,
        "maru_server_key_file": args.server_key_file,
    }
    cfg = LMCacheEngineConfig(
        chunk_size=args.chunk_tokens,
        local_cpu=False,
        max_local_cpu_size=0,
        maru_pool_size=0.0625,
        storage_plugins=["maru"],
        extra_config={k: v for k, v in extra.items() if v is not None},
    )
    meta, loop = _metadata_and_loop(args)
    # What LMCache's storage_backend.__init__ does with a plugin's module_path/class_name.
    cls = getattr(
        importlib.import_module(cfg.extra_config["storage_plugin.maru.module_path"]),
        cfg.extra_config["storage_plugin.maru.class_name"],
    )
    return cls(config=cfg, dst_device="cpu", metadata=meta, local_cpu_backend=None, loop=loop), loop


def check(ok: bool, what: str) -> None:
    if not ok:
        print(f"FAILED: {what}", flush=True)
        sys.exit(1)


def store(args: argparse.Namespace) -> None:
    be, loop = backend(args)
    shape = be.memory_allocator._shapes[0]
    full = be._full_chunk_size_bytes
    objs = be.batched_allocate(shape, torch.bfloat16, args.keys)
    check(objs is not None and len(objs) == args.keys, f"batched_allocate of {args.keys} pages")
    for i, o in enumerate(objs):
        o.tensor.view(torch.uint8).flatten().copy_(chunk_bytes(args.seed, i, full))
    keys = [key(args.ns, i) for i in range(args.keys)]
    for f in be.batched_submit_put_task(keys, objs):
        f.result(timeout=30)
    # A partial chunk (half the tokens) through the single put.
    half = list(shape)
    half[2] //= 2
    part = be.allocate(torch.Size(half), torch.bfloat16)
    check(part is not None and part.get_size() == full // 2, "allocate of a partial chunk")
    part.tensor.view(torch.uint8).flatten().copy_(chunk_bytes(args.seed, 999, full // 2))
    be.submit_put_task(key(args.ns, 999), part).result(timeout=30)
    check(be.batched_contains(keys + [key(args.ns, 999)]) == args.keys + 1, "the writer finds its keys")
    be.close()
    loop.call_soon_threadsafe(loop.stop)
    print(f"stored {args.keys} chunks of {full} bytes and a partial one", flush=True)


def load(args: argparse.Namespace) -> None:
    be, loop = backend(args)
    full = be._full_chunk_size_bytes
    keys = [key(args.ns, i) for i in range(args.keys)]
    check(be.batched_contains(keys + [key(args.ns, 12345)]) == args.keys, "batched_contains stops at the miss")
    got = be.batched_get_blocking(keys)
    # While LMCache holds the objects, their chunks stay held (a lease on cxl, a load
    # slot on remote_cxl): nothing can reuse the bytes under them.
    h = be._handler
    st = h.native.stats()["staging"]
    held = h.native.held_in_libmaru()["views"] if h.config.backend == "cxl" else st["load_slots"] - st["free_load_slots"]
    check(held >= min(args.keys, st["load_slots"] - 1), f"the chunks LMCache holds stay held ({held} held)")
    for i, o in enumerate(got):
        check(o is not None, f"chunk {i} found")
        check(torch.equal(o.tensor.view(torch.uint8).flatten()[:full], chunk_bytes(args.seed, i, full)), f"chunk {i}'s bytes")
        o.ref_count_down()
    del got, o
    one = be.get_blocking(key(args.ns, 999))
    check(one is not None and one.get_size() == full // 2, "the partial chunk found with its size")
    check(torch.equal(one.tensor.view(torch.uint8).flatten(), chunk_bytes(args.seed, 999, full // 2)), "the partial chunk's bytes")
    del one
    check(be.get_blocking(key(args.ns, 12345)) is None, "a miss is None")
    # Leases end with the objects: after LMCache dropped them nothing stays held.
    st = h.native.stats()["staging"]
    check(h.native.held_in_libmaru() == {"slots": 0, "views": 0}, "nothing held once LMCache dropped its objects")
    check(st["free_load_slots"] == st["load_slots"], f"every load slot back ({st})")
    be.close()
    loop.call_soon_threadsafe(loop.stop)
    print(f"loaded {args.keys} chunks and a partial one, every byte equal", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["store", "load"], required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--chunk-tokens", type=int, default=16)
    p.add_argument("--keys", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ns", required=True)
    p.add_argument("--plugin", action="store_true", help="maru_lmcache.backend.MaruPluginBackend, settings in extra_config")
    p.add_argument("--plugin-backend", default="cxl", help="maru_storage_backend of the plugin's extra_config")
    p.add_argument("--agent-key-file", help="maru_agent_key_file of the plugin's extra_config")
    p.add_argument("--server-key-file", help="maru_server_key_file of the plugin's extra_config")
    args = p.parse_args()
    (store if args.role == "store" else load)(args)


if __name__ == "__main__":
    main()
