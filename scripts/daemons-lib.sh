# Shell helpers for scripts that start Maru daemons on loopback (sourced, not run):
# the demo, the examples and the C tests. Daemons listen on free ports (--port 0) and
# report their address in a ready file; `maru_stop_all` stops them in reverse order, so
# maru-server gives its regions back while the agent and the RM still run.
maru_pids=()

# maru_need_built HOW FILE...: exits 2, naming the first FILE that does not exist and
# HOW to build it.
maru_need_built() {
    local how=$1 f; shift
    for f in "$@"; do
        [ -e "$f" ] || { echo "missing $f: build first ($how)" >&2; exit 2; }
    done
}

# maru_scratch NAME: a scratch directory $work (/tmp/NAME.XXXXXX) and the path $pool
# (/dev/shm/NAME-PID) for a fake DAX file; on exit every daemon stops and both go.
maru_scratch() {
    work=$(mktemp -d "/tmp/$1.XXXXXX")
    pool=/dev/shm/$1-$$
    trap 'maru_stop_all; rm -rf "$work" "$pool"' EXIT
}

# maru_start READY-FILE BINARY ARGS...: starts a daemon in the background, waits (≤ 10 s)
# until it listens, and prints its address. Call it directly, not in $(...): a subshell
# would lose the pid that maru_stop_all needs (read the address from READY-FILE).
maru_start() {
    local ready=$1; shift
    "$@" --port 0 --ready-file "$ready" &
    maru_pids+=($!)
    for _ in $(seq 1 200); do
        [ -s "$ready" ] && { cat "$ready"; return 0; }
        sleep 0.05
    done
    echo "$1 did not start; rerun with RUST_LOG=info" >&2
    return 1
}

# maru_start_one_host BIN WORK POOL: a memory node (RM on the fake DAX file POOL of 256M,
# an agent, node example-mem0) and maru-server (16M regions, 256K chunks) on loopback,
# from the binaries in BIN. Their addresses go to WORK/{rm,agent,server}.addr; the agent
# key is WORK/agent.key (made here), maru-server's WORK/server.key (made at its start).
maru_start_one_host() {
    local bin=$1 work=$2 pool=$3
    "$bin/maru-rm-ctl" gen-key "$work/agent.key" >/dev/null
    maru_start "$work/rm.addr" "$bin/maru-resource-manager" --state-dir "$work/rm" --fake-dax "$pool:256M" >/dev/null
    maru_start "$work/agent.addr" "$bin/maru-remote-cxl-agent" --rm-address "$(cat "$work/rm.addr")" --rm-key-file "$work/rm/rm.key" \
        --key-file "$work/agent.key" --device "$pool" --node example-mem0 >/dev/null
    maru_start "$work/server.addr" "$bin/maru-server" --rm-address "$(cat "$work/rm.addr")" --rm-key-file "$work/rm/rm.key" \
        --remote-cxl-agent "$(cat "$work/agent.addr")" --remote-cxl-agent-key-file "$work/agent.key" \
        --key-file "$work/server.key" --region-size 16M --chunk-size 256K >/dev/null
}

maru_stop_all() {
    local i
    for ((i=${#maru_pids[@]}-1; i>=0; i--)); do
        kill "${maru_pids[$i]}" 2>/dev/null || true
        wait "${maru_pids[$i]}" 2>/dev/null || true
    done
    maru_pids=()
}
