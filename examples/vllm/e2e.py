"""make test-vllm: real vLLM engines (CPU) sharing KV through MaruKVConnector.

Starts a resource manager (fake DAX file in /dev/shm), a remote CXL agent and
maru-server on free loopback ports, then runs each engine in its own process
(engine.py) and checks, for each backend (cxl, remote_cxl):

  A  computes a ~1,000-token prompt and stores its full chunks;
  B  (new process, another engine id) runs the same prompt: the connector loads >= 90%
     of the prompt's full chunks (vLLM's num_cached_tokens and the worker's counters),
     and B's output tokens equal A's and those of an engine without connector;
  C  runs the prompt in a namespace where the test stored noise under the prompt's
     chunk keys through the binding (maru.Handler.batch_store): C loads every
     chunk, and its output differs (the loaded KV is really used);
  D  runs the prompt with another dtype (float32): another namespace digest, no hit.

Then, once: three requests sharing a prefix of 4 chunks in one step store each chunk
once (remote_cxl); an engine whose maru-server is unreachable computes everything,
answers like the baseline and warns that it stores nothing, its log lines (libmaru's
too) in vLLM's format, each once; engines with a bad setting (maru_chunk_tokens 100, a
wrong maru_server_key_file, and a wrong agent key once libmaru proves it at open) fail
at start with a message naming it.

Every engine, the baseline without connector included, runs with the same OpenMP
threads on the same cores (VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU
set alike; vLLM would otherwise give an engine with a connector one more core): each
engine reports what its worker ran with, and the checks compare them.

Every wait is bounded; every daemon is stopped at the end, also on failure.

    python e2e.py --bin target/debug --model DIR [--backends cxl,remote_cxl]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# Starting and stopping the daemons, as the Python tests do.
sys.path.insert(0, str(ROOT / "bindings" / "python" / "tests"))
from daemon_procs import log_tail, start_ready, stop  # noqa: E402

STOP_TIMEOUT_S = 15.0
ENGINE_TIMEOUT_S = float(os.environ.get("MARU_VLLM_ENGINE_TIMEOUT_S", "600"))


class Daemons:
    """RM, agent and maru-server on loopback; stop() kills what start() started."""

    def __init__(self, bin_dir: Path, work: Path, chunk_size: str, region_size: str, pool_size: str):
        self.bin = bin_dir
        self.work = work
        self.pool = Path(f"/dev/shm/maru-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.procs: List[subprocess.Popen] = []
        self.key = work / "agent.key"
        # maru-server makes its key on first start; every engine proves it.
        self.server_key = work / "server.key"
        self.args = (chunk_size, region_size, pool_size)
        self.rm = self.agent = self.server = ""

    def start(self) -> None:
        chunk_size, region_size, pool_size = self.args
        bin_dir, work = self.bin, self.work
        subprocess.run([str(bin_dir / "maru-rm-ctl"), "gen-key", str(self.key)], check=True, capture_output=True, timeout=30)
        self.rm = self._start("maru-resource-manager", "--state-dir", str(work / "rm"), "--fake-dax", f"{self.pool}:{pool_size}")
        # The RM makes its key on first start; its clients prove it.
        rm_key = str(work / "rm" / "rm.key")
        self.agent = self._start("maru-remote-cxl-agent", "--rm-address", self.rm, "--rm-key-file", rm_key,
                                 "--key-file", str(self.key), "--device", str(self.pool), "--node", "vllm-e2e")
        self.server = self._start("maru-server", "--rm-address", self.rm, "--rm-key-file", rm_key,
                                  "--remote-cxl-agent", self.agent,
                                  "--remote-cxl-agent-key-file", str(self.key),
                                  "--key-file", str(self.server_key),
                                  "--region-size", region_size, "--chunk-size", chunk_size)
        # Handlers in this process and the engines it starts find the key here.
        os.environ["MARU_SERVER_KEY_FILE"] = str(self.server_key)

    def _start(self, name: str, *args: str) -> str:
        p, addr = start_ready([str(self.bin / name), *args], self.work / f"{name}.ready", self.work / f"{name}.log")
        self.procs.append(p)
        return addr

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop(p)
        self.procs.clear()
        self.pool.unlink(missing_ok=True)


def compute_cores() -> str:
    """The cores every engine's OpenMP threads are bound to: all this process may use
    but the first (left to vLLM's scheduler process, the daemons and Maru's threads),
    or the only one. ``MARU_VLLM_OMP_CORES`` overrides (vLLM's list syntax, ``1-3``)."""
    cores = sorted(os.sched_getaffinity(0))
    return os.environ.get("MARU_VLLM_OMP_CORES") or ",".join(map(str, cores[1:] if len(cores) > 1 else cores))


def core_set(spec: str) -> set:
    """vLLM's core list syntax (``1,3-5``) as a set."""
    out = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def threads_env() -> Dict[str, str]:
    """The same OpenMP binding for every engine: with it set, vLLM does not give an
    engine with a KV connector one more core than one without."""
    return {"VLLM_CPU_OMP_THREADS_BIND": compute_cores(), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def engine_env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bindings" / "python"), env.get("PYTHONPATH", "")]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("RUST_LOG", "warn")
    env.update(threads_env())
    # Engines name maru-server's key in their settings (maru_server_key_file).
    env.pop("MARU_SERVER_KEY_FILE", None)
    return env


def ran_on(r: Dict) -> str:
    """What an engine's worker ran with, in words (for headers and tables)."""
    o = r.get("ran_on") or {}
    cores = o.get("cores", [])
    return f"{o.get('torch_threads', '?')} thr on core{'s' if len(cores) != 1 else ''} {','.join(map(str, cores)) or '?'}"


def run_engine(work: Path, name: str, model: str, args: List[str], expect_fail: bool = False) -> Dict:
    """Runs engine.py in its own process (bounded); returns its JSON (+ worker stats).
    ``expect_fail``: the engine must fail; returns its exit code and log instead."""
    out = work / f"{name}.json"
    stats = work / f"{name}.stats.json"
    log = work / f"{name}.log"
    cmd = [sys.executable, str(HERE / "engine.py"), "--model", model, "--out", str(out), "--stats-file", str(stats), *args]
    t0 = time.monotonic()
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=engine_env(), start_new_session=True)
        try:
            rc = p.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=STOP_TIMEOUT_S)
            raise RuntimeError(f"engine {name} did not finish within {ENGINE_TIMEOUT_S:.0f} s:\n{log_tail(log, 4000)}")
        finally:
            # vLLM's engine-core and worker processes are in the engine's session.
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if expect_fail:
        if rc == 0:
            raise RuntimeError(f"engine {name} was expected to fail but exited 0")
        print(f"  {name:<18} {time.monotonic() - t0:5.1f} s  failed at start as expected (exit {rc})", flush=True)
        return {"rc": rc, "log": log.read_text(errors="replace")}
    if rc != 0 or not out.exists():
        raise RuntimeError(f"engine {name} failed (exit {rc}):\n{log_tail(log, 4000)}")
    r = json.loads(out.read_text())
    r["stats"] = json.loads(stats.read_text()) if stats.exists() else {}
    r["wall_s"] = time.monotonic() - t0
    r["log"] = log
    print(f"  {name:<18} {r['wall_s']:5.1f} s  {ran_on(r)}  cached tokens {r['num_cached_tokens']:>5}  "
          f"chunks loaded {r['stats'].get('chunks_loaded', '-')!s:>3}  stored {r['stats'].get('chunks_stored', '-')!s:>3}  "
          f"first tokens {r['tokens'][:6]}", flush=True)
    return r


