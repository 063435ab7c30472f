# make bench: one benchmark program (bench/, maru-bench) that starts what it needs on
# loopback (resource manager on a fake DAX file on a 2 MiB-page tmpfs, remote CXL agent,
# maru-server, redis-server) and writes bench/results/latest.{json,md,txt,png}.
# BENCH_ARGS=--quick for a short run (a smoke test, about a quarter of the time).
# As root it drops the clean page cache and compacts memory before the pool is made, so
# the pool gets 2 MiB pages (docs/benchmarks.md).
.PHONY: bench

BENCH_ARGS ?=

# The adapters' row (part in_place) runs bench/python/adapter_row.py with the
# repository's .venv (numpy) against libmaru.so of this release build. Part mooncake
# makes its own venv outside the clone (~/.cache/maru/mooncake-venv, MARU_MOONCAKE_VENV)
# with mooncake-transfer-engine-non-cuda from PyPI at its first run, and is skipped
# (the bench goes on) when that cannot be done.
bench: deps
	CARGO_TARGET_DIR=$(TARGET_DIR) $(CARGO) build --release -p maru-bench -p maru-daemons --bins
	CARGO_TARGET_DIR=$(TARGET_DIR) $(CARGO) build --release -p maru --lib
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q numpy
	mkdir -p bench/results
	MARU_BENCH_PYTHON=$(VENV)/bin/python $(TARGET_DIR)/release/maru-bench --out bench/results $(BENCH_ARGS)

# make bench-scale: maru-server and the remote CXL agent at scale (bench/src/scale*.rs):
# simulated engines (maru-scale-sim, the wire protocol) at 10 to 4,000 sessions, 1 and 16
# tenants, 1 M to 16 M keys; the agent with 1, 64 and 256 workers; recovery of the
# durable directory. About 10 minutes on 2 cores; writes bench/results/scale.{json,md,png}.
# BENCH_SCALE_ARGS=--quick for a short run (1 M keys, up to 1,000 sessions).
.PHONY: bench-scale

BENCH_SCALE_ARGS ?=

bench-scale:
	CARGO_TARGET_DIR=$(TARGET_DIR) $(CARGO) build --release -p maru-bench -p maru-daemons --bins
	mkdir -p bench/results
	$(TARGET_DIR)/release/maru-bench --only scale --out bench/results $(BENCH_SCALE_ARGS)
