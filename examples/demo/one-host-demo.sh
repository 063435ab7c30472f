#!/usr/bin/env bash
# The one-host demo: a memory node (resource manager on a fake DAX file in /dev/shm,
# remote CXL agent), a metadata node (maru-server) and two engine processes on this
# host. Engine A computes a prompt's KV and stores it; engine B runs the same prompt and
# loads it instead of computing. Both backends: remote_cxl (soft transport) and cxl.
# Prints a table and stops every daemon cleanly.
# Usage: examples/demo/one-host-demo.sh [DIR-WITH-BINARIES] (default target/release)
set -euo pipefail
bin=${1:-target/release}
for b in maru-resource-manager maru-remote-cxl-agent maru-server maru-rm-ctl maru-demo-engine; do
    [ -x "$bin/$b" ] || { echo "missing $bin/$b: build first (cargo build --release --bins)" >&2; exit 2; }
done
source "$(dirname "$0")/../../scripts/daemons-lib.sh"
work=$(mktemp -d /tmp/maru-demo.XXXXXX)
pool=/dev/shm/maru-demo-pool-$$
trap 'maru_stop_all; rm -rf "$work" "$pool"' EXIT
export RUST_LOG=${RUST_LOG:-warn}
chunks=${MARU_DEMO_CHUNKS:-128}
chunk_bytes=$((1 << 20))

echo "== memory node: maru-resource-manager on a 1 GiB fake DAX pool, maru-remote-cxl-agent"
"$bin/maru-rm-ctl" gen-key "$work/agent.key" >/dev/null
maru_start "$work/rm.addr" "$bin/maru-resource-manager" --state-dir "$work/rm" --fake-dax "$pool:1G" >/dev/null
rm_addr=$(cat "$work/rm.addr")
# The RM made its key on this first start (mode 0600): its clients prove it.
rm_key="$work/rm/rm.key"
maru_start "$work/agent.addr" "$bin/maru-remote-cxl-agent" --rm-address "$rm_addr" --rm-key-file "$rm_key" \
    --key-file "$work/agent.key" --device "$pool" --node demo-mem0 >/dev/null
agent_addr=$(cat "$work/agent.addr")
echo "== metadata node: maru-server (regions of 64 MiB, 1 MiB chunks)"
# maru-server makes its own key (--key-file, 0600); the engines prove it (MARU_SERVER_KEY_FILE).
maru_start "$work/server.addr" "$bin/maru-server" --rm-address "$rm_addr" --rm-key-file "$rm_key" \
    --key-file "$work/server.key" --remote-cxl-agent "$agent_addr" \
    --remote-cxl-agent-key-file "$work/agent.key" --region-size 64M --chunk-size 1M >/dev/null
export MARU_SERVER_KEY_FILE="$work/server.key"
server=$(cat "$work/server.addr")

run_engine() { # backend engine-id
    local cfg
    cfg=$(printf '{"backend":"%s","server_url":"%s","engine_id":"%s","namespace":"demo-model","agent_key_file":"%s","load_slots":16,"store_slots":32}' \
        "$1" "$server" "$2" "$work/agent.key")
    "$bin/maru-demo-engine" --config "$cfg" --prompt "the same long system prompt ($1)" \
        --chunks "$chunks" --chunk-bytes "$chunk_bytes"
}
for backend in remote_cxl cxl; do
    echo "== $backend: engine A computes and stores $chunks chunks, engine B runs the same prompt"
    run_engine "$backend" "demo-$backend-a" > "$work/$backend-a.json"
    run_engine "$backend" "demo-$backend-b" > "$work/$backend-b.json"
done

python3 - "$work" "$chunk_bytes" <<'PY'
import json, sys
work, cb = sys.argv[1], int(sys.argv[2])
print()
print(f"{'backend':<11} {'engine':<7} {'chunks':>6} {'stored':>6} {'hits':>5} {'misses':>6} {'MiB loaded':>10} {'load GB/s':>9} {'time (s)':>9} {'checksums':>9}")
ok = True
for backend in ("remote_cxl", "cxl"):
    for eng in ("a", "b"):
        r = json.load(open(f"{work}/{backend}-{eng}.json"))
        t = r["compute_s"] if r["misses"] else r["load_s"]
        what = "computed" if r["misses"] else "loaded"
        print(f"{backend:<11} {eng.upper():<7} {r['chunks']:>6} {r['stored']:>6} {r['hits']:>5} {r['misses']:>6} "
              f"{r['bytes_loaded']/2**20:>10.1f} {r['load_gbs']:>9.2f} {t:>9.3f} {'match' if r['mismatches']==0 else 'MISMATCH':>9}  ({what})")
        ok &= r["mismatches"] == 0
    a = json.load(open(f"{work}/{backend}-a.json")); b = json.load(open(f"{work}/{backend}-b.json"))
    if b["load_s"] > 0:
        print(f"{'':<11} prefix computed in {a['compute_s']:.3f} s, loaded in {b['load_s']:.3f} s ({a['compute_s']/b['load_s']:.1f}x faster)")
    ok &= b["hits"] > 0
print()
print("demo OK: engine B found engine A's chunks and every checksum matched" if ok else "demo FAILED")
sys.exit(0 if ok else 1)
PY
