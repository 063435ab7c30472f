#!/usr/bin/env bash
# Installs Maru: the worker library (libmaru.so.0 with its links, libmaru.a, maru.h,
# maru.pc) on every kind of node, and the node's daemons, systemd units and env files.
# Installs no system package (building needs them, running does not) and no key: each
# daemon makes its own key on its first start, on the host (see docs/deployment.md).
#   scripts/install.sh [--prefix P] [--destdir D] [--libdir L] [--no-strip] [--bin-dir DIR]
#                      [--unit-dir U] [--worker | --standalone | --metadata]
#   scripts/install.sh --uninstall [--prefix P] [--destdir D]
# --prefix P     where programs, the library and the header go (default /usr/local):
#                P/bin, P/include, the library directory; env files go to /etc/maru
#                and units to U (under D)
# --destdir D    stage everything under D (packaging and tests; `--root D` is the same);
#                no user, ownership, systemd or ldconfig change is made then
# --libdir L     the library directory, relative to P (lib64, lib/x86_64-linux-gnu) or
#                absolute (default lib); maru.pc goes to L/pkgconfig and names it
# --no-strip     keep the debug information in the installed programs and library;
#                by default it is moved to P/lib/debug/<installed path>.debug, which
#                the stripped file names (.gnu_debuglink), and libmaru.a loses its own
# --bin-dir DIR  where cargo put the build (default target/release); the library is
#                taken from DIR or DIR/deps
# --unit-dir U   where the systemd units go (default /etc/systemd/system)
# --worker       a worker node: the library, header and pkg-config file only
# --standalone   the agent's unit starts at boot on its own (node without an RM)
# --metadata     the metadata node instead: maru-server (its unit and env file) and
#                maru-usage
# --uninstall    removes what an install put under P (and D), listed in
#                P/share/maru/installed-files; env files and keys are kept
# Env files are written once and kept across reinstalls.
set -euo pipefail
root=
prefix=/usr/local
libdir_arg=lib
strip=1
unit_dir=/etc/systemd/system
standalone=0
metadata=0
worker=0
uninstall=0
bin_dir=target/release
while [ $# -gt 0 ]; do
    case "$1" in
        --root|--destdir) root=$2; shift 2 ;;
        --prefix) prefix=$2; shift 2 ;;
        --libdir) libdir_arg=$2; shift 2 ;;
        --no-strip) strip=0; shift ;;
        --unit-dir) unit_dir=$2; shift 2 ;;
        --standalone) standalone=1; shift ;;
        --metadata) metadata=1; shift ;;
        --worker) worker=1; shift ;;
        --uninstall) uninstall=1; shift ;;
        --bin-dir) bin_dir=$2; shift 2 ;;
        -h|--help) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
