#!/usr/bin/env bash
# Runs the shell commands of README.md and docs/*.md as a new user would (make docs-check).
#
# Which blocks run: every fenced code block whose info string is `sh`, `bash` or `shell`.
# Other blocks (```text, ```console, ```c, ```python, ```json, plain ```) are not run.
# A marker on the last non-blank line before the opening fence changes that:
#
#   <!-- docs-check: skip: REASON -->   never run here (needs hardware, a cluster, systemd,
#                                        or changes the host); the reason is printed
#   <!-- docs-check: slow: REASON -->   run only with DOCS_CHECK_SLOW=1 (minutes of build
#                                        or run time, e.g. a release build), bounded by
#                                        DOCS_CHECK_SLOW_TIMEOUT (1800 s), on the host's
#                                        network (they may fetch packages)
#
# How a block runs: as one `bash -euo pipefail` script from the repository root, with
# $TARGET_DIR/debug first on PATH (what `make install` would put there),
# CARGO_TARGET_DIR=$TARGET_DIR, bounded by DOCS_CHECK_TIMEOUT seconds (default 45).
# As root with `ip netns`, each block gets its own network namespace (loopback only:
# the default ports are free, nothing reaches the network) and its own mount namespace
# with tmpfs on /tmp and /dev/shm, the checkout under a throw-away overlay (a block may
# write into it; the checkout is left as it was) and $TARGET_DIR on ./target; when
# the block ends, everything still running in its namespace is killed. Elsewhere
# blocks run on the host in the checkout itself, and processes they leave are killed
# by their DOCS_CHECK_RUN environment marker.
#
# Usage: scripts/check-docs.sh [--list] [FILE.md ...]   (default README.md docs/*.md)
# Env:   TARGET_DIR (default ./target; the binaries must be built: make docs-check builds
#        them), DOCS_CHECK_TIMEOUT, DOCS_CHECK_SLOW=1, DOCS_CHECK_KEEP=1 (keep the logs).
# Exit:  0 every run block passed, 1 some failed, 2 bad usage or nothing built.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
list=0
files=()
for a in "$@"; do
    case "$a" in
        --list) list=1 ;;
        -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
        -*) echo "check-docs: unknown option $a (see --help)" >&2; exit 2 ;;
        *) files+=("$a") ;;
    esac
