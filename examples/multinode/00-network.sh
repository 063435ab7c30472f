#!/usr/bin/env bash
# Step 0: the network. Four nodes — a memory node (mem0), a metadata node (meta0) and
# two worker nodes (worker1, worker2) — each a network namespace with one interface
# (eth0) on its own address, all cabled to one bridge (in a namespace of its own).
set -euo pipefail
source "$(dirname "$0")/env.sh"
mn_check_netns
if ip netns list | grep -q "^$MN_BRIDGE_NS\b"; then
    echo "namespaces $MARU_MN_PREFIX-* exist already: run 90-teardown.sh first" >&2
    exit 2
fi
echo "== network: bridge $MN_BRIDGE_NS, nodes on $MARU_MN_NET.0/24"
ip netns add "$MN_BRIDGE_NS"
ip -n "$MN_BRIDGE_NS" link add br0 type bridge
ip -n "$MN_BRIDGE_NS" link set br0 up
for n in "${MN_NODES[@]}"; do
    ns=$(mn_ns "$n")
    ip netns add "$ns"
    # The cable: port-$n on the bridge, eth0 in the node.
    ip -n "$MN_BRIDGE_NS" link add "port-$n" type veth peer name eth0 netns "$ns"
    ip -n "$MN_BRIDGE_NS" link set "port-$n" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$(mn_ip "$n")/24" dev eth0
    ip -n "$ns" link set eth0 up
    echo "   $n: namespace $ns, eth0 $(mn_ip "$n")/24"
done
# Wait (≤ 5 s) until every cable is up at both ends (veths come up asynchronously).
for n in "${MN_NODES[@]}"; do
    ok=0
    for _ in $(seq 1 50); do
        if ip -n "$(mn_ns "$n")" -o link show eth0 | grep -q 'state UP' &&
            ip -n "$MN_BRIDGE_NS" -o link show "port-$n" | grep -q 'state UP'; then ok=1; break; fi
        sleep 0.1
    done
    [ "$ok" = 1 ] || { echo "the link of $n did not come up" >&2; exit 1; }
done
