"""SGLang's own storage backend factory (StorageBackendFactory, "dynamic" backend,
unedited) loading this package's maru_sglang.MaruStorage, one role per process, with a
stand-in for SGLang's host KV pool (page_first layout, K and V of each page in their
own buffers, as a non-MLA model's):

  set  stores 6 pages through batch_set_v1 (from the host pool), checks batch_exists
       and the legacy set/get;
  get  (another process) finds them (batch_exists), reads them through batch_get_v1
       into a zeroed host pool, checks every byte, and that no view or load slot stays
       held afterwards.

The Maru backend is the maru_storage_backend key of the extra config (from the
MARU_STORAGE_BACKEND environment variable here), the key files its maru_agent_key_file
and maru_server_key_file keys (--agent-key-file, --server-key-file), else
MARU_AGENT_KEY_FILE and libmaru's order for maru-server's key.
Exit 0 when every check held, 1 otherwise.

    python sglang_storage.py --role set|get --server HOST:PORT --ns NAME
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGES, PART = 6, 8192  # K and V of a page: 8 KiB each


class HostPool:
    """What MaruStorage reads of SGLang's host pool: the layout, and the host address
    and size of each page's K and V buffers."""

    layout = "page_first"

    def __init__(self, fill: bool, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        make = (lambda: torch.randint(0, 256, (PAGES, PART), dtype=torch.uint8, generator=g)) if fill else (
            lambda: torch.zeros((PAGES, PART), dtype=torch.uint8)
        )
        self.k, self.v = make(), make()

    def get_page_buffer_meta(self, host_indices):
        ptrs, sizes = [], []
        for i in host_indices.tolist():
            ptrs += [self.k[i].data_ptr(), self.v[i].data_ptr()]
            sizes += [PART, PART]
        return ptrs, sizes


def check(ok: bool, what: str) -> None:
    if not ok:
        print(f"FAILED: {what}", flush=True)
        sys.exit(1)


def storage(args: argparse.Namespace):
    extra = {
        "backend_name": "maru",
        "module_path": "maru_sglang.maru_storage",
        "class_name": "MaruStorage",
        "maru_server_url": f"tcp://{args.server}",
        "maru_chunk_size_bytes": "16K",
        "maru_pool_size": "64M",
        "maru_instance_id": f"{args.ns}-{args.role}",
        "maru_storage_backend": os.environ.get("MARU_STORAGE_BACKEND", "cxl"),
        "maru_timeout_ms": 5000,
    }
    # The key files from the extra config (else MARU_AGENT_KEY_FILE and libmaru's order).
    if args.agent_key_file:
        extra["maru_agent_key_file"] = args.agent_key_file
    if args.server_key_file:
        extra["maru_server_key_file"] = args.server_key_file
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=f"test/{args.ns}", extra_config=extra,
    )
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent-key-file", help="maru_agent_key_file of the extra config")
    p.add_argument("--server-key-file", help="maru_server_key_file of the extra config")
    p.add_argument("--role", choices=["set", "get"], required=True)
    p.add_argument("--server", required=True)
    p.add_argument("--ns", required=True)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    st = storage(args)
    keys = [f"{args.ns}-page{i}" for i in range(PAGES)]
    idx = torch.arange(PAGES)
    want = HostPool(True, args.seed)
    if args.role == "set":
        st.register_mem_pool_host(want)
        check(st.batch_set_v1(keys, idx) == [True] * PAGES, "batch_set_v1 stores every page")
        check(st.batch_exists(keys + ["never"]) == PAGES, "batch_exists counts the leading hits")
        check(st.set(f"{args.ns}-legacy", torch.arange(100, dtype=torch.int32)), "legacy set")
        back = st.get(f"{args.ns}-legacy")
        check(back is not None and torch.equal(back.view(torch.int32), torch.arange(100, dtype=torch.int32)), "legacy get")
        st.close()
        print(f"set {PAGES} pages of {2 * PART} bytes", flush=True)
        return
    got = HostPool(False, args.seed)
    st.register_mem_pool_host(got)
    n = st.batch_exists(keys)
    if n != PAGES:
        # Which pages, and what the handler saw (a pool unavailable or a timeout answers
        # "not found"): asked again, one by one, for the report.
        h = st._handler.native
        again = [h.exists(st._key(k)) for k in keys]
        print(f"batch_exists found {n} of {PAGES}; asked again one by one: {again}; stats: {h.stats()['total']}", flush=True)
    check(n == PAGES, "the other process finds every page")
    check(st.batch_get_v1(keys, idx) == [True] * PAGES, "batch_get_v1 reads every page")
    check(torch.equal(got.k, want.k) and torch.equal(got.v, want.v), "every byte of K and V")
    check(st.batch_get_v1(["never"], torch.arange(1)) == [False], "a miss reads nothing")
    h = st._handler.native
    s = h.stats()["staging"]
    check(h.held_in_libmaru() == {"slots": 0, "views": 0} and s["free_load_slots"] == s["load_slots"], f"nothing stays held ({s})")
    st.close()
    print(f"got {PAGES} pages, every byte equal", flush=True)


if __name__ == "__main__":
    main()