here=$(cd "$(dirname "$0")/.." && pwd)
case "$prefix" in /*) ;; *) echo "install.sh: --prefix must be an absolute path, not $prefix" >&2; exit 2 ;; esac
prefix=${prefix%/}
[ -n "$prefix" ] || prefix=/usr
case "$unit_dir" in /*) ;; *) echo "install.sh: --unit-dir must be an absolute path, not $unit_dir" >&2; exit 2 ;; esac
if [ $((metadata + standalone + worker)) -gt 1 ]; then
    echo "install.sh: --worker, --metadata and --standalone are different nodes; pick one" >&2
    exit 2
fi
# The library directory on the target system, and as maru.pc writes it.
libdir_arg=${libdir_arg%/}
case "$libdir_arg" in
    "") echo "install.sh: --libdir must not be empty" >&2; exit 2 ;;
    *..*) echo "install.sh: --libdir must not contain '..' ($libdir_arg)" >&2; exit 2 ;;
    /*) target_libdir=$libdir_arg ;;
    *) target_libdir=$prefix/$libdir_arg ;;
esac
case "$target_libdir" in
    "$prefix"/*) pc_libdir="\${exec_prefix}/${target_libdir#"$prefix"/}" ;;
    *) pc_libdir=$target_libdir ;;
esac
bindir=$root$prefix/bin
libdir=$root$target_libdir
incdir=$root$prefix/include
debugdir=$prefix/lib/debug
manifest_dir=$root$prefix/share/maru
manifest=$manifest_dir/installed-files

if [ "$uninstall" = 1 ]; then
    [ -f "$manifest" ] || { echo "install.sh: nothing to uninstall ($manifest not found)" >&2; exit 1; }
    while IFS= read -r f; do
        [ -n "$f" ] || continue
        if [ -e "$root$f" ] || [ -L "$root$f" ]; then rm -f "$root$f"; echo "removed $root$f"; fi
        # The directories made for the debug files, when nothing else is left in them.
        case "$f" in
            "$debugdir"/*)
                d=$(dirname "$f")
                while [ "$d" != "$(dirname "$debugdir")" ] && rmdir "$root$d" 2>/dev/null; do d=$(dirname "$d"); done ;;
        esac
    done < "$manifest"
    rm -f "$manifest"
    rmdir "$manifest_dir" 2>/dev/null || true
    if [ -z "$root" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
    fi
    if [ -z "$root" ] && [ "$(id -u)" = 0 ] && command -v ldconfig >/dev/null 2>&1; then ldconfig || true; fi
    echo "uninstalled (kept /etc/maru, the env files, and /var/lib/maru, the keys)"
    exit 0
fi

if [ "$strip" = 1 ] && ! command -v objcopy >/dev/null 2>&1; then
    echo "install.sh: objcopy not found (binutils): install it, or install unstripped with --no-strip (make install STRIP=0)" >&2
    exit 2
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
# An installed program or shared library loses its debug information to
# P/lib/debug/<its path>.debug (where gdb looks with debug-file-directory P/lib/debug)
# and names that file in its .gnu_debuglink section.
strip_elf() { # installed path (under the root)
    [ "$strip" = 1 ] || return 0
    local rel=${1#"$root"}
    local dbg=$root$debugdir$rel.debug
    install -d "$(dirname "$dbg")"
    objcopy --only-keep-debug "$1" "$dbg"
    chmod 0644 "$dbg"
    objcopy --strip-debug --strip-unneeded "$1"
    objcopy --add-gnu-debuglink="$dbg" "$1"
    installed+=("$debugdir$rel.debug")
}
# A unit whose ExecStart names the programs where this install put them.
put_unit() { # src name
    install -d "$root$unit_dir"
    sed "s|/usr/local/bin/|$prefix/bin/|g" "$1" > "$root$unit_dir/$2"
    chmod 0644 "$root$unit_dir/$2"
    installed+=("$unit_dir/$2")
}
put_program() { # name
    put 0755 "$bin_dir/$1" "$bindir"
    strip_elf "$bindir/$1"
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
strip_elf "$libdir/libmaru.so.$version"
link "libmaru.so.$version" libmaru.so.0 "$libdir"
link libmaru.so.0 libmaru.so "$libdir"
if [ -f "$a" ]; then
    put 0644 "$a" "$libdir"
    # Static archives keep no separate debug file (as distributions ship them).
    [ "$strip" = 0 ] || objcopy --strip-debug "$libdir/libmaru.a"
else
    echo "install.sh: $bin_dir/libmaru.a not built; installing without it" >&2
fi
put 0644 "$here/include/maru.h" "$incdir"
install -d "$libdir/pkgconfig"
cat > "$libdir/pkgconfig/maru.pc" <<PC
prefix=$prefix
exec_prefix=\${prefix}
libdir=$pc_libdir
includedir=\${prefix}/include

Name: maru
Description: Maru KV-cache storage engine: the worker library (C ABI, include maru.h)
Version: $version
Libs: -L\${libdir} -lmaru
Libs.private: -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc
Cflags: -I\${includedir}
PC
installed+=("$target_libdir/pkgconfig/maru.pc")
if [ -z "$root" ] && [ "$(id -u)" = 0 ] && command -v ldconfig >/dev/null 2>&1; then ldconfig || true; fi
if [ "$worker" = 1 ]; then
    finish
    echo "installed the worker library under $prefix (pkg-config: maru)"
    exit 0
fi

# An env file from its template in daemons/systemd, written once.
write_env() { # template name [sed expression]
    local dst=$root/etc/maru/$2
    if [ -e "$dst" ]; then
        echo "kept $dst"
    else
        sed "${3:-}" "$1" > "$dst"
        chmod 0644 "$dst"
        echo "wrote $dst"
    fi
}
# On the host itself (not under --destdir): the user the units run as and the
# directory of the keys (mode 0700, owner maru), which the daemons fill on their first
# start (systemd makes it too, as the units' StateDirectory).
host_setup() {
    [ -z "$root" ] || return 0
    id maru >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin maru
    install -d -o maru -g maru -m 0700 /var/lib/maru
}
keys_note() { # what
    echo "install.sh: $1"
}

if [ "$metadata" = 1 ]; then
    for b in maru-server maru-usage; do
        [ -x "$bin_dir/$b" ] || { echo "install.sh: $bin_dir/$b not built; run make release first" >&2; exit 2; }
    done
    install -d "$root/etc/maru"
    chmod 0755 "$root/etc/maru"
    for b in maru-server maru-usage; do
        put_program "$b"
    done
    put_unit "$here/daemons/systemd/maru-server.service" maru-server.service
    write_env "$here/daemons/systemd/server.env" server.env
    host_setup
    keys_note "maru-server makes its key /var/lib/maru/server.key on its first start: give it to the workers (MARU_SERVER_KEY_FILE)"
    keys_note "tenants (engines that do not trust each other, a key each): set MARU_SERVER_TENANTS in /etc/maru/server.env (docs/operations.md, \"Tenants\")"
    keys_note "unless the memory node runs on this host, copy its RM key and agent key to /var/lib/maru/resource-manager.key and /var/lib/maru/remote-cxl-agent.key (mode 0600, owner maru) before starting maru-server"
    if [ -z "$root" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        systemctl daemon-reload
        systemctl enable maru-server.service || true
    fi
    finish
    echo "installed the metadata node (maru-server.service, /etc/maru/server.env) and the worker library under $prefix"
    exit 0
fi

for b in maru-resource-manager maru-rm-ctl maru-remote-cxl-agent maru-rdma-check; do
    [ -x "$bin_dir/$b" ] || { echo "install.sh: $bin_dir/$b not built; run make release first" >&2; exit 2; }
done

install -d "$root/etc/maru"
chmod 0755 "$root/etc/maru"
for b in maru-resource-manager maru-rm-ctl maru-remote-cxl-agent maru-rdma-check; do
    put_program "$b"
done
put_unit "$here/daemons/systemd/maru-resource-manager.service" maru-resource-manager.service
unit=maru-remote-cxl-agent.service
src=$here/daemons/systemd/maru-remote-cxl-agent.service
[ "$standalone" = 1 ] && src=$here/daemons/systemd/maru-remote-cxl-agent-standalone.service
put_unit "$src" "$unit"

write_env "$here/daemons/systemd/resource-manager.env" resource-manager.env
if [ "$standalone" = 1 ]; then
    write_env "$here/daemons/systemd/remote-cxl-agent.env" remote-cxl-agent.env 's|^MARU_RM_ADDRESS=.*|MARU_RM_ADDRESS=|'
else
    write_env "$here/daemons/systemd/remote-cxl-agent.env" remote-cxl-agent.env
fi
host_setup
if [ "$standalone" = 1 ]; then
    keys_note "copy the pool's agent key and RM key from the RM's node to /var/lib/maru/remote-cxl-agent.key and /var/lib/maru/resource-manager.key (mode 0600, owner maru) and set MARU_RM_ADDRESS in /etc/maru/remote-cxl-agent.env before starting the agent"
else
    keys_note "the RM and the agent make their keys /var/lib/maru/resource-manager.key and /var/lib/maru/remote-cxl-agent.key on their first start: copy them to maru-server, standalone agents and (the agent key) the workers"
fi
if [ -z "$root" ] && command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    # Disable first so a switch between the bound and the standalone form leaves no old links.
    systemctl disable "$unit" >/dev/null 2>&1 || true
    systemctl enable maru-resource-manager.service "$unit" || true
fi
finish
echo "installed (agent unit: $([ "$standalone" = 1 ] && echo standalone || echo bound to the resource manager)) and the worker library under $prefix"
