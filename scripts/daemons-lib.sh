# Shell helpers for scripts that start Maru daemons on loopback (sourced, not run):
# the demo and the C tests. Daemons listen on free ports (--port 0) and report their
# address in a ready file; `maru_stop_all` stops them in reverse order, so maru-server
# gives its regions back while the agent and the RM still run.
maru_pids=()

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

maru_stop_all() {
    local i
    for ((i=${#maru_pids[@]}-1; i>=0; i--)); do
        kill "${maru_pids[$i]}" 2>/dev/null || true
        wait "${maru_pids[$i]}" 2>/dev/null || true
    done
    maru_pids=()
}
