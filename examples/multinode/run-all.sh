#!/usr/bin/env bash
# The multi-node demo, every step in order (make demo-multinode): network namespaces
# for a memory node, a metadata node and two worker nodes; keys made on the memory node
# and copied to the others; engines on the two workers share a prefix over remote_cxl
# (soft transport); the table; then everything torn down, also on failure or Ctrl-C.
# Usage: examples/multinode/run-all.sh [DIR-WITH-BINARIES] (default target/debug)
# Runs as root. Each run has its own namespaces and files (MARU_MN_PREFIX, MARU_MN_DIR).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ -n "${1:-}" ] && export MARU_MN_BIN=$1
export MARU_MN_PREFIX=${MARU_MN_PREFIX:-maru-mn$$}
given_dir=${MARU_MN_DIR:-}
source "$here/env.sh"
mn_need_bin maru-resource-manager maru-remote-cxl-agent maru-server maru-rm-ctl maru-demo-engine
mn_check_netns
# The nodes' files: a fresh private directory unless MARU_MN_DIR names one.
if [ -z "$given_dir" ]; then
    MARU_MN_DIR=$(mktemp -d /tmp/maru-multinode.XXXXXX)
    export MARU_MN_DIR
fi
status=0
on_exit() {
    status=$?
    if [ "$status" != 0 ]; then
        echo "== failed (status $status); last lines of the daemons' logs:" >&2
        for f in "$MARU_MN_DIR"/*/log/*.log; do
            [ -s "$f" ] && { echo "-- $f" >&2; tail -15 "$f" >&2; }
        done
    fi
    "$here/90-teardown.sh"
    exit "$status"
}
trap on_exit EXIT
trap 'exit 130' INT TERM
start=$(date +%s)
"$here/00-network.sh"
"$here/10-memory-node.sh"
"$here/20-distribute-keys.sh"
"$here/30-metadata-node.sh"
"$here/40-workers.sh" "${MARU_MN_CHUNKS:-64}"
"$here/50-report.sh"
echo "(ran in $(( $(date +%s) - start )) s)"
