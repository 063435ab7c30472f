"""One vLLM engine run (its own process): generates from a prompt of random token ids
and writes what happened as JSON. Used by e2e.py (make test-vllm) and demo.py
(make demo-vllm).

    python engine.py --model DIR --out FILE [--connector none|maru|example]
        [--backend cxl|remote_cxl --server HOST:PORT --key FILE --engine-id ID
         --namespace NS --chunk-tokens N --stats-file FILE] [--example-dir DIR]
        [--dtype bfloat16] [--prompt-len 1030 --prompt-seed 1 --max-tokens 16]

The JSON: tokens (generated ids), num_cached_tokens (vLLM's count of prompt tokens not
computed: with prefix caching off, those the connector loaded), ttft_s (wall time of
generating the first token, after a warm-up request too short to touch the
connector), total_s, start_s (engine start-up), ran_on (what the worker process ran
with, asked of it: torch's threads, the cores its main thread may run on, the vLLM
settings that decided them). --shared N runs N requests in one step instead, each the
prompt's first --shared-tokens tokens followed by tokens of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def raw_load_in_worker(llm: object, a: argparse.Namespace, extra: dict, prompt: list) -> tuple:
    """The same run's raw batch load: in the worker process (its cores, beside vLLM's
    other processes), ``maru.Handler.batch_retrieve_into`` of the chunks the connector
    loaded (the prompt's full chunks less the last token) into host buffers, each pass
    into buffers of its own (filled when allocated, as vLLM fills its KV cache, and
    not in the caches since: as the blocks a request gets). Each pass first writes
    twice the last-level cache over other memory, so the chunks are read from memory,
    as a connector load after a forward pass reads them and as ``make bench``'s raw
    figures rotate over memory far beyond the caches. Returns the best such pass's
    GB/s, and the best of as many passes back to back with no eviction between them
    (the chunks then partly in the cache), shown beside it."""
    from maru.vllm.core import parse_settings

    with open(a.stats_file) as f:
        info = json.load(f)
    settings = parse_settings(extra, a.chunk_tokens)
    cfg = settings.handler_config(f"{a.engine_id}-raw", info["digest"])
    import maru

    keys = maru.chunk_keys(prompt, a.chunk_tokens, info["keyspace"])[: (len(prompt) - 1) // a.chunk_tokens]
    return llm.collective_rpc(_raw_load, args=(cfg, keys, info["chunk_bytes"], a.raw_load))[0]


def _llc_bytes() -> int:
    """The last-level cache's size (from sysfs; 64 MiB when it cannot be read)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    size = 0
    try:
        for d in os.listdir(base):
            with open(os.path.join(base, d, "size")) as f:
                text = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            size = max(size, int(text.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return size or 64 << 20


def _raw_load(worker: object, cfg: dict, keys: list, size: int, passes: int) -> tuple:
    """Runs in the worker process (see raw_load_in_worker): (cold best, warm best)."""
    import time

    import numpy as np

    import maru

    evict = np.empty(min(2 * _llc_bytes(), 1 << 30), np.uint8)
    best = {True: 0.0, False: 0.0}
    with maru.Handler(cfg) as h:
        for cold in [True] * passes + [False] * passes:
            dst = [np.ones(size, np.uint8) for _ in keys]
            if cold:
                evict.fill(1)
            t = time.perf_counter()
            got = h.batch_retrieve_into(keys, dst, route_key=keys[0])
            dt = time.perf_counter() - t
            if any(n != size for n in got):
                raise RuntimeError(f"raw load: not every chunk found ({got})")
            best[cold] = max(best[cold], len(keys) * size / dt / 1e9)
    return best[True], best[False]


def _ran_on(worker: object) -> dict:
    """Runs in the worker process: what its compute ran with."""
    import torch

    maru_cores = set()  # the cores libmaru's threads may run on (its heartbeat, operations, transport)
    maru_threads = {}  # each of those threads' name and cores (to tell which one when a check fails)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith(("maru-", "soft-transport")):
                cores = os.sched_getaffinity(int(tid))
                maru_cores |= cores
                maru_threads[f"{name}/{tid}"] = sorted(cores)
        except OSError:
            continue
    return {
        "torch_threads": torch.get_num_threads(),
        "cores": sorted(os.sched_getaffinity(0)),
        "maru_thread_cores": sorted(maru_cores),
        "maru_threads": maru_threads,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "default"),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--connector", choices=("none", "maru", "example"), default="maru")
    p.add_argument("--backend", default="cxl")
    p.add_argument("--server", default="")
    p.add_argument("--key", default="", help="maru_remote_cxl_agent_key_file")
    p.add_argument("--server-key", default="", help="maru_server_key_file")
    p.add_argument("--shared", type=int, default=0, help="N requests sharing a prefix, scheduled in one step")
    p.add_argument("--shared-tokens", type=int, default=512)
    p.add_argument("--raw-load", type=int, default=0,
                   help="after the requests, N passes of a raw batch load of the prompt's stored chunks in the worker")
    p.add_argument("--engine-id", default="")
    p.add_argument("--namespace", default="e2e")
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--stats-file", default="")
    p.add_argument("--example-dir", default="")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=1030)
    p.add_argument("--prompt-seed", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=1,
                   help="run the prompt this many times (prefix caching is off: each run loads or computes again)")
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # ran_on asks the worker process itself (a function sent to it).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if a.connector == "maru":
        extra = {
            "maru_server_url": a.server,
            "maru_storage_backend": a.backend,
            "maru_engine_id": a.engine_id,
            "maru_cache_namespace": a.namespace,
            "maru_chunk_tokens": a.chunk_tokens,
        }
        # The key files and the stats file only when given (libmaru's defaults otherwise).
        given = {
            "maru_remote_cxl_agent_key_file": a.key,
            "maru_server_key_file": a.server_key,
            "maru_stats_file": a.stats_file,
        }
        extra.update((k, v) for k, v in given.items() if v)
        kw["kv_transfer_config"] = {
            "kv_connector": "MaruKVConnector",
            "kv_connector_module_path": "maru.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    elif a.connector == "example":
        kw["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": a.example_dir},
        }
    if a.shared:
        # Room for all of them in one step.
        kw["max_num_batched_tokens"] = max(4096, a.shared * a.prompt_len)
    t0 = time.monotonic()
    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        enforce_eager=True,
        max_model_len=a.max_model_len,
        enable_prefix_caching=False,
        seed=0,
        disable_log_stats=False,
        **kw,
    )
    start_s = time.monotonic() - t0
    ran_on = llm.collective_rpc(_ran_on)[0]
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(a.prompt_seed)
    prompt = [rng.randrange(2, vocab) for _ in range(a.prompt_len)]
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    # Warm-up: shorter than any chunk, so the connector neither loads nor stores.
    warm = [rng.randrange(2, vocab) for _ in range(16)]
    llm.generate([TokensPrompt(prompt_token_ids=warm)], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    if a.shared:
        # N requests with one shared prefix, in one generate call: one step schedules them.
        own = a.prompt_len - a.shared_tokens
        prompts = [prompt[: a.shared_tokens] + [rng.randrange(2, vocab) for _ in range(own)] for _ in range(a.shared)]
        outs = llm.generate([TokensPrompt(prompt_token_ids=q) for q in prompts], greedy, use_tqdm=False)
        with open(a.out, "w") as f:
            json.dump({"shared": a.shared, "prompts": prompts, "ran_on": ran_on, "start_s": start_s,
                       "num_cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
                       "tokens": list(outs[0].outputs[0].token_ids)}, f)
        return 0
    t1 = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)
    total = time.monotonic() - t1
    out = outs[0]
    m = out.metrics
    ttft = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
    ttfts = [ttft]
    for _ in range(a.repeats - 1):
        again = llm.generate([TokensPrompt(prompt_token_ids=prompt)], greedy, use_tqdm=False)[0]
        m = again.metrics
        ttfts.append(getattr(m, "first_token_latency", 0.0) if m is not None else 0.0)
    raw = warm = None
    if a.raw_load and a.connector == "maru":
        raw, warm = raw_load_in_worker(llm, a, extra, prompt)
    result = {
        "raw_load_gbs": raw,
        "raw_load_warm_gbs": warm,
        "ttfts_s": ttfts,
        "connector": a.connector,
        "backend": a.backend,
        "engine_id": a.engine_id,
        "dtype": a.dtype,
        "prompt_len": len(prompt),
        "prompt": prompt,
        "ttft_s": ttft if ttft > 0 else None,
        "total_s": total,
        "start_s": start_s,
        "ran_on": ran_on,
        "num_cached_tokens": out.num_cached_tokens or 0,
        "tokens": list(out.outputs[0].token_ids),
    }
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
