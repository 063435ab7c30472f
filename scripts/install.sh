#!/usr/bin/env bash
# Installs Maru: the worker library (libmaru.so.0 with its links, libmaru.a, maru.h,
# maru.pc) on every kind of node, and the node's daemons, systemd units, env files and
# the agent key. Installs no system package: building needs them, running does not.
#   scripts/install.sh [--prefix P] [--destdir D] [--bin-dir DIR] [--worker | --standalone | --metadata]
#   scripts/install.sh --uninstall [--prefix P] [--destdir D]
# --prefix P     where programs, the library and the header go (default /usr/local):
#                P/bin, P/lib, P/include, P/lib/pkgconfig/maru.pc; units and env files
#                go to /etc (under D)
# --destdir D    stage everything under D (packaging and tests; `--root D` is the same);
#                no user, ownership, systemd or ldconfig change is made then
# --bin-dir DIR  where cargo put the build (default target/release); the library is
#                taken from DIR or DIR/deps
# --worker       a worker node: the library, header and pkg-config file only
# --standalone   the agent's unit starts at boot on its own (node without an RM)
# --metadata     the metadata node instead: maru-server (its unit and env file) and
#                maru-usage; the agent key is copied there from a memory node
# --uninstall    removes what an install put under P (and D), listed in
#                P/share/maru/installed-files; env files and keys are kept
# Env files and the key are written once and kept across reinstalls.
set -euo pipefail
root=
prefix=/usr/local
standalone=0
metadata=0
worker=0
uninstall=0
bin_dir=target/release
while [ $# -gt 0 ]; do
    case "$1" in
        --root|--destdir) root=$2; shift 2 ;;
        --prefix) prefix=$2; shift 2 ;;
        --standalone) standalone=1; shift ;;
        --metadata) metadata=1; shift ;;
        --worker) worker=1; shift ;;
        --uninstall) uninstall=1; shift ;;
        --bin-dir) bin_dir=$2; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
