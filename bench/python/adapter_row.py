"""The adapter-style row of make bench: what LMCache's or SGLang's adapter does on cxl
through the upstream-compatible layer (maru.MaruHandler): batched_alloc of 32 pages,
a numpy fill of each (the engine's copy into the page), batch_store of the 32, then a
delete of the 32 (a full cache that evicts reuses its pages). Beside it, in turns, a
numpy copy of the same bytes into ordinary memory of the same size (the memcpy it is
judged by), and alone, one alloc (a page taken and given back).

Prints one JSON object: fill_store {gbs, p50_us, ops}, memcpy {gbs, p50_us, ops},
alloc {p50_us, p99_us, ops}. Run by maru-bench (part in_place) against its cxl stack:

    python adapter_row.py --server HOST:PORT --server-key-file KEY --chunk 2097152 --batch 32 --secs 8

The compat config has no field for maru-server's key: the key file is given to libmaru
through ``MARU_SERVER_KEY_FILE``, as an LMCache or SGLang deployment gives it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid

import numpy as np

from maru import MaruConfig, MaruHandler

ROUNDS = 4


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def measure(op, secs):
    lat, n, t0 = [], 0, time.perf_counter()
    while time.perf_counter() - t0 < secs or n == 0:
        t = time.perf_counter()
        n += op()
        lat.append((time.perf_counter() - t) * 1e6)
    return n, time.perf_counter() - t0, lat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True)
    p.add_argument("--server-key-file", help="maru-server's key (sets MARU_SERVER_KEY_FILE)")
    p.add_argument("--chunk", type=int, default=2 << 20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--secs", type=float, default=8.0)
    p.add_argument("--rotate-mib", type=int, default=512, help="source (and memcpy destination) memory, cold")
    a = p.parse_args()
    chunk, batch = a.chunk, a.batch
    n_src = max(2 * batch, (a.rotate_mib << 20) // chunk)
    src = np.random.default_rng(3).integers(0, 256, size=(n_src, chunk), dtype=np.uint8)
    dst = np.empty_like(src)  # memcpy's destination: as much cold memory
    dst[:] = 1
    if a.server_key_file:
        os.environ["MARU_SERVER_KEY_FILE"] = a.server_key_file
    cfg = MaruConfig(server_url=f"tcp://{a.server}", chunk_size_bytes=chunk, storage_backend="cxl",
                     instance_id=f"bench-adapter-{uuid.uuid4().hex[:6]}", timeout_ms=10000)
    h = MaruHandler(cfg)
    if not h.connect():
        raise SystemExit(f"connect: {h.last_error}")
    at = {"src": 0, "dst": 0, "i": 0}

    def next_src():
        i = at["src"]
        at["src"] = (i + 1) % n_src
        return src[i]

    def fill_store():
        handles = h.batched_alloc([chunk] * batch)
        for x in handles:
            np.frombuffer(x.buf, dtype=np.uint8)[:] = next_src()
        keys = [f"a-{at['i']}-{j}" for j in range(batch)]
        at["i"] += 1
        ok = h.batch_store(keys, handles)
        if not all(ok):
            raise SystemExit(f"batch_store stored {sum(ok)} of {batch}")
        if not all(h.batch_delete(keys)):
            raise SystemExit("batch_delete refused")
        return batch * chunk

    def memcpy():
        for _ in range(batch):
            j = at["dst"]
            at["dst"] = (j + 1) % n_src
            dst[j][:] = next_src()
        return batch * chunk

    # Warm-up: once through the region's pages and the destination.
    for _ in range(4):
        fill_store()
    for _ in range(n_src // batch + 1):
        memcpy()
    figs = {"fill_store": [0, 0.0, []], "memcpy": [0, 0.0, []]}
    for _ in range(ROUNDS):
        for name, op in (("memcpy", memcpy), ("fill_store", fill_store)):
            n, wall, lat = measure(op, a.secs / ROUNDS)
            f = figs[name]
            f[0] += n
            f[1] += wall
            f[2] += lat
    one = []
    for _ in range(2000):
        t = time.perf_counter()
        x = h.alloc(chunk)
        one.append((time.perf_counter() - t) * 1e6)
        h.free(x)
    h.close()
    out = {name: {"gbs": n / wall / 1e9, "p50_us": pct(lat, 0.5), "ops": len(lat)} for name, (n, wall, lat) in figs.items()}
    out["alloc"] = {"p50_us": pct(one, 0.5), "p99_us": pct(one, 0.99), "ops": len(one)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
