#!/usr/bin/env bash
# make test-prometheus: Debian's prometheus scraping the three daemons and maru-usage
# --metrics on loopback, with the shipped deploy/prometheus/ (scrape jobs and rules) and
# deploy/grafana/ (dashboard). Checks:
#   - promtool check config (the shipped file and the one made here) and check rules pass;
#   - through Prometheus' HTTP API: every target is up, every metric named in the rules
#     and in the dashboard exists (a daemon exports it), and every rule evaluated
#     without error.
# An engine (the Python binding, remote_cxl) stores and loads while it runs and keeps its
# session open, so that request, latency and per-tenant series exist.
# Usage: scripts/prometheus-test.sh [BIN_DIR]   (default target/debug; needs the daemons,
# libmaru.so, python3, curl). Installs Debian's prometheus when promtool is missing
# (root, or sudo without a password). Every wait is bounded; everything is removed on exit.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="$(cd "${1:-$root/target/debug}" && pwd)"
WAIT_S=${MARU_PROM_WAIT_S:-90}
log() { printf '[prometheus-test] %s\n' "$*" >&2; }

if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    log "installing Debian's prometheus"
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null \
        || { $sudo apt-get update -q >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null; }
fi
log "$(prometheus --version 2>&1 | head -1)"

# The shipped files check as they are.
promtool check config "$root/deploy/prometheus/prometheus.yml" >/dev/null
promtool check rules "$root/deploy/prometheus/maru.rules.yml" >/dev/null
python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$root/deploy/grafana/maru-dashboard.json"