def store_noise(backend: str, server: str, key: str, server_key: str, namespace: str, digest: str, chunk_tokens: int,
                chunk_bytes: int, prompt: List[int]) -> int:
    """Stores random KV under the prompt's chunk keys in ``namespace`` through the binding."""
    import torch

    import maru
    from maru.vllm import keyspace

    cfg = {"backend": backend, "server_url": server, "engine_id": f"{backend}-noise-writer",
           "namespace": namespace, "layout": digest, "agent_key_file": key, "server_key_file": server_key}
    keys = maru.chunk_keys(prompt, chunk_tokens, keyspace(namespace, digest, 0))
    g = torch.Generator().manual_seed(7)
    items = []
    for k in keys:
        noise = torch.randn(chunk_bytes // 2, generator=g).to(torch.bfloat16)
        items.append((k, noise.view(torch.uint8).numpy().tobytes()))
    with maru.Handler(cfg) as h:
        ok = h.batch_store(items, route_key=keys[0])
    return sum(ok)


# vLLM's log format: "(EngineCore pid=12) WARNING 12-05 02:13:43 [where:line] message".
VLLM_LINE = re.compile(r"^\((?P<proc>[^)]*?) pid=(?P<pid>\d+)\) (?P<level>[A-Z]+) (?P<time>\d\d-\d\d \d\d:\d\d:\d\d) "
                       r"\[(?P<where>[^\]]+)\] (?P<msg>.*)$")


def check_logs(check: "Check", text: str) -> None:
    """The lines of an engine whose maru-server is unreachable: libmaru's (the pool
    unavailable at open) and the connector's (lookups miss, chunks not stored) come out
    in vLLM's format with the process named, each event once."""
    lines = [ln.strip() for ln in text.splitlines()]
    lib = [ln for ln in lines if "127.0.0.1:1" in ln and "unavailable" in ln and "[maru::" in ln]
    parsed = [VLLM_LINE.match(ln) for ln in lib]
    check(bool(lib) and all(m is not None and m["level"] == "WARNING" for m in parsed),
          f"libmaru's lines in vLLM's format, level and process named ({len(lib)} lines, e.g. {lib[:1]})")
    seen = [(m["pid"], m["time"], m["msg"]) for m in parsed if m is not None]
    check(len(seen) == len(set(seen)), "each libmaru line once (no line twice in one process at one time)")
    skipped = [VLLM_LINE.match(ln) for ln in lines if "chunks not stored" in ln]
    check(any(m is not None and m["level"] == "WARNING" and "maru-server unreachable" in m["msg"] for m in skipped),
          "stores skipped while maru-server is unreachable are warned (vLLM's format)")


class Check:
    def __init__(self) -> None:
        self.failed: List[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
        if not ok:
            self.failed.append(what)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bin", default=str(ROOT / "target" / "debug"))
    p.add_argument("--model", required=True)
    p.add_argument("--backends", default="cxl,remote_cxl")
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=1030)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    a = p.parse_args()
    lib = Path(a.bin) / "libmaru.so"
    if lib.exists():
        os.environ.setdefault("MARU_LIB", str(lib))
    sys.path.insert(0, str(ROOT / "bindings" / "python"))
    work = Path(tempfile.mkdtemp(prefix="maru-vllm-e2e-"))
    check = Check()
    common = ["--chunk-tokens", str(a.chunk_tokens), "--prompt-len", str(a.prompt_len), "--max-tokens", "16"]
    full_chunks = (a.prompt_len - 1) // a.chunk_tokens  # chunks a lookup can match
    t_start = time.monotonic()
    daemons = Daemons(Path(a.bin), work, chunk_size="1M", region_size="64M", pool_size="1G")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        daemons.start()
        print(f"daemons: RM {daemons.rm}, agent {daemons.agent}, maru-server {daemons.server}; work dir {work}")
        t = threads_env()
        print(f"every engine: OpenMP threads bound to core(s) {t['VLLM_CPU_OMP_THREADS_BIND']} "
              f"(VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU={t['VLLM_CPU_NUM_OF_RESERVED_CPU']})")
        base = run_engine(work, "baseline", a.model, ["--connector", "none", *common])
        keys = ["--server", daemons.server, "--key", str(daemons.key), "--server-key", str(daemons.server_key)]
        for backend in a.backends.split(","):
            print(f"== {backend}")
            mk = ["--connector", "maru", "--backend", backend, *keys, *common]
            ra = run_engine(work, f"{backend}-A", a.model, [*mk, "--engine-id", f"{backend}-A", "--namespace", "e2e"])
            libmaru = ("maru_thread_cores", "maru_threads")
            same = {k: v for k, v in ra["ran_on"].items() if k not in libmaru}
            check(same == {k: v for k, v in base["ran_on"].items() if k not in libmaru},
                  f"{backend}: A ran with the baseline's threads and cores ({ran_on(ra)}; baseline {ran_on(base)})")
            off = set(ra["ran_on"].get("maru_thread_cores", []))
            compute = set(ra["ran_on"].get("cores", []))
            check(bool(off) and (not off & compute or off == compute == set(os.sched_getaffinity(0))),
                  f"{backend}: libmaru's threads in A's worker run off its compute cores ({sorted(off)}, compute {sorted(compute)}"
                  + (f"; {ra['ran_on'].get('maru_threads')})" if off & compute else ")"))
            check(ra["num_cached_tokens"] == 0, f"{backend}: A computed the whole prompt (no hit in an empty cache)")
            check(ra["stats"].get("chunks_stored", 0) == a.prompt_len // a.chunk_tokens,
                  f"{backend}: A stored all {a.prompt_len // a.chunk_tokens} full chunks ({ra['stats'].get('chunks_stored')})")
            rb = run_engine(work, f"{backend}-B", a.model, [*mk, "--engine-id", f"{backend}-B", "--namespace", "e2e"])
            loaded = rb["stats"].get("chunks_loaded", 0)
            check(loaded >= 0.9 * full_chunks and rb["num_cached_tokens"] == loaded * a.chunk_tokens,
                  f"{backend}: B loaded {loaded} of {full_chunks} chunks, vLLM counts {rb['num_cached_tokens']} external tokens")
            check(rb["stats"].get("chunks_load_failed", 1) == 0, f"{backend}: B had no failed chunk load")
            check(rb["stats"].get("chunks_stored", 1) == 0, f"{backend}: B stored nothing (never re-stores loaded chunks)")
            check(rb["tokens"] == ra["tokens"] == base["tokens"] and rb["ran_on"]["cores"] == base["ran_on"]["cores"]
                  and rb["ran_on"]["torch_threads"] == base["ran_on"]["torch_threads"],
                  f"{backend}: B's output tokens equal A's and the no-connector baseline's, with the same threads")
            st = rb["stats"]
            n = store_noise(backend, daemons.server, str(daemons.key), str(daemons.server_key), "e2e-noise",
                            st["digest"], st["chunk_tokens"], st["chunk_bytes"], rb["prompt"])
            check(n == a.prompt_len // a.chunk_tokens, f"{backend}: stored noise under the prompt's {n} chunk keys (binding)")
            rc = run_engine(work, f"{backend}-C-noise", a.model,
                            [*mk, "--engine-id", f"{backend}-C", "--namespace", "e2e-noise"])
            check(rc["stats"].get("chunks_loaded", 0) == full_chunks, f"{backend}: C loaded the {full_chunks} noise chunks")
            check(rc["tokens"] != ra["tokens"], f"{backend}: C's output differs from A's (the loaded KV is used)")
            rd = run_engine(work, f"{backend}-D-float32", a.model,
                            [*mk, "--engine-id", f"{backend}-D", "--namespace", "e2e", "--dtype", "float32"])
            check(rd["num_cached_tokens"] == 0 and rd["stats"].get("chunks_loaded", 0) == 0,
                  f"{backend}: D (float32, another namespace digest) found nothing")
            check(rd["stats"].get("digest") != st["digest"], f"{backend}: D's digest differs from B's")
        print("== one store per chunk per step")
        shared_backend = "remote_cxl" if "remote_cxl" in a.backends.split(",") else a.backends.split(",")[0]
        shared_tokens = 4 * a.chunk_tokens
        rs = run_engine(work, "S-shared-prefix", a.model,
                        ["--connector", "maru", "--backend", shared_backend, *keys, *common, "--engine-id", "S",
                         "--namespace", "e2e-shared", "--shared", "3", "--shared-tokens", str(shared_tokens)])
        distinct = 4 + 3 * (a.prompt_len // a.chunk_tokens - 4)
        sst = rs["stats"]
        check(sst.get("chunks_store_submitted") == distinct and sst.get("chunks_stored") == distinct,
              f"{shared_backend}: 3 requests sharing 4 chunks in one step: each of the {distinct} distinct chunks "
              f"stored once (submitted {sst.get('chunks_store_submitted')}, stored {sst.get('chunks_stored')})")
        print("== error paths")
        mk = ["--connector", "maru", "--backend", "cxl", "--key", str(daemons.key),
              "--server-key", str(daemons.server_key), *common]
        re_ = run_engine(work, "E-no-server", a.model, [*mk, "--server", "127.0.0.1:1", "--engine-id", "E"])
        check(re_["num_cached_tokens"] == 0 and re_["tokens"] == base["tokens"],
              "an unreachable maru-server means misses: E computed everything, same output as the baseline")
        check_logs(check, re_["log"].read_text(errors="replace"))
        rf = run_engine(work, "F-bad-setting", a.model,
                        [*mk, "--server", daemons.server, "--engine-id", "F", "--chunk-tokens", "100"], expect_fail=True)
        check("maru_chunk_tokens 100 is not a multiple of vLLM's block size" in rf["log"],
              "a bad setting (maru_chunk_tokens 100) stops the engine at start with a message naming it")
        wrong = work / "wrong.key"
        subprocess.run([str(Path(a.bin) / "maru-rm-ctl"), "gen-key", str(wrong)], check=True, capture_output=True, timeout=30)
        mk_g = [a_ if a_ != str(daemons.server_key) else str(wrong) for a_ in mk]
        rg = run_engine(work, "G-wrong-server-key", a.model,
                        [*mk_g, "--server", daemons.server, "--engine-id", "G"], expect_fail=True)
        check(f"maru_server_key_file is {str(wrong)!r}" in rg["log"] and "maru-server" in rg["log"],
              "a wrong maru_server_key_file stops the engine at start with a message naming it")
        import maru

        if hasattr(maru, "AuthError") and "remote_cxl" in a.backends.split(","):
            mk_h = ["--connector", "maru", "--backend", "remote_cxl", "--key", str(wrong),
                    "--server-key", str(daemons.server_key), "--server", daemons.server, *common]
            rh = run_engine(work, "H-wrong-agent-key", a.model, [*mk_h, "--engine-id", "H"], expect_fail=True)
            check(f"maru_remote_cxl_agent_key_file is {str(wrong)!r}" in rh["log"],
                  "remote_cxl: a wrong agent key stops the engine at start with a message naming the setting")
        else:
            print("  (a wrong agent key: this libmaru proves it at the first store, not at open; not checked)")
    except Exception as e:  # noqa: BLE001 - report and fail
        check(False, f"error: {e}")
    finally:
        daemons.stop()
        if a.keep or check.failed:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"test-vllm: {'FAILED: ' + '; '.join(check.failed) if check.failed else 'all checks passed'} "
          f"({time.monotonic() - t_start:.0f} s)")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
