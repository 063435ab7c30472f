#!/usr/bin/env bash
# Installs what building and testing Maru needs on a Debian machine (run as root).
# Only missing packages are installed, so a prepared machine pays nothing.
set -euo pipefail

need=()
have_cmd() { command -v "$1" >/dev/null 2>&1; }
have_cmd cc || need+=(build-essential)
have_cmd cmake || need+=(cmake)
have_cmd clang || need+=(clang)
have_cmd pkg-config || need+=(pkg-config)
have_cmd ip || need+=(iproute2)
[ -e /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
have_cmd python3 || need+=(python3)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
have_cmd redis-server || need+=(redis-server)   # make bench: Maru beside Redis
have_cmd valgrind || need+=(valgrind)           # ctests: the racing-close cases under valgrind
have_cmd objcopy || need+=(binutils)            # make install: strips, debug files apart
have_cmd dpkg-shlibdeps || need+=(dpkg-dev)     # make deb: the packages' Depends (cargo-deb itself: make deb-tools)

if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-deps: missing packages ${need[*]}; run as root or install them with apt-get" >&2
        exit 1
    fi
    echo "install-deps: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if ! have_cmd cargo; then
    echo "install-deps: cargo not found. Maru needs Rust 1.85 or newer (rustup or your distribution's rust toolchain)." >&2
    exit 1
fi
