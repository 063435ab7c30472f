#!/usr/bin/env bash
# scripts/cpu-hog.sh CMD [ARGS...]: runs CMD while a busy loop spins on every core
# (nproc of them; MARU_HOG_PROCS=N for another count, 0 for none), so that tests meet
# the load of a busy CI machine: timeouts, heartbeats and probes that hold on an idle
# machine must hold here too. The loops end with CMD (and after MARU_HOG_MAX_S, 7200,
# whatever happens); CMD's exit status is this script's.
set -uo pipefail
n=${MARU_HOG_PROCS:-$(nproc)}
max=${MARU_HOG_MAX_S:-7200}
pids=()
stop() {
    local p
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
    pids=()
}
trap stop EXIT
trap 'stop; exit 143' TERM INT
for ((i = 0; i < n; i++)); do
    timeout "$max" bash -c 'while :; do :; done' &
    pids+=($!)
done
echo "[cpu-hog] $n busy loop(s) for the length of: $*" >&2
"$@"
rc=$?
echo "[cpu-hog] done (exit $rc); load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
exit $rc
