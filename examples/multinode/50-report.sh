#!/usr/bin/env bash
# Step 5: what happened. The table of both engines (from their JSON lines), then the
# pool as the operator sees it from the metadata node: maru-usage against maru-server
# and the RM. Fails unless worker2 found all of worker1's prefix and every checksum
# matched.
set -euo pipefail
source "$(dirname "$0")/env.sh"
w1=$(mn_dir worker1)/run/engine.json
w2=$(mn_dir worker2)/run/engine.json
if [ -x "$MARU_MN_BIN/maru-usage" ]; then
    echo "== maru-usage on meta0 (server $MN_SERVER_ADDR, RM $MN_RM_ADDR)"
    echo "   (both engines closed: maru-server's region keeper keeps their regions with keys readable)"
    mn_exec meta0 "$MARU_MN_BIN/maru-usage" --server "$MN_SERVER_ADDR" --rm "$MN_RM_ADDR" \
        --rm-key-file "$(mn_dir meta0)/etc/maru/resource-manager.key" \
        --server-key-file "$(mn_dir meta0)/etc/maru/server.key" | sed 's/^/   /'
fi
python3 - "$w1" "$w2" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
print()
print(f"{'node':<8} {'chunks':>6} {'stored':>6} {'hits':>5} {'misses':>6} {'MiB loaded':>10} {'load GB/s':>9} {'compute s':>9} {'load s':>7} {'checksums':>9}")
for name, r in (("worker1", a), ("worker2", b)):
    print(f"{name:<8} {r['chunks']:>6} {r['stored']:>6} {r['hits']:>5} {r['misses']:>6} {r['bytes_loaded']/2**20:>10.1f} "
          f"{r['load_gbs']:>9.2f} {r['compute_s']:>9.3f} {r['load_s']:>7.3f} {'match' if r['mismatches'] == 0 else 'MISMATCH':>9}")
n = a["chunks"]
per_chunk = a["compute_s"] / max(a["misses"], 1)
if b["load_s"] > 0:
    print(f"prefix of {n} chunks: computed on worker1 in {per_chunk * n:.3f} s, loaded on worker2 from mem0 in {b['load_s']:.3f} s")
problems = []
if a["misses"] != n or a["stored"] != n:
    problems.append(f"worker1 should compute and store all {n} chunks (misses {a['misses']}, stored {a['stored']})")
if b["hits"] != n:
    problems.append(f"worker2 should find worker1's {n} prefix chunks (hits {b['hits']})")
if a["mismatches"] or b["mismatches"]:
    problems.append("a loaded chunk differs from what was stored")
print()
if problems:
    print("multi-node demo FAILED: " + "; ".join(problems))
    sys.exit(1)
print(f"multi-node demo OK: worker2 loaded worker1's {n}-chunk prefix from mem0 over remote_cxl/soft, every checksum matched")
PY
