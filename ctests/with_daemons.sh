#!/usr/bin/env bash
# Runs a C test against real daemons on loopback: RM on a fake DAX file, an agent
# (remote_cxl) and maru-server, on free ports; cleans up after itself.
# Usage: with_daemons.sh BIN_DIR BACKEND POOLS TEST [ARGS...]
# POOLS is 1 or 2 (two maru-servers on the same RM and agent: server_url lists both).
# maru-server requires its key (server_key_file in MARU_TEST_CONFIG_*); another key is
# in MARU_TEST_WRONG_KEY.
set -euo pipefail
bin=$1; backend=$2; pools=$3; shift 3
case $pools in 1|2) ;; *) echo "POOLS must be 1 or 2, not $pools" >&2; exit 2;; esac
source "$(dirname "$0")/../scripts/daemons-lib.sh"
work=$(mktemp -d /tmp/maru-ctest.XXXXXX)
pool=/dev/shm/maru-ctest-$$-$RANDOM
trap 'maru_stop_all; rm -rf "$work" "$pool"' EXIT
export RUST_LOG=${RUST_LOG:-warn}
"$bin/maru-rm-ctl" gen-key "$work/agent.key" >/dev/null
maru_start "$work/rm.addr" "$bin/maru-resource-manager" --state-dir "$work/rm" --fake-dax "$pool:128M" >/dev/null
rm_addr=$(cat "$work/rm.addr")
# maru-server makes its key on first start (both servers share it); the engines prove it
# (server_key_file in their configuration). MARU_TEST_WRONG_KEY is another key, for the
# tests of refused proofs.
server_args=(--rm-address "$rm_addr" --rm-key-file "$work/rm/rm.key" --key-file "$work/server.key" --region-size 8M --chunk-size 64K)
"$bin/maru-rm-ctl" gen-key "$work/wrong.key" >/dev/null
export MARU_TEST_WRONG_KEY=$work/wrong.key
if [ "$backend" = remote_cxl ]; then
    maru_start "$work/agent.addr" "$bin/maru-remote-cxl-agent" --rm-address "$rm_addr" --rm-key-file "$work/rm/rm.key" \
        --key-file "$work/agent.key" --device "$pool" --node ctest >/dev/null
    server_args+=(--remote-cxl-agent "$(cat "$work/agent.addr")" --remote-cxl-agent-key-file "$work/agent.key")
fi
maru_start "$work/server.addr" "$bin/maru-server" "${server_args[@]}" --state-dir "$work/server-state" >/dev/null
server=$(cat "$work/server.addr")
if [ "$pools" = 2 ]; then
    # Each server keeps its own directory (one server per state directory).
    maru_start "$work/server2.addr" "$bin/maru-server" "${server_args[@]}" --state-dir "$work/server2-state" >/dev/null
    server="$server,$(cat "$work/server2.addr")"
fi
cfg() { printf '{"backend":"%s","server_url":"%s","server_key_file":"%s","engine_id":"%s","agent_key_file":"%s","load_slots":8,"store_slots":16}' "$backend" "$server" "$work/server.key" "$1" "$work/agent.key"; }
export MARU_TEST_CONFIG_A=$(cfg ctest-engine-a) MARU_TEST_CONFIG_B=$(cfg ctest-engine-b) MARU_TEST_BACKEND=$backend MARU_TEST_POOLS=$pools
"$@"
