#!/usr/bin/env bash
# Installs the Maru daemons, their systemd units, env files and the agent key.
#   scripts/install.sh [--root DIR] [--standalone | --metadata] [--bin-dir DIR]
# --root DIR     install under DIR instead of / (for packaging and tests)
# --standalone   the agent's unit starts at boot on its own (node without an RM)
# --metadata     the metadata node instead: maru-server (its unit and env file) and
#                maru-usage; the agent key is copied there from a memory node
# Env files and the key are written once and kept across reinstalls.
set -euo pipefail
root=
standalone=0
metadata=0
bin_dir=target/release
while [ $# -gt 0 ]; do
    case "$1" in
        --root) root=$2; shift 2 ;;
        --standalone) standalone=1; shift ;;
        --metadata) metadata=1; shift ;;
        --bin-dir) bin_dir=$2; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
here=$(cd "$(dirname "$0")/.." && pwd)
if [ "$metadata" = 1 ] && [ "$standalone" = 1 ]; then
    echo "install.sh: --metadata and --standalone are different nodes; pick one" >&2
    exit 2
fi

new_key() { # path what: a random key file, mode 0600, written once
    if [ -e "$1" ]; then
        echo "kept $1"
    else
        (umask 077; { echo "# maru shared key (keep mode 0600)"; od -An -tx1 -N32 /dev/urandom | tr -d ' \n'; echo; } > "$1")
        echo "wrote $1 (mode 0600): $2"
    fi
}
write_once() { # path mode content
    if [ -e "$1" ]; then echo "kept $1"; else printf '%s\n' "$3" > "$1"; chmod "$2" "$1"; echo "wrote $1"; fi
}
add_user() {
    id maru >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin maru
}

if [ "$metadata" = 1 ]; then
    for b in maru-server maru-usage; do
        [ -x "$bin_dir/$b" ] || { echo "install.sh: $bin_dir/$b not built; run make release first" >&2; exit 2; }
    done
    install -d "$root/usr/local/bin" "$root/etc/systemd/system" "$root/etc/maru"
    chmod 0755 "$root/etc/maru"
    for b in maru-server maru-usage; do
        install -m 0755 "$bin_dir/$b" "$root/usr/local/bin/$b"
    done
    install -m 0644 "$here/daemons/systemd/maru-server.service" "$root/etc/systemd/system/"
    write_once "$root/etc/maru/server.env" 0644 "# maru-server settings (kept across reinstalls)
# Listen address: workers reach it here (plaintext: loopback or a trusted network).
MARU_SERVER_HOST=127.0.0.1
MARU_SERVER_PORT=5555
# The pool's resource manager and its key, copied from the RM's node (mode 0600, owner maru).
MARU_RM_ADDRESS=127.0.0.1:9850
MARU_RM_KEY_FILE=/etc/maru/resource-manager.key
# The key workers prove to this server (written by make install; give it to the
# workers, which name it in MARU_SERVER_KEY_FILE).
MARU_SERVER_KEY_FILE=/etc/maru/server.key
# The agent key, copied from a memory node (mode 0600, owned by maru).
MARU_REMOTE_CXL_AGENT_KEY_FILE=/etc/maru/remote-cxl-agent.key
# One --remote-cxl-agent HOST:PORT per memory node of the pool (none: cxl workers only).
MARU_SERVER_ARGS=--remote-cxl-agent 127.0.0.1:9860 --region-size 1G --chunk-size 4M"
    key=$root/etc/maru/remote-cxl-agent.key
    [ -e "$key" ] || echo "install.sh: copy the agent key from a memory node to /etc/maru/remote-cxl-agent.key (mode 0600, owner maru) before starting maru-server"
    [ -e "$root/etc/maru/resource-manager.key" ] || echo "install.sh: copy the RM key from the memory node to /etc/maru/resource-manager.key (mode 0600, owner maru) before starting maru-server"
    new_key "$root/etc/maru/server.key" "copy it to the workers (MARU_SERVER_KEY_FILE)"
    if [ -z "$root" ]; then
        add_user
        [ -e "$key" ] && chown maru:maru "$key"
        chown maru:maru "$root/etc/maru/server.key"
        [ -e "$root/etc/maru/resource-manager.key" ] && chown maru:maru "$root/etc/maru/resource-manager.key"
        if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
            systemctl daemon-reload
            systemctl enable maru-server.service || true
        fi
    fi
    echo "installed the metadata node (maru-server.service, /etc/maru/server.env)"
    exit 0
