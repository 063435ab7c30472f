#!/usr/bin/env bash
# Starts a memory node (RM on a fake DAX file in /dev/shm, agent) and maru-server on
# loopback, builds examples/c/share_kv.c and runs it for both backends; stops everything.
# Usage: examples/c/run.sh [DIR]
#   DIR a cargo output directory (default target/debug; libmaru.so there or in deps/),
#   or an installed prefix (DIR/bin/maru-server exists): the daemons from DIR/bin, the
#   header and library found with `pkg-config maru` (set PKG_CONFIG_PATH, or
#   PKG_CONFIG_SYSROOT_DIR and PKG_CONFIG_LIBDIR for a DESTDIR install).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=$(cd "${1:-$root/target/debug}" && pwd)
if [ -x "$dir/bin/maru-server" ]; then
    bin=$dir/bin
    cflags=$(pkg-config --cflags maru) || { echo "pkg-config does not find maru: set PKG_CONFIG_PATH to the install's lib/pkgconfig" >&2; exit 2; }
    libdir=$(pkg-config --libs-only-L maru | sed 's/^ *-L//; s/ *$//')
    lib=$libdir/libmaru.so.0
else
    bin=$dir
    cflags="-I $root/include"
    lib=$bin/libmaru.so
    # `cargo build --bins` leaves the cdylib only in deps/.
    [ -e "$lib" ] || lib=$bin/deps/libmaru.so
fi
source "$root/scripts/daemons-lib.sh"
maru_need_built "cargo build -p maru -p maru-daemons --bins --lib" \
    "$bin/maru-resource-manager" "$bin/maru-remote-cxl-agent" "$bin/maru-server" "$bin/maru-rm-ctl" "$lib"
maru_scratch maru-example-c
export RUST_LOG=${RUST_LOG:-warn}
# shellcheck disable=SC2086 # cflags is a list of flags
cc -std=c11 -Wall -Wextra $cflags "$root/examples/c/share_kv.c" -ldl -o "$work/share_kv"
maru_start_one_host "$bin" "$work" "$pool"
# maru-server made its key on first start; the engines prove it (server_key_file).
for backend in remote_cxl cxl; do
    cfg() { printf '{"backend":"%s","server_url":"%s","server_key_file":"%s","engine_id":"%s","agent_key_file":"%s"}' \
        "$backend" "$(cat "$work/server.addr")" "$work/server.key" "$1" "$work/agent.key"; }
    printf '%-10s ' "$backend:"
    "$work/share_kv" "$lib" "$(cfg example-$backend-a)" "$(cfg example-$backend-b)" 64
done
