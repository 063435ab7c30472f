"""Mooncake Store's side of maru-bench's part `mooncake` (bench/src/mooncake.rs).

Two modes, both run with the Python of the Mooncake venv (mooncake-transfer-engine-non-cuda):

  serve  holds the store's memory segment (`global_segment_size`, TCP transport) in a
         client of its own, as a storage node of Mooncake does; prints one JSON line once
         mounted and stays until its stdin closes (the bench closes it, or dies).
  run    N client processes (`--clients`), each a MooncakeDistributedStore of its own with
         no segment (so every byte crosses the transfer engine's TCP to the serve process),
         run the phases in step (a barrier before each): batch put (batch_put_from, 32 new
         keys from registered buffers), single put (put_from), batch get (batch_get_into into
         registered buffers), single get (get_into), exists of a batch (batch_is_exist of 32
         stored keys). Source and destination buffers rotate over --rotate bytes per client
         (cold, as Maru's figures). Prints one JSON object: per phase the bytes, the wall
         time of the group and each operation's time.

Every wait is bounded; the client processes die with the coordinator (PR_SET_PDEATHSIG).
"""

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import signal
import sys
import time

BATCH = 32
PHASES = ["put_batch", "put_single", "get_batch", "get_single", "exists_batch"]


def die_with_parent():
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def store_setup(args, segment, local_buffer):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup(
        "127.0.0.1",
        args.metadata,
        segment,
        local_buffer,
        "tcp",
        "",
        args.master,
    )
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return s


def serve(args):
    die_with_parent()
    s = store_setup(args, args.segment, 16 << 20)
    print(json.dumps({"ready": True}), flush=True)
    # Until the bench closes our stdin (or dies: then the read ends too).
    sys.stdin.read()
    s.close()


