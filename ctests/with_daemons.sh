#!/usr/bin/env bash
# Runs a C test against real daemons on loopback: RM on a fake DAX file, an agent
# (remote_cxl) and maru-server, on free ports; cleans up after itself.
# Usage: with_daemons.sh BIN_DIR BACKEND TEST [ARGS...]
set -euo pipefail
bin=$1; backend=$2; shift 2
work=$(mktemp -d /tmp/maru-ctest.XXXXXX)
pool=/dev/shm/maru-ctest-$$-$RANDOM
pids=()
cleanup() {
    # Stop in reverse order (maru-server gives its regions back while agent and RM run).
    for ((i=${#pids[@]}-1; i>=0; i--)); do
        kill "${pids[$i]}" 2>/dev/null || true
        wait "${pids[$i]}" 2>/dev/null || true
    done
    rm -rf "$work" "$pool"
}
trap cleanup EXIT
wait_ready() { for _ in $(seq 1 200); do [ -s "$1" ] && return 0; sleep 0.05; done; echo "daemon did not start ($1)" >&2; exit 1; }
export RUST_LOG=${RUST_LOG:-warn}
"$bin/maru-rm-ctl" gen-key "$work/agent.key" >/dev/null
"$bin/maru-resource-manager" --state-dir "$work/rm" --fake-dax "$pool:128M" --port 0 --ready-file "$work/rm.addr" & pids+=($!)
wait_ready "$work/rm.addr"
rm_addr=$(cat "$work/rm.addr")
server_args=(--rm-address "$rm_addr" --region-size 8M --chunk-size 64K --port 0 --ready-file "$work/server.addr")
if [ "$backend" = remote_cxl ]; then
    "$bin/maru-remote-cxl-agent" --rm-address "$rm_addr" --key-file "$work/agent.key" --device "$pool" \
        --node ctest --port 0 --ready-file "$work/agent.addr" & pids+=($!)
    wait_ready "$work/agent.addr"
    server_args+=(--remote-cxl-agent "$(cat "$work/agent.addr")" --remote-cxl-agent-key-file "$work/agent.key")
fi
"$bin/maru-server" "${server_args[@]}" & pids+=($!)
wait_ready "$work/server.addr"
server=$(cat "$work/server.addr")
cfg() { printf '{"backend":"%s","server_url":"%s","engine_id":"%s","agent_key_file":"%s","load_slots":8,"store_slots":16}' "$backend" "$server" "$1" "$work/agent.key"; }
export MARU_TEST_CONFIG_A=$(cfg ctest-engine-a) MARU_TEST_CONFIG_B=$(cfg ctest-engine-b) MARU_TEST_BACKEND=$backend
"$@"
