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
connector), total_s, start_s (engine start-up).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--connector", choices=("none", "maru", "example"), default="maru")
    p.add_argument("--backend", default="cxl")
    p.add_argument("--server", default="")
    p.add_argument("--key", default="")
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
        if a.key:
            extra["maru_remote_cxl_agent_key_file"] = a.key
        if a.stats_file:
            extra["maru_stats_file"] = a.stats_file
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
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(a.prompt_seed)
    prompt = [rng.randrange(2, vocab) for _ in range(a.prompt_len)]
    greedy = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    # Warm-up: shorter than any chunk, so the connector neither loads nor stores.
    warm = [rng.randrange(2, vocab) for _ in range(16)]
    llm.generate([TokensPrompt(prompt_token_ids=warm)], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
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
    result = {
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
        "num_cached_tokens": out.num_cached_tokens or 0,
        "tokens": list(out.outputs[0].token_ids),
    }
    with open(a.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
