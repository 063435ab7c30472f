# Settings shared by the multi-node demo's steps (sourced, not run). Every value can
# be set in the environment before the first step; the steps must all see the same.
#
#   MARU_MN_BIN     directory with the binaries   (default target/debug of the repo)
#   MARU_MN_DIR     where each node keeps its files (default /tmp/maru-multinode)
#   MARU_MN_PREFIX  prefix of the namespaces       (default maru-mn)
#   MARU_MN_NET     first three octets of the nodes' /24 (default 10.77.0)
#
# The nodes are network namespaces joined by a bridge that lives in its own namespace,
# so nothing of the demo touches the host's interfaces, routes or firewall.

mn_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MARU_MN_BIN=${MARU_MN_BIN:-$mn_here/../../target/debug}
MARU_MN_DIR=${MARU_MN_DIR:-/tmp/maru-multinode}
MARU_MN_PREFIX=${MARU_MN_PREFIX:-maru-mn}
MARU_MN_NET=${MARU_MN_NET:-10.77.0}
export MARU_MN_BIN MARU_MN_DIR MARU_MN_PREFIX MARU_MN_NET

# node name -> last octet of its address. The bridge namespace has no address.
MN_NODES=(mem0 meta0 worker1 worker2)
declare -A MN_OCTET=([mem0]=10 [meta0]=20 [worker1]=31 [worker2]=32)
MN_BRIDGE_NS=$MARU_MN_PREFIX-bridge

mn_ns() { echo "$MARU_MN_PREFIX-$1"; }       # namespace of a node
mn_ip() { echo "$MARU_MN_NET.${MN_OCTET[$1]}"; }  # address of a node
mn_dir() { echo "$MARU_MN_DIR/$1"; }           # a node's own files (its /etc/maru, state, logs)
mn_exec() { local n=$1; shift; ip netns exec "$(mn_ns "$n")" "$@"; }

# The ports of a real deployment (the namespaces keep them apart from the host's).
MN_RM_PORT=9850
MN_AGENT_PORT=9860
MN_SERVER_PORT=5555
MN_POOL=/dev/shm/$MARU_MN_PREFIX-pool0
MN_RM_ADDR=$(mn_ip mem0):$MN_RM_PORT
MN_AGENT_ADDR=$(mn_ip mem0):$MN_AGENT_PORT
MN_SERVER_ADDR=$(mn_ip meta0):$MN_SERVER_PORT

mn_need_bin() {
    local b
    for b in "$@"; do
        [ -x "$MARU_MN_BIN/$b" ] || {
            echo "missing $MARU_MN_BIN/$b: build first (cargo build --workspace --bins) or set MARU_MN_BIN" >&2
            exit 2
        }
    done
}

# mn_start NODE NAME BINARY ARGS...: starts a daemon inside NODE's namespace, on the
# node's address, in the background; records its pid in NODE/run/NAME.pid, its log in
# NODE/log/NAME.log, waits (≤ 10 s) for its ready file and prints its address.
mn_start() {
    local node=$1 name=$2 bin=$3; shift 3
    local d; d=$(mn_dir "$node")
    mkdir -p "$d/run" "$d/log"
    rm -f "$d/run/$name.addr"
    # ip netns exec execs the daemon, so $! is the daemon's own pid.
    ip netns exec "$(mn_ns "$node")" "$MARU_MN_BIN/$bin" "$@" --ready-file "$d/run/$name.addr" \
        </dev/null >>"$d/log/$name.log" 2>&1 &
    echo $! >"$d/run/$name.pid"
    local i
    for i in $(seq 1 200); do
        if [ -s "$d/run/$name.addr" ]; then
            echo "   $name on $node listening on $(cat "$d/run/$name.addr") (pid $(cat "$d/run/$name.pid"), log $d/log/$name.log)"
            return 0
        fi
        kill -0 "$(cat "$d/run/$name.pid")" 2>/dev/null || break
        sleep 0.05
    done
    echo "$name on $node did not start; its log ($d/log/$name.log):" >&2
    tail -20 "$d/log/$name.log" >&2
    return 1
}

# mn_check_netns: fails with a clear message where network namespaces are not allowed.
mn_check_netns() {
    local probe=$MARU_MN_PREFIX-probe-$$
    if [ "$(id -u)" != 0 ]; then
        echo "the multi-node demo makes network namespaces: run it as root (ip netns needs CAP_SYS_ADMIN)" >&2
        exit 2
    fi
    command -v ip >/dev/null || { echo "the multi-node demo needs ip(8): apt-get install iproute2" >&2; exit 2; }
    if ! ip netns add "$probe" 2>/dev/null; then
        echo "ip netns is not permitted here (a container without CAP_SYS_ADMIN, or no /run/netns):" >&2
        echo "the multi-node demo cannot make its nodes; run it on a host or a privileged container" >&2
        exit 2
    fi
    ip netns del "$probe"
}