fi

for b in maru-resource-manager maru-rm-ctl maru-remote-cxl-agent; do
    [ -x "$bin_dir/$b" ] || { echo "install.sh: $bin_dir/$b not built; run make release first" >&2; exit 2; }
done

install -d "$root/usr/local/bin" "$root/etc/systemd/system" "$root/etc/maru"
chmod 0755 "$root/etc/maru"
for b in maru-resource-manager maru-rm-ctl maru-remote-cxl-agent; do
    install -m 0755 "$bin_dir/$b" "$root/usr/local/bin/$b"
done
install -m 0644 "$here/daemons/systemd/maru-resource-manager.service" "$root/etc/systemd/system/"
unit=maru-remote-cxl-agent.service
src=$here/daemons/systemd/maru-remote-cxl-agent.service
[ "$standalone" = 1 ] && src=$here/daemons/systemd/maru-remote-cxl-agent-standalone.service
install -m 0644 "$src" "$root/etc/systemd/system/$unit"

write_once "$root/etc/maru/resource-manager.env" 0644 "# maru-resource-manager settings (kept across reinstalls)
MARU_RM_HOST=127.0.0.1
MARU_RM_PORT=9850
MARU_RM_STATE_DIR=/var/lib/maru-rm
# The key every client proves (written by make install; copy it to maru-server and
# standalone agents). Running without one needs --insecure-no-key.
MARU_RM_KEY_FILE=/etc/maru/resource-manager.key
# Pools: --dax /dev/daxX.Y (repeat) or --fake-dax PATH:SIZE
MARU_RM_ARGS=--dax /dev/dax0.0"
rm_addr=127.0.0.1:9850
[ "$standalone" = 1 ] && rm_addr=
write_once "$root/etc/maru/remote-cxl-agent.env" 0644 "# maru-remote-cxl-agent settings (kept across reinstalls)
# The pool's resource manager (required; empty refuses to start).
MARU_RM_ADDRESS=$rm_addr
# Bind address: the address workers reach (the RDMA NIC's for verbs).
MARU_REMOTE_CXL_AGENT_HOST=127.0.0.1
MARU_REMOTE_CXL_AGENT_PORT=9860
MARU_REMOTE_CXL_AGENT_KEY_FILE=/etc/maru/remote-cxl-agent.key
# The RM's key (on a standalone node: copied from the RM's node).
MARU_RM_KEY_FILE=/etc/maru/resource-manager.key
MARU_TRANSPORT=soft
MARU_AGENT_ARGS=--device /dev/dax0.0"

key=$root/etc/maru/remote-cxl-agent.key
new_key "$key" "copy it to maru-server and the workers"
rm_key=$root/etc/maru/resource-manager.key
if [ "$standalone" = 1 ]; then
    [ -e "$rm_key" ] || echo "install.sh: copy the RM key from the RM's node to /etc/maru/resource-manager.key (mode 0600, owner maru) before starting the agent"
else
    new_key "$rm_key" "copy it to maru-server and standalone agents of this pool"
fi
if [ -z "$root" ]; then
    add_user
    chown maru:maru "$key"
    [ -e "$rm_key" ] && chown maru:maru "$rm_key"
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl daemon-reload
        # Disable first so a switch between the bound and the standalone form leaves no old links.
        systemctl disable "$unit" >/dev/null 2>&1 || true
        systemctl enable maru-resource-manager.service "$unit" || true
    fi
fi
echo "installed (agent unit: $([ "$standalone" = 1 ] && echo standalone || echo bound to the resource manager))"
