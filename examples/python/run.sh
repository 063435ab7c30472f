#!/usr/bin/env bash
# Starts a memory node (RM on a fake DAX file in /dev/shm, agent) and maru-server on
# loopback, then runs examples/python/two_engines.py as engine A (store) and engine B
# (load), two processes, on both backends; stops everything.
# Usage: examples/python/run.sh [DIR-WITH-BINARIES-AND-libmaru.so] (default target/debug)
# Python: $PYTHON (default .venv/bin/python if present, else python3) with the `maru`
# package installed (pip install ./bindings/python), or found through PYTHONPATH.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(cd "${1:-$root/target/debug}" && pwd)
py=${PYTHON:-$( [ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3 )}
source "$root/scripts/daemons-lib.sh"
maru_need_built "cargo build -p maru -p maru-daemons --bins --lib" \
    "$bin/maru-resource-manager" "$bin/maru-remote-cxl-agent" "$bin/maru-server" "$bin/maru-rm-ctl" "$bin/libmaru.so"
maru_scratch maru-example-py
export RUST_LOG=${RUST_LOG:-warn} MARU_LIB="$bin/libmaru.so" PYTHONPATH="$root/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
maru_start_one_host "$bin" "$work" "$pool"
# maru-server made its key on first start; the engines prove it (server_key_file).
for backend in remote_cxl cxl; do
    cfg() { printf '{"backend":"%s","server_url":"%s","server_key_file":"%s","engine_id":"%s","namespace":"example-model","agent_key_file":"%s"}' \
        "$backend" "$(cat "$work/server.addr")" "$work/server.key" "$1" "$work/agent.key"; }
    echo "== $backend"
    "$py" "$root/examples/python/two_engines.py" store "$(cfg py-$backend-a)"
    "$py" "$root/examples/python/two_engines.py" load "$(cfg py-$backend-b)"
done