source "$root/scripts/daemons-lib.sh"
work=$(mktemp -d /tmp/maru-prom.XXXXXX)
pool=/dev/shm/maru-prom-pool-$$
prom_pid="" engine_pid=""
cleanup() {
    [ -n "$engine_pid" ] && { touch "$work/engine.stop"; kill "$engine_pid" 2>/dev/null || true; wait "$engine_pid" 2>/dev/null || true; }
    [ -n "$prom_pid" ] && { kill "$prom_pid" 2>/dev/null || true; wait "$prom_pid" 2>/dev/null || true; }
    maru_stop_all
    rm -rf "$work" "$pool"
}
trap cleanup EXIT
fail() {
    log "FAILED: $*"
    for f in "$work"/*.log; do [ -f "$f" ] && { log "--- $f"; tail -20 "$f" >&2; }; done
    exit 1
}

# Free loopback ports, all bound at once so that none repeats.
read -r p_rm p_agent p_server p_usage p_prom < <(python3 -c '
import socket
s = [socket.socket() for _ in range(5)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])
for x in s: x.close()')

export RUST_LOG=warn
"$bin/maru-rm-ctl" gen-key "$work/agent.key" >/dev/null
maru_start "$work/rm" "$bin/maru-resource-manager" --state-dir "$work/rm-state" --fake-dax "$pool:256M" \
    --metrics "127.0.0.1:$p_rm" >/dev/null
maru_start "$work/agent" "$bin/maru-remote-cxl-agent" --rm-address "$(cat "$work/rm")" \
    --rm-key-file "$work/rm-state/rm.key" --key-file "$work/agent.key" --device "$pool" --node mem0 \
    --metrics "127.0.0.1:$p_agent" >/dev/null
maru_start "$work/server" "$bin/maru-server" --rm-address "$(cat "$work/rm")" --rm-key-file "$work/rm-state/rm.key" \
    --remote-cxl-agent "$(cat "$work/agent")" --remote-cxl-agent-key-file "$work/agent.key" \
    --key-file "$work/server.key" --region-size 16M --chunk-size 256K --in-memory \
    --metrics "127.0.0.1:$p_server" >/dev/null
"$bin/maru-usage" --server "$(cat "$work/server")" --server-key-file "$work/server.key" \
    --agent-key-file "$work/agent.key" --metrics "127.0.0.1:$p_usage" --metrics-every 1 \
    >"$work/usage.log" 2>&1 &
maru_pids+=($!)

# An engine: stores 8 chunks, loads them and 4 that are not there, keeps its session
# open until told to stop (at most WAIT_S + 60 s).
cat >"$work/engine.py" <<'PY'
import os, sys, time
import maru
work, server, agent_key, server_key, limit = sys.argv[1:6]
cfg = {"backend": "remote_cxl", "server_url": server, "engine_id": "prom-engine", "namespace": "prom",
       "agent_key_file": agent_key, "server_key_file": server_key, "timeout_ms": 10000}
with maru.Handler(cfg) as h:
    data = [(f"prom-{i}", bytes([i]) * 65536) for i in range(8)]
    assert all(h.batch_store(data)), "stores"
    got = h.batch_retrieve([k for k, _ in data] + [f"absent-{i}" for i in range(4)])
    assert got[:8] == [v for _, v in data] and got[8:] == [None] * 4, "loads"
    open(os.path.join(work, "engine.ready"), "w").write("ok\n")
    end = time.monotonic() + float(limit)
    while time.monotonic() < end and not os.path.exists(os.path.join(work, "engine.stop")):
        h.exists("prom-0")
        time.sleep(0.5)
PY
PYTHONPATH="$root/bindings/python" MARU_LIB="$bin/libmaru.so" python3 "$work/engine.py" "$work" \
    "$(cat "$work/server")" "$work/agent.key" "$work/server.key" "$((WAIT_S + 60))" >"$work/engine.log" 2>&1 &
engine_pid=$!
for _ in $(seq 1 200); do
    [ -s "$work/engine.ready" ] && break
    kill -0 "$engine_pid" 2>/dev/null || fail "the engine exited"
    sleep 0.1
done
[ -s "$work/engine.ready" ] || fail "the engine did not store and load within 20 s"

# The shipped configuration, scraping every second, with these loopback targets and the
# shipped rules file.
sed -e 's/15s/1s/g' \
    -e "s#- maru.rules.yml#- $root/deploy/prometheus/maru.rules.yml#" \
    -e "s/10.0.0.2:9851/127.0.0.1:$p_rm/" -e "s/10.0.0.2:9852/127.0.0.1:$p_agent/" \
    -e "s/10.0.0.3:9853/127.0.0.1:$p_server/" -e "s/10.0.0.3:9854/127.0.0.1:$p_usage/" \
    "$root/deploy/prometheus/prometheus.yml" >"$work/prometheus.yml"
promtool check config "$work/prometheus.yml" >/dev/null
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
    --web.listen-address="127.0.0.1:$p_prom" --log.level=warn >"$work/prometheus.log" 2>&1 &
prom_pid=$!

# The metrics the rules and the dashboard name (recording rules, maru:..., are not metrics).
names=$(cat "$root/deploy/prometheus/maru.rules.yml" "$root/deploy/grafana/maru-dashboard.json" \
    | grep -v '^ *#' | grep -oE '\bmaru_[a-zA-Z0-9_]+' | sort -u)
log "$(echo "$names" | wc -l) metrics named in the rules and the dashboard"

check() { # prints what is missing; exit 0 when nothing is
    python3 - "http://127.0.0.1:$p_prom" "$names" <<'PY'
import json, sys, urllib.request
base, names = sys.argv[1], sys.argv[2].split()
def get(path):
    with urllib.request.urlopen(base + path, timeout=5) as r:
        return json.load(r)["data"]
missing = []
targets = get("/api/v1/targets")["activeTargets"]
jobs = {t["labels"]["job"]: t["health"] for t in targets}
want = ["maru-resource-manager", "maru-remote-cxl-agent", "maru-server", "maru-usage"]
for j in want:
    if jobs.get(j) != "up":
        missing.append(f"target {j}: {jobs.get(j, 'absent')}")
have = set(get("/api/v1/label/__name__/values"))
for n in names:
    if n not in have:
        missing.append(f"metric {n}")
for g in get("/api/v1/rules")["groups"]:
    for r in g["rules"]:
        if r.get("health") != "ok":
            missing.append(f"rule {r.get('name')}: {r.get('health')} {r.get('lastError', '')}")
print("\n".join(missing))
sys.exit(1 if missing else 0)
PY
}
deadline=$((SECONDS + WAIT_S))
until out=$(check 2>&1); do
    kill -0 "$prom_pid" 2>/dev/null || fail "prometheus exited"
    [ "$SECONDS" -lt "$deadline" ] || fail "after ${WAIT_S} s still missing:
$out"
    sleep 1
done
log "every target up ($(curl -s "http://127.0.0.1:$p_prom/api/v1/targets" | grep -o '"health":"up"' | wc -l) targets), every named metric exported, every rule evaluated without error"
log "ok"
