#!/usr/bin/env bash
# Step 1: the memory node (mem0). It owns the CXL memory — here a 512 MiB fake DAX file
# in /dev/shm; on real hardware --dax /dev/dax0.0. Its keys are made here:
#   remote-cxl-agent.key  proves every connection to the agent (both ways): maru-server
#                         and every worker get a copy (step 2).
#   resource-manager.key  proves connections to the RM: the agent here and maru-server.
# The RM and the agent listen on the node's own address (not 127.0.0.1), since
# maru-server and the workers reach them over the network; the agent advertises that
# address for its data (soft NIC) port too.
set -euo pipefail
source "$(dirname "$0")/env.sh"
mn_need_bin maru-resource-manager maru-remote-cxl-agent maru-rm-ctl
d=$(mn_dir mem0)
ip=$(mn_ip mem0)
mkdir -p "$d/etc/maru" "$d/var/lib"
echo "== memory node mem0 ($ip): keys, maru-resource-manager, maru-remote-cxl-agent"
"$MARU_MN_BIN/maru-rm-ctl" gen-key "$d/etc/maru/remote-cxl-agent.key" | sed 's/^/   /'
"$MARU_MN_BIN/maru-rm-ctl" gen-key "$d/etc/maru/resource-manager.key" | sed 's/^/   /'
export RUST_LOG=${RUST_LOG:-warn}
mn_start mem0 rm maru-resource-manager --host "$ip" --port "$MN_RM_PORT" \
    --key-file "$d/etc/maru/resource-manager.key" \
    --state-dir "$d/var/lib/maru-rm" --fake-dax "$MN_POOL:512M"
mn_start mem0 agent maru-remote-cxl-agent --host "$ip" --port "$MN_AGENT_PORT" --advertise "$ip" \
    --rm-address "$MN_RM_ADDR" --rm-key-file "$d/etc/maru/resource-manager.key" \
    --key-file "$d/etc/maru/remote-cxl-agent.key" --device "$MN_POOL" --node mem0 --transport soft
