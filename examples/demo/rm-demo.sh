#!/usr/bin/env bash
# The one-host demo (resource manager stage): start maru-resource-manager on a fake
# DAX file in /dev/shm and walk a region through alloc, get-access, hold, free
# (draining while held), unhold, with maru-rm-ctl. Everything is cleaned up on exit.
# Usage: examples/demo/rm-demo.sh [DIR-WITH-BINARIES]   (default: target/debug)
set -euo pipefail
bin=${1:-target/debug}
rm_bin=$bin/maru-resource-manager
ctl_bin=$bin/maru-rm-ctl
[ -x "$rm_bin" ] && [ -x "$ctl_bin" ] || { echo "build first: cargo build --bins" >&2; exit 2; }

work=$(mktemp -d /tmp/maru-demo.XXXXXX)
pool=/dev/shm/maru-demo-pool-$$
rm_pid=
cleanup() {
    [ -n "$rm_pid" ] && kill "$rm_pid" 2>/dev/null && wait "$rm_pid" 2>/dev/null || true
    rm -rf "$work" "$pool"
}
trap cleanup EXIT

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "start maru-resource-manager on a 256 MiB fake DAX pool ($pool)"
RUST_LOG=${RUST_LOG:-warn} "$rm_bin" --state-dir "$work/state" --fake-dax "$pool:256M" \
    --port 0 --ready-file "$work/ready" &
rm_pid=$!
for _ in $(seq 1 100); do [ -s "$work/ready" ] && break; sleep 0.1; done
[ -s "$work/ready" ] || { echo "maru-resource-manager did not start" >&2; exit 1; }
export MARU_RM_ADDRESS=$(cat "$work/ready")
# The RM made its key on this first start (state dir, mode 0600): maru-rm-ctl proves it.
export MARU_RM_KEY_FILE="$work/state/rm.key"
echo "listening on $MARU_RM_ADDRESS"
ctl() { "$ctl_bin" "$@"; }

step "pools"
ctl pools

step "alloc 3 MiB as owner demo-server (rounded up to the 2 MiB alignment)"
ctl --client-id demo-server alloc 3M > "$work/region.json"
cat "$work/region.json"
handle=$(cat "$work/region.json")
region=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["handle"]["region_id"])' < "$work/region.json")

step "get-access: the handle is checked, the RM says where the bytes are"
ctl get-access --handle "$handle"

step "hold: agent on node mem0 (epoch 1) maps the region"
ctl --client-id agent-mem0 hold --handle "$handle" --node mem0 --epoch 1

step "a forged token is refused (exit status 3)"
forged=$(python3 -c 'import json,sys; h=json.load(sys.stdin)["handle"]; h["token"]="0"*32; print(json.dumps(h))' < "$work/region.json")
set +e; ctl get-access --handle "$forged"; echo "exit status $?"; set -e

step "free while held: the region drains, its range is not reused"
ctl --client-id demo-server free --handle "$handle"
ctl regions
ctl --client-id demo-server alloc 2M > "$work/second.json"
python3 -c 'import json,sys; h=json.load(sys.stdin)["handle"]; print("next allocation at offset", h["offset"], "(a different range)")' < "$work/second.json"
ctl --client-id demo-server free --handle "$(cat "$work/second.json")" >/dev/null

step "a draining region cannot be held again (refusal, exit status 3)"
set +e; ctl --client-id agent-mem1 hold --handle "$handle" --node mem1 --epoch 1; echo "exit status $?"; set -e

step "unhold: the last hold goes, the range is free"
ctl --client-id agent-mem0 unhold --region "$region" --node mem0 --epoch 1
ctl holds
ctl pools

step "stop"
kill "$rm_pid"; wait "$rm_pid" || true; rm_pid=
echo "demo finished"
