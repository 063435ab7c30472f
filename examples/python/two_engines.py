"""Two engines share KV through Maru: run once as the engine that computes a prompt's KV
and stores it, once as the engine that finds the same prefix and loads it.

    python two_engines.py store CONFIG_JSON      # engine A
    python two_engines.py load CONFIG_JSON       # engine B (another process)

Both compute the chunk keys of the same token ids with ``maru.chunk_keys`` (prefix-
chained hashes within the namespace), so B finds A's chunks without knowing A. On the
``cxl`` backend B reads them in place (``acquire_views``: no copy at all); on
``remote_cxl`` it loads copies (``batch_retrieve``).
examples/python/run.sh starts the daemons and runs both.
"""

import hashlib
import json
import sys
import time

from maru import Handler, chunk_keys

CHUNK_TOKENS = 256
PROMPT = list(range(1000, 1000 + 32 * CHUNK_TOKENS))  # a long shared system prompt


def kv_of(key: str, size: int) -> bytes:
    """Stands in for the KV a model computes for a chunk (deterministic per key)."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("store", "load"):
        print(__doc__, file=sys.stderr)
        return 2
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    with Handler(cfg) as h:
        keys = chunk_keys(PROMPT, CHUNK_TOKENS, cfg.get("namespace", "default"))
        size = min(h.chunk_size(), 256 * 1024)
        route = keys[0]  # every chunk of a request goes to the pool of its first key
        t0 = time.perf_counter()
        if role == "store":
            stored = h.batch_store([(k, kv_of(k, size)) for k in keys], route_key=route)
            print(f"engine A: stored {sum(stored)}/{len(keys)} chunks in {time.perf_counter() - t0:.3f} s")
            return 0 if all(stored) else 1
        found = h.batch_exists(keys, route_key=route)
        hits = [k for k, f in zip(keys, found) if f]
        if cfg.get("backend") == "cxl":
            # Read in place from the mapped CXL region (no copy), under leases released
            # at once: where an engine would copy each view to the GPU, hash it here.
            views = h.acquire_views(hits, route_key=route)
            bad = sum(1 for k, v in zip(hits, views) if v is None or v.view != kv_of(k, size))
            h.release_views(views)
            how = "read in place"
        else:
            got = h.batch_retrieve(hits, route_key=route)
            bad = sum(1 for k, g in zip(hits, got) if g != kv_of(k, size))
            how = "loaded"
        print(f"engine B: {sum(found)}/{len(keys)} chunks found, {how} in "
              f"{time.perf_counter() - t0:.3f} s, {bad} mismatched")
        return 0 if all(found) and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
