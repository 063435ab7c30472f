#!/usr/bin/env bash
# Step 4: the worker nodes. Each runs one engine (maru-demo-engine: libmaru's handler,
# backend remote_cxl over the soft transport) with only the metadata node's address, its
# key (MARU_SERVER_KEY_FILE) and the agent key. worker1 runs a prompt of N chunks: every chunk misses, is computed and
# stored in mem0's CXL memory. worker2 runs a prompt that shares those N chunks as its
# prefix and adds N more: the prefix is loaded from mem0 (checksums checked against
# what worker2 would have computed), the rest computed and stored.
# Usage: 40-workers.sh [N] (default 64, or MARU_MN_CHUNKS)
set -euo pipefail
source "$(dirname "$0")/env.sh"
mn_need_bin maru-demo-engine
chunks=${1:-${MARU_MN_CHUNKS:-64}}
[[ $chunks =~ ^[1-9][0-9]*$ ]] || { echo "40-workers.sh: N must be a positive number of chunks, not '$chunks'" >&2; exit 2; }
prompt="the system prompt both workers share"
run_engine() { # node engine-id chunks
    local d cfg
    d=$(mn_dir "$1")
    mkdir -p "$d/run"
    cfg=$(printf '{"backend":"remote_cxl","transport":"soft","server_url":"%s","engine_id":"%s","namespace":"demo-model","layout":"demo-256KiB","agent_key_file":"%s","load_slots":16,"store_slots":32}' \
        "$MN_SERVER_ADDR" "$2" "$d/etc/maru/remote-cxl-agent.key")
    echo "   $1 ($(mn_ip "$1")): engine $2, $3 chunks, server_url $MN_SERVER_ADDR"
    RUST_LOG=${RUST_LOG:-warn} MARU_SERVER_KEY_FILE="$d/etc/maru/server.key" mn_exec "$1" timeout 120 "$MARU_MN_BIN/maru-demo-engine" --config "$cfg" \
        --prompt "$prompt" --chunks "$3" --chunk-bytes $((256 << 10)) --compute-rounds 2 >"$d/run/engine.json"
}
echo "== worker nodes: worker1 computes and stores the prefix, worker2 shares it"
run_engine worker1 engine-w1 "$chunks"
run_engine worker2 engine-w2 $((2 * chunks))