class Rotor:
    """`size` bytes (pages touched, contents varied) handed out in `chunk` pieces."""

    def __init__(self, size, chunk, seed):
        import numpy as np

        n = max(size // chunk, 1)
        self.buf = np.empty(n * chunk, dtype=np.uint8)
        rng = np.random.default_rng(seed)
        self.buf[::64] = rng.integers(0, 256, size=len(self.buf[::64]), dtype=np.uint8)
        self.base = self.buf.ctypes.data
        self.chunk = chunk
        self.n = n
        self.next = 0

    def ptr(self):
        p = self.base + self.next * self.chunk
        self.next = (self.next + 1) % self.n
        return p


def worker(args, c, barrier, out):
    die_with_parent()
    try:
        res = worker_phases(args, c, barrier)
        out.put((c, res, None))
    except Exception as e:  # reported to the coordinator, which fails the run
        try:
            barrier.abort()
        except Exception:
            pass
        out.put((c, None, f"client {c}: {type(e).__name__}: {e}"))


def worker_phases(args, c, barrier):
    chunk = args.chunk
    s = store_setup(args, 0, 16 << 20)
    rotate = max(args.rotate, chunk * BATCH * 2)
    src = Rotor(rotate, chunk, 7 + c)
    dst = Rotor(rotate, chunk, 3)
    for r in (src, dst):
        rc = s.register_buffer(r.base, r.buf.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer returned {rc}")
    tag = f"{args.tag}-{chunk}-{c}"
    sizes = [chunk] * BATCH

    def put_batch(keys):
        rs = s.batch_put_from(keys, [src.ptr() for _ in keys], sizes[: len(keys)])
        bad = [r for r in rs if r != 0]
        if bad:
            raise RuntimeError(f"batch_put_from: {len(bad)} of {len(keys)} failed ({bad[0]})")

    def get_batch(keys):
        rs = s.batch_get_into(keys, [dst.ptr() for _ in keys], sizes[: len(keys)])
        bad = [r for r in rs if r != chunk]
        if bad:
            raise RuntimeError(f"batch_get_into: {len(bad)} of {len(keys)} short ({bad[0]})")
        return sum(rs)

    # Warm-up, not measured: connections to the segment's owner, first transfers.
    warm = [f"{tag}-w-{i}" for i in range(BATCH)]
    put_batch(warm)
    get_batch(warm)
    s.batch_remove(warm, True)

    deadline_wait = args.secs + 120.0
    bound = args.secs
    res = {}
    stored_batches = 0

    def phase(name, op, max_ops):
        barrier.wait(timeout=deadline_wait)
        lat = []
        moved = 0
        t0 = time.perf_counter()
        i = 0
        while i < max_ops and time.perf_counter() - t0 < bound:
            t = time.perf_counter()
            moved += op(i)
            lat.append((time.perf_counter() - t) * 1e6)
            i += 1
        t1 = time.perf_counter()
        res[name] = {"bytes": moved, "t0": t0, "t1": t1, "lat": lat}
        return i

    def op_put_batch(i):
        put_batch([f"{tag}-b-{i * BATCH + j}" for j in range(BATCH)])
        return BATCH * chunk

    def op_put_single(i):
        rc = s.put_from(f"{tag}-s-{i}", src.ptr(), chunk)
        if rc != 0:
            raise RuntimeError(f"put_from returned {rc}")
        return chunk

    stored_batches = phase("put_batch", op_put_batch, args.max_batches)
    phase("put_single", op_put_single, args.max_singles)
    n = max(stored_batches, 1)

    def op_get_batch(i):
        b = i % n
        return get_batch([f"{tag}-b-{b * BATCH + j}" for j in range(BATCH)])

    def op_get_single(i):
        k = i % (n * BATCH)
        got = s.get_into(f"{tag}-b-{k}", dst.ptr(), chunk)
        if got != chunk:
            raise RuntimeError(f"get_into returned {got}")
        return got

    # The keys of each batch made once, as Maru's side does: the figure times the call.
    batches = [[f"{tag}-b-{b * BATCH + j}" for j in range(BATCH)] for b in range(n)]

    def op_exists(i):
        rs = s.batch_is_exist(batches[i % n])
        if any(r != 1 for r in rs):
            raise RuntimeError("batch_is_exist: a stored key was not found")
        return 0

    phase("get_batch", op_get_batch, 1 << 60)
    phase("get_single", op_get_single, 1 << 60)
    phase("exists_batch", op_exists, 1 << 60)
    barrier.wait(timeout=deadline_wait)
    if c == 0:
        s.remove_all(True)
    for r in (src, dst):
        s.unregister_buffer(r.base)
    s.close()
    return res


def run(args):
    die_with_parent()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(args.clients)
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(args, c, barrier, out), daemon=True) for c in range(args.clients)]
    for p in procs:
        p.start()
    results = {}
    err = None
    deadline = time.monotonic() + len(PHASES) * args.secs + 180.0
    while len(results) < args.clients and err is None:
        left = deadline - time.monotonic()
        if left <= 0:
            err = "mooncake clients did not finish in time"
            break
        try:
            c, res, e = out.get(timeout=left)
        except Exception:
            err = "mooncake clients did not finish in time"
            break
        if e:
            err = e
        else:
            results[c] = res
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    if err:
        print(err, file=sys.stderr)
        sys.exit(1)
    doc = {}
    for name in PHASES:
        parts = [results[c][name] for c in range(args.clients)]
        wall = max(p["t1"] for p in parts) - min(p["t0"] for p in parts)
        lat = [x for p in parts for x in p["lat"]]
        doc[name] = {"bytes": sum(p["bytes"] for p in parts), "wall": wall, "lat": lat}
    print(json.dumps(doc))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["serve", "run"])
    ap.add_argument("--master", required=True, help="mooncake_master's RPC address, host:port")
    ap.add_argument("--metadata", required=True, help="HTTP metadata server URL")
    ap.add_argument("--segment", type=int, default=0, help="serve: segment bytes")
    ap.add_argument("--chunk", type=int, default=256 << 10)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--secs", type=float, default=1.0, help="seconds per phase")
    ap.add_argument("--rotate", type=int, default=256 << 20, help="bytes each client's buffers rotate over")
    ap.add_argument("--max-batches", type=int, default=1 << 30, help="batch puts per client at most")
    ap.add_argument("--max-singles", type=int, default=1 << 30, help="single puts per client at most")
    ap.add_argument("--tag", default="mc", help="key prefix")
    args = ap.parse_args()
    if args.mode == "serve":
        serve(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
