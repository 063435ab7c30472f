#!/usr/bin/env bash
# `make install` into a scratch root, as a packager does (PREFIX=/usr DESTDIR=...):
# checks the files and links, builds a C program with `pkg-config --cflags --libs
# maru` and runs it against the installed library, runs examples/c against the
# installed daemons and library, then `make uninstall` leaves only /etc/maru.
# Usage: test_install.sh CARGO_OUT_DIR (a build with the daemons and libmaru)
set -euo pipefail
bin=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$(mktemp -d /tmp/maru-install-test.XXXXXX)
trap 'rm -rf "$dest"' EXIT
fail() { echo "test_install: $*" >&2; exit 1; }

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
         etc/maru/remote-cxl-agent.env etc/maru/server.env etc/maru/remote-cxl-agent.key; do
    [ -e "$dest/$f" ] || fail "$f not installed"
done
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
[ -f "$dest/etc/maru/remote-cxl-agent.key" ] || fail "uninstall removed the agent key"
echo "test_install: ok"
