#!/usr/bin/env bash
# Step 9: take it all down, in the reverse order of a deployment: maru-server first
# (it gives its regions back while the agent and the RM still run), then the agent,
# then the RM; then anything still running in the demo's namespaces, the namespaces
# (their veths go with them), the fake DAX file and the nodes' files.
# Safe to run at any point, and more than once. MARU_MN_KEEP=1 keeps the files (logs).
set -uo pipefail
source "$(dirname "$0")/env.sh"
stop() { # node name: SIGTERM, ≤ 5 s for a clean exit, then SIGKILL
    local f pid
    f=$(mn_dir "$1")/run/$2.pid
    [ -s "$f" ] || return 0
    pid=$(cat "$f")
    if kill -TERM "$pid" 2>/dev/null; then
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null && echo "   $2 on $1 (pid $pid) did not stop in 5 s: killed"
    fi
    rm -f "$f"
}
echo "== teardown"
stop meta0 server
stop mem0 agent
stop mem0 rm
for n in "${MN_NODES[@]}" bridge; do
    ns=$MARU_MN_PREFIX-$n
    ip netns list | grep -q "^$ns\b" || continue
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
        kill -KILL "$pid" 2>/dev/null && echo "   killed pid $pid left in $ns"
    done
    ip netns del "$ns" && echo "   deleted namespace $ns"
done
rm -f "$MN_POOL"
if [ "${MARU_MN_KEEP:-0}" = 1 ]; then
    echo "   kept $MARU_MN_DIR (MARU_MN_KEEP=1)"
else
    rm -rf "$MARU_MN_DIR"
fi
