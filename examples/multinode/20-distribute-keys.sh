#!/usr/bin/env bash
# Step 2: copy the memory node's keys to the nodes that need them, as an operator would
# with scp: the agent key to the metadata node and to every worker, the RM key to the
# metadata node only. Mode 0600 — the daemons and libmaru refuse a key file that group
# or others may read.
set -euo pipefail
source "$(dirname "$0")/env.sh"
src=$(mn_dir mem0)/etc/maru
echo "== keys: remote-cxl-agent.key -> meta0, worker1, worker2; resource-manager.key -> meta0"
for n in meta0 worker1 worker2; do
    install -D -m 0600 "$src/remote-cxl-agent.key" "$(mn_dir "$n")/etc/maru/remote-cxl-agent.key"
done
install -D -m 0600 "$src/resource-manager.key" "$(mn_dir meta0)/etc/maru/resource-manager.key"
for n in meta0 worker1 worker2; do
    (cd "$(mn_dir "$n")" && for f in etc/maru/*.key; do echo "   $n: $(stat -c '%A' "$f") $f"; done)
done