here=$(cd "$(dirname "$0")/.." && pwd)
case "$prefix" in /*) ;; *) echo "install.sh: --prefix must be an absolute path, not $prefix" >&2; exit 2 ;; esac
prefix=${prefix%/}
[ -n "$prefix" ] || prefix=/usr
if [ $((metadata + standalone + worker)) -gt 1 ]; then
    echo "install.sh: --worker, --metadata and --standalone are different nodes; pick one" >&2
    exit 2
fi
bindir=$root$prefix/bin
libdir=$root$prefix/lib
incdir=$root$prefix/include
manifest_dir=$root$prefix/share/maru
manifest=$manifest_dir/installed-files

if [ "$uninstall" = 1 ]; then
    [ -f "$manifest" ] || { echo "install.sh: nothing to uninstall ($manifest not found)" >&2; exit 1; }
    while IFS= read -r f; do
        [ -n "$f" ] || continue
        if [ -e "$root$f" ] || [ -L "$root$f" ]; then rm -f "$root$f"; echo "removed $root$f"; fi
    done < "$manifest"
    rm -f "$manifest"
    rmdir "$manifest_dir" 2>/dev/null || true
    if [ -z "$root" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
    fi
    if [ -z "$root" ] && [ "$(id -u)" = 0 ] && command -v ldconfig >/dev/null 2>&1; then ldconfig || true; fi
    echo "uninstalled (kept /etc/maru: env files and keys)"
    exit 0
fi

# Every file installed, as its path on the target system, for --uninstall.
installed=()
put() { # mode src dst-dir [name]
    local name=${4:-$(basename "$2")}
    install -d "$3"
    install -m "$1" "$2" "$3/$name"
    installed+=("${3#"$root"}/$name")
}
link() { # target name dir
    ln -sfn "$1" "$3/$2"
    installed+=("${3#"$root"}/$2")
}
# A unit whose ExecStart names the programs where this install put them.
put_unit() { # src name
    install -d "$root/etc/systemd/system"
    sed "s|/usr/local/bin/|$prefix/bin/|g" "$1" > "$root/etc/systemd/system/$2"
    chmod 0644 "$root/etc/systemd/system/$2"
    installed+=("/etc/systemd/system/$2")
}
finish() { # adds to the list of an earlier install (a host may be two kinds of node)
    install -d "$manifest_dir"
    { [ -f "$manifest" ] && cat "$manifest"; printf '%s\n' "${installed[@]}" "${prefix}/share/maru/installed-files"; } |
        sort -u > "$manifest.new"
    mv "$manifest.new" "$manifest"
}

# The worker library, on every node: libmaru.so.X.Y.Z with its SONAME link
# libmaru.so.0 and the development link libmaru.so, libmaru.a, maru.h, maru.pc.
so=$bin_dir/libmaru.so
[ -f "$so" ] || so=$bin_dir/deps/libmaru.so
[ -f "$so" ] || { echo "install.sh: libmaru.so not found in $bin_dir or $bin_dir/deps; run make release first" >&2; exit 2; }
a=$bin_dir/libmaru.a
[ -f "$a" ] || a=$bin_dir/deps/libmaru.a
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$here/Cargo.toml" | head -1)
put 0755 "$so" "$libdir" "libmaru.so.$version"
link "libmaru.so.$version" libmaru.so.0 "$libdir"
link libmaru.so.0 libmaru.so "$libdir"
if [ -f "$a" ]; then put 0644 "$a" "$libdir"; else echo "install.sh: $bin_dir/libmaru.a not built; installing without it" >&2; fi
put 0644 "$here/include/maru.h" "$incdir"
install -d "$libdir/pkgconfig"
cat > "$libdir/pkgconfig/maru.pc" <<PC
prefix=$prefix
exec_prefix=\${prefix}
libdir=\${exec_prefix}/lib
includedir=\${prefix}/include

Name: maru
Description: Maru KV-cache storage engine: the worker library (C ABI, include maru.h)
Version: $version
Libs: -L\${libdir} -lmaru
Libs.private: -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc
Cflags: -I\${includedir}
PC
installed+=("$prefix/lib/pkgconfig/maru.pc")
if [ -z "$root" ] && [ "$(id -u)" = 0 ] && command -v ldconfig >/dev/null 2>&1; then ldconfig || true; fi
if [ "$worker" = 1 ]; then
    finish
    echo "installed the worker library under $prefix (pkg-config: maru)"
    exit 0
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
    install -d "$root/etc/maru"
    chmod 0755 "$root/etc/maru"
    for b in maru-server maru-usage; do
        put 0755 "$bin_dir/$b" "$bindir"
    done
    put_unit "$here/daemons/systemd/maru-server.service" maru-server.service
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
    finish
    echo "installed the metadata node (maru-server.service, /etc/maru/server.env) and the worker library under $prefix"
    exit 0
fi

for b in maru-resource-manager maru-rm-ctl maru-remote-cxl-agent; do
    [ -x "$bin_dir/$b" ] || { echo "install.sh: $bin_dir/$b not built; run make release first" >&2; exit 2; }
done

install -d "$root/etc/maru"
chmod 0755 "$root/etc/maru"
for b in maru-resource-manager maru-rm-ctl maru-remote-cxl-agent; do
    put 0755 "$bin_dir/$b" "$bindir"
done
put_unit "$here/daemons/systemd/maru-resource-manager.service" maru-resource-manager.service
unit=maru-remote-cxl-agent.service
src=$here/daemons/systemd/maru-remote-cxl-agent.service
[ "$standalone" = 1 ] && src=$here/daemons/systemd/maru-remote-cxl-agent-standalone.service
put_unit "$src" "$unit"

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
finish
echo "installed (agent unit: $([ "$standalone" = 1 ] && echo standalone || echo bound to the resource manager)) and the worker library under $prefix"
