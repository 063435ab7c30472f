#!/usr/bin/env bash
# `make install` into a scratch root, as a packager does (PREFIX=/usr DESTDIR=...):
# checks the files and links (no key: the daemons make theirs on the host; stripped
# with debug files apart), builds a C program with `pkg-config --cflags --libs maru`
# and runs it against the installed library, runs examples/c against the installed
# daemons and library, then `make uninstall` leaves only /etc/maru. Then LIBDIR and
# STRIP=0 as make passes them.
# Usage: test_install.sh CARGO_OUT_DIR (a build with the daemons and libmaru)
set -euo pipefail
bin=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$(mktemp -d /tmp/maru-install-test.XXXXXX)
trap 'rm -rf "$dest"' EXIT
fail() { echo "test_install: $*" >&2; exit 1; }
# has_section FILE NAME: the ELF file has that section (readelf's output read whole: a
# `readelf | grep -q` pipeline fails on SIGPIPE under pipefail).
has_section() { local s; s=$(readelf -SW "$1" 2>/dev/null) || fail "readelf $1"; case "$s" in *" $2 "*) ;; *) return 1 ;; esac; }

# Nothing but cargo may run: no apt-get, no install-deps.
make -s -C "$root" -n install PREFIX=/usr DESTDIR="$dest" | grep -q -e apt-get -e install-deps &&
    fail "make install would install system packages"
for kind in "" METADATA=1; do
    make -s -C "$root" install NO_BUILD=1 INSTALL_FROM="$bin" PREFIX=/usr DESTDIR="$dest" $kind >/dev/null
done

lib=$dest/usr/lib
[ -f "$lib/libmaru.so.0.1.0" ] || fail "libmaru.so.0.1.0 missing"
[ "$(readlink "$lib/libmaru.so.0")" = libmaru.so.0.1.0 ] || fail "libmaru.so.0 is not a link to libmaru.so.0.1.0"
[ "$(readlink "$lib/libmaru.so")" = libmaru.so.0 ] || fail "libmaru.so is not a link to libmaru.so.0"
readelf -d "$lib/libmaru.so.0.1.0" | grep -q 'SONAME.*\[libmaru\.so\.0\]' || fail "no SONAME libmaru.so.0"
for f in usr/lib/libmaru.a usr/include/maru.h usr/lib/pkgconfig/maru.pc \
         usr/bin/maru-resource-manager usr/bin/maru-rm-ctl usr/bin/maru-remote-cxl-agent \
         usr/bin/maru-server usr/bin/maru-usage \
         etc/systemd/system/maru-resource-manager.service etc/systemd/system/maru-remote-cxl-agent.service \
         etc/systemd/system/maru-server.service etc/maru/resource-manager.env \
         etc/maru/remote-cxl-agent.env etc/maru/server.env usr/lib/debug/usr/bin/maru-server.debug; do
    [ -e "$dest/$f" ] || fail "$f not installed"
done
[ -z "$(find "$dest" -name '*.key' -print -quit)" ] || fail "a key was installed into DESTDIR: $(find "$dest" -name '*.key')"
has_section "$dest/usr/bin/maru-server" .gnu_debuglink || fail "maru-server names no debug file"
! has_section "$dest/usr/bin/maru-server" .debug_info || fail "maru-server is not stripped"
grep -q '^ExecStart=/usr/bin/maru-server ' "$dest/etc/systemd/system/maru-server.service" ||
    fail "the unit does not start the program where PREFIX put it"
[ -z "$(find "$dest" -path "$dest/usr/local*" -print -quit)" ] || fail "something went to /usr/local despite PREFIX=/usr"

# A C program built with pkg-config against the scratch root.
export PKG_CONFIG_SYSROOT_DIR=$dest PKG_CONFIG_LIBDIR=$dest/usr/lib/pkgconfig
flags=$(pkg-config --cflags --libs maru)
case "$flags" in *"-I$dest/usr/include"*"-L$dest/usr/lib"*"-lmaru"*) ;; *) fail "pkg-config gives $flags";; esac
# shellcheck disable=SC2086
cc -std=c11 -Wall -Wextra -Werror "$root/ctests/installed_program.c" $flags -o "$dest/program"
readelf -d "$dest/program" | grep -q 'NEEDED.*\[libmaru\.so\.0\]' || fail "the program does not record libmaru.so.0"
LD_LIBRARY_PATH=$lib "$dest/program"

# examples/c against the installed daemons and library.
"$root/examples/c/run.sh" "$dest/usr"

make -s -C "$root" uninstall PREFIX=/usr DESTDIR="$dest" >/dev/null
left=$(cd "$dest" && find . -type f -o -type l | { grep -v -e '^./etc/maru/' -e '^./program$' || true; } | sort)
[ -z "$left" ] || fail "left after uninstall: $left"
[ -f "$dest/etc/maru/server.env" ] || fail "uninstall removed an env file"

# LIBDIR and STRIP=0 through make: the library, maru.pc and its libdir in lib64, the
# debug information kept in place.
dest64=$dest/lib64-root
make -s -C "$root" install NO_BUILD=1 INSTALL_FROM="$bin" PREFIX=/usr DESTDIR="$dest64" LIBDIR=lib64 STRIP=0 WORKER=1 >/dev/null
[ -f "$dest64/usr/lib64/libmaru.so.0.1.0" ] || fail "LIBDIR=lib64: no usr/lib64/libmaru.so.0.1.0"
grep -qx 'libdir=${exec_prefix}/lib64' "$dest64/usr/lib64/pkgconfig/maru.pc" || fail "LIBDIR=lib64: maru.pc says $(grep libdir= "$dest64/usr/lib64/pkgconfig/maru.pc")"
[ ! -e "$dest64/usr/lib" ] || fail "LIBDIR=lib64: something went to usr/lib: $(find "$dest64/usr/lib")"
has_section "$dest64/usr/lib64/libmaru.so.0.1.0" .debug_info || fail "STRIP=0: the library lost its debug information"
echo "test_install: ok"
