#!/usr/bin/env bash
# Step 3: the metadata node (meta0): maru-server for the pool of mem0. It allocates
# regions from mem0's RM (with the RM key), and hands the workers the agent's address
# (--remote-cxl-agent: the address the agent listens on, as the workers reach it).
# It listens on its own address, where the workers find it (server_url), and every
# worker proves its key (server.key, made here and copied to the workers).
set -euo pipefail
source "$(dirname "$0")/env.sh"
mn_need_bin maru-server maru-rm-ctl
d=$(mn_dir meta0)
"$MARU_MN_BIN/maru-rm-ctl" gen-key "$d/etc/maru/server.key" | sed 's/^/   /'
for n in worker1 worker2; do
    install -D -m 0600 "$d/etc/maru/server.key" "$(mn_dir "$n")/etc/maru/server.key"
done
echo "== metadata node meta0 ($(mn_ip meta0)): maru-server (regions of 64 MiB, 256 KiB chunks)"
export RUST_LOG=${RUST_LOG:-warn}
mn_start meta0 server maru-server --host "$(mn_ip meta0)" --port "$MN_SERVER_PORT" \
    --rm-address "$MN_RM_ADDR" --rm-key-file "$d/etc/maru/resource-manager.key" \
    --key-file "$d/etc/maru/server.key" \
    --remote-cxl-agent "$MN_AGENT_ADDR" --remote-cxl-agent-key-file "$d/etc/maru/remote-cxl-agent.key" \
    --region-size 64M --chunk-size 256K
