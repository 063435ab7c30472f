#!/usr/bin/env python3
"""What the LMCache Maru adapter does, written against the upstream Maru Python API
only (``from maru import MaruConfig, MaruHandler``), so the same script runs on the
upstream package and on libmaru's compatibility layer (either backend).

A writer engine stores a request's KV chunks two ways, as the adapter does:

* allocator path (``CxlMemoryAdapter``): ``alloc(size)``, fill ``handle.buf`` in place,
  ``store(key, handle)``;
* connector path (``MaruConnector.batched_put``): ``batch_store(keys, [MemoryInfo(view)])``.

Keys are ints, as the connector's ``cache_key_to_int``; the last chunk is partial. A
reader engine (another handler, another instance id) counts the leading hits with
``batch_exists``, loads them with ``batch_retrieve``, copies each view out (the
``torch.frombuffer(info.view).to(device)`` step) and compares SHA-256 checksums with the
writer's. Prints one JSON line; exits 0 when every checksum matches.

    python3 examples/compat/lmcache_like.py --server tcp://127.0.0.1:5555 --chunk-size 1048576
    python3 examples/compat/lmcache_like.py --server tcp://127.0.0.1:5555 --storage-backend remote_cxl \\
        --agent-key-file /etc/maru/remote-cxl-agent.key
"""

import argparse
import hashlib
import json
import sys
import time
import uuid

from maru import MaruConfig, MaruHandler
from maru_handler.memory import MemoryInfo


def cache_key_to_int(s: str) -> int:
    """The LMCache connector's key: the first 8 bytes of SHA-256, as an int."""
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], byteorder="big", signed=False)


def kv_bytes(i: int, n: int, salt: str) -> bytes:
    """Deterministic stand-in for a chunk's KV tensor bytes."""
    block = hashlib.sha256(f"{salt}/{i}".encode()).digest()
    return (block * (n // len(block) + 1))[:n]


def make_config(args: argparse.Namespace, instance: str) -> MaruConfig:
    kw = dict(server_url=args.server, instance_id=instance, chunk_size_bytes=args.chunk_size,
              pool_size=max(args.chunk_size, 100 * 1024 * 1024), auto_connect=False)
    # Settings of later upstream versions (remote_cxl, PR #107), passed only when asked for.
    later = {
        "storage_backend": args.storage_backend,
        "agent_key_file": args.agent_key_file,
        "cache_namespace": args.namespace,
    }
    kw.update((k, v) for k, v in later.items() if v)
    return MaruConfig(**kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="tcp://localhost:5555")
    ap.add_argument("--chunk-size", type=int, default=1024 * 1024, help="bytes per chunk (<= maru-server's)")
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--storage-backend", default=None, help="cxl or remote_cxl (later upstream versions)")
    ap.add_argument("--agent-key-file", default=None)
    ap.add_argument("--namespace", default=None)
    args = ap.parse_args()

    run = uuid.uuid4().hex[:12]  # fresh keys on every run
    n = args.chunks
    sizes = [args.chunk_size] * (n - 1) + [args.chunk_size // 3 + 1]  # a partial last chunk
    keys = [cache_key_to_int(f"{run}@model@chunk{i}") for i in range(n)]
    sums = {}

    writer = MaruHandler(make_config(args, f"writer-{run}"))
    if not writer.connect():
        print("writer: connect() returned False", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    half = n // 2
    for i in range(half):  # allocator path: fill the page in place, then register it
        data = kv_bytes(i, sizes[i], run)
        handle = writer.alloc(sizes[i])
        handle.buf[: sizes[i]] = data
        if not writer.store(keys[i], handle):
            print(f"writer: store of chunk {i} failed", file=sys.stderr)
            return 1
        sums[i] = hashlib.sha256(data).hexdigest()
    infos = []
    for i in range(half, n):  # connector path: batched put of MemoryInfo views
        data = bytearray(kv_bytes(i, sizes[i], run))
        infos.append(MemoryInfo(view=memoryview(data)))
        sums[i] = hashlib.sha256(data).hexdigest()
    stored = writer.batch_store(keys[half:], infos)
    store_s = time.monotonic() - t0
    writer.close()  # its chunks stay readable for other engines

    reader = MaruHandler(make_config(args, f"reader-{run}"))
    if not reader.connect():
        print("reader: connect() returned False", file=sys.stderr)
        return 2
    probe = keys + [cache_key_to_int(f"{run}@never-stored")]
    hits = 0
    for e in reader.batch_exists(probe):  # batched_contains: leading hits
        if not e:
            break
        hits += 1
    t1 = time.monotonic()
    got = reader.batch_retrieve(keys[:hits])
    mismatches = 0
    loaded = 0
    for i, info in enumerate(got):
        if info is None:
            mismatches += 1
            continue
        out = bytearray(len(info.view))  # the copy to the GPU
        out[:] = info.view
        loaded += len(out)
        if len(out) != sizes[i] or hashlib.sha256(out).hexdigest() != sums[i]:
            mismatches += 1
    load_s = time.monotonic() - t1
    healthy = reader.healthcheck()
    reader.close()

    ok = hits == n and all(stored) and mismatches == 0 and healthy
    print(json.dumps({"chunks": n, "stored": sum(stored) + half, "hits": hits, "bytes_loaded": loaded,
                      "mismatches": mismatches, "healthy": healthy, "store_s": round(store_s, 4),
                      "load_s": round(load_s, 4), "checksums": "match" if ok else "MISMATCH"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