done
[ ${#files[@]} -gt 0 ] || files=(README.md docs/*.md)
target=${TARGET_DIR:-$root/target}
limit=${DOCS_CHECK_TIMEOUT:-45}
slow=${DOCS_CHECK_SLOW:-0}

run_dir=$target/docs-check/run-$$
blocks=$run_dir/blocks
mkdir -p "$blocks"

# Extract the blocks: one file per block plus an index line
# "N<TAB>FILE<TAB>LINE<TAB>MODE<TAB>REASON" (MODE: run, skip, slow).
python3 - "$blocks" "${files[@]}" <<'PY' || exit 2
import os, re, sys
out, files = sys.argv[1], sys.argv[2:]
marker = re.compile(r"^\s*<!--\s*docs-check:\s*(skip|slow)\s*:?\s*(.*?)\s*-->\s*$")
n = 0
with open(os.path.join(out, "index.tsv"), "w") as index:
    for path in files:
        try:
            lines = open(path, encoding="utf-8").read().split("\n")
        except OSError as e:
            sys.exit(f"check-docs: cannot read {path}: {e}")
        i, last = 0, ""
        while i < len(lines):
            line = lines[i]
            m = re.match(r"^(\s*)(```+|~~~+)\s*([^\s`]*)", line)
            if not m:
                if line.strip():
                    last = line
                i += 1
                continue
            fence, lang, start = m.group(2), m.group(3).lower(), i + 1
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                body.append(lines[i])
                i += 1
            i += 1
            mk = marker.match(last)
            last = ""
            if lang not in ("sh", "bash", "shell"):
                continue
            n += 1
            mode, reason = (mk.group(1), mk.group(2)) if mk else ("run", "")
            if mode in ("skip", "slow") and not reason:
                sys.exit(f"check-docs: {path}:{start}: a {mode} marker needs a reason")
            with open(os.path.join(out, f"{n:03}.sh"), "w") as f:
                f.write("\n".join(body) + "\n")
            index.write(f"{n}\t{path}\t{start}\t{mode}\t{reason}\n")
PY

if [ "$list" = 1 ]; then
    while IFS=$'\t' read -r n file line mode reason; do
        printf '%-5s %s:%s %s\n' "$mode" "$file" "$line" "${reason:+($reason)}"
        sed 's/^/        /' "$blocks/$(printf %03d "$n").sh"
    done < "$blocks/index.tsv"
    rm -rf "$run_dir"
    exit 0
fi

if [ ! -x "$target/debug/maru-server" ]; then
    echo "check-docs: $target/debug/maru-server is not built; run make docs-check (or cargo build --workspace --bins)" >&2
    exit 2
fi

isolate=0
probe=maru-docs-probe-$$
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v unshare >/dev/null &&
    ip netns add "$probe" 2>/dev/null; then
    ip netns del "$probe"
    isolate=1
else
    echo "check-docs: no network namespaces here (not root, or ip netns not permitted):" \
        "blocks run on the host, in the checkout, using its ports, /tmp and /dev/shm" >&2
    [ "$target" -ef "$root/target" ] ||
        echo "check-docs: TARGET_DIR is not ./target: blocks that use target/debug/... will not find the binaries" >&2
fi

# kill_marked ID: SIGKILL every process whose environment carries DOCS_CHECK_RUN=ID.
kill_marked() {
    local p env
    for p in /proc/[0-9]*; do
        env=$(tr '\0' '\n' 2>/dev/null < "$p/environ") || continue
        if grep -qx "DOCS_CHECK_RUN=$1" <<<"$env"; then
            kill -KILL "${p#/proc/}" 2>/dev/null && echo "        killed pid ${p#/proc/} left by the block"
        fi
    done
}

current_ns=
cleanup() {
    if [ -n "$current_ns" ]; then
        for p in $(ip netns pids "$current_ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
        ip netns del "$current_ns" 2>/dev/null
    fi
    [ "${DOCS_CHECK_KEEP:-0}" = 1 ] || rm -rf "$run_dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

pass=0 fail=0 skipped=0
failed=()
start_all=$(date +%s)
while IFS=$'\t' read -r n file line mode reason; do
    id=$(printf %03d "$n")
    where="$file:$line"
    if [ "$mode" = skip ] || { [ "$mode" = slow ] && [ "$slow" != 1 ]; }; then
        printf 'SKIP  %-34s %s%s\n' "$where" "$reason" "$([ "$mode" = slow ] && echo ' [DOCS_CHECK_SLOW=1 runs it]')"
        skipped=$((skipped + 1))
        continue
    fi
    log=$run_dir/$id.log
    marker="$$-$id"
    t0=$(date +%s)
    envs=(env "PATH=$target/debug:$PATH" "CARGO_TARGET_DIR=$target" "CARGO_NET_OFFLINE=true"
        "DOCS_CHECK_RUN=$marker" "HOME=${HOME:-/root}")
    block_limit=$limit
    [ "$mode" = slow ] && block_limit=${DOCS_CHECK_SLOW_TIMEOUT:-1800}
    if [ "$isolate" = 1 ]; then
        netns=()
        if [ "$mode" != slow ]; then
            current_ns=maru-docs-$$-$id
            ip netns add "$current_ns" && ip -n "$current_ns" link set lo up
            netns=(ip netns exec "$current_ns")
        fi
        timeout -k 5 "$block_limit" "${netns[@]}" unshare --mount --propagation private \
            "${envs[@]}" bash -c '
                set -e
                # The checkout and the target dir may lie under /tmp (a CI clone), which
                # the fresh /tmp hides: keep a handle on both first, in the fresh
                # /dev/shm, then put them back at their own paths.
                mount -t tmpfs -o size=8g docs-check /dev/shm
                keep=/dev/shm/.docs-check
                mkdir -p "$keep/root" "$keep/target"
                mount --bind "$1" "$keep/root"
                mount --bind "$2" "$keep/target"
                mount -t tmpfs -o size=8g docs-check /tmp
                mkdir -p /tmp/.docs-check/upper /tmp/.docs-check/work "$1"
                mount -t overlay docs-check -o "lowerdir=$keep/root,upperdir=/tmp/.docs-check/upper,workdir=/tmp/.docs-check/work" "$1" || {
                    echo "docs-check: no overlay mount here: the block runs in the checkout itself" >&2
                    mount --bind "$keep/root" "$1"
                }
                mkdir -p "$1/target"
                mount --bind "$keep/target" "$1/target"
                cd "$1"
                exec bash -euo pipefail "$3"' docs-check "$root" "$target" "$blocks/$id.sh" \
            </dev/null >"$log" 2>&1
        rc=$?
        if [ -n "$current_ns" ]; then
            for p in $(ip netns pids "$current_ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
            ip netns del "$current_ns" 2>/dev/null
            current_ns=
        else
            kill_marked "$marker"
        fi
    else
        (cd "$root" && timeout -k 5 "$block_limit" "${envs[@]}" bash -euo pipefail "$blocks/$id.sh") \
            </dev/null >"$log" 2>&1
        rc=$?
        kill_marked "$marker"
    fi
    secs=$(( $(date +%s) - t0 ))
    if [ "$rc" = 0 ]; then
        printf 'PASS  %-34s %3d s\n' "$where" "$secs"
        pass=$((pass + 1))
    else
        why="exit status $rc"
        [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="did not finish within $block_limit s (a daemon started in the foreground?)"
        printf 'FAIL  %-34s %3d s  %s\n' "$where" "$secs" "$why"
        sed 's/^/        | /' "$blocks/$id.sh"
        echo "        output (last 15 lines):"
        tail -15 "$log" | sed 's/^/        > /'
        fail=$((fail + 1))
        failed+=("$where")
    fi
done < "$blocks/index.tsv"

echo
echo "docs-check: $pass passed, $fail failed, $skipped not run here, in $(( $(date +%s) - start_all )) s"
if [ "$fail" -gt 0 ]; then
    echo "failed: ${failed[*]}"
    echo "fix the commands, or mark a block that cannot run here with <!-- docs-check: skip: REASON --> on the line before it"
    exit 1
fi
