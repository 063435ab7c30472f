#!/usr/bin/env bash
# make test-wheel: the manylinux wheel of make wheel, installed into a fresh venv outside
# the tree, with the Python tests run against it (cwd /, no MARU_LIB, no PYTHONPATH: the
# package and libmaru.so that load are the wheel's; test_installed.py checks that).
# Also checks: auditwheel show reports a manylinux tag; the libmaru inside is stripped.
# Usage: scripts/wheel-test.sh WHEEL_DIR BIN_DIR [AUDITWHEEL [PYTEST ARGS...]]
#   WHEEL_DIR: where make wheel put maru-*-manylinux_*.whl; BIN_DIR: the daemons the
#   tests start (a cargo build). pytest and numpy come from PyPI into the fresh venv.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
wheels="$(cd "$1" && pwd)"
bin="$(cd "$2" && pwd)"
auditwheel="${3:-auditwheel}"
shift $(( $# < 3 ? $# : 3 ))   # the rest goes to pytest (-k ..., -x)
log() { printf '[wheel-test] %s\n' "$*" >&2; }
shopt -s nullglob
found=("$wheels"/maru-*-manylinux_*.whl)
[ "${#found[@]}" = 1 ] || { log "expected one manylinux wheel in $wheels, found ${#found[@]} (run make wheel)"; exit 1; }
whl=${found[0]}
log "$(basename "$whl")"

# auditwheel wraps its lines: join them before looking.
show=$("$auditwheel" show "$whl" 2>/dev/null | tr -s '\n ' '  ')
tag=$(echo "$show" | grep -oE 'consistent with the following platform tag: "manylinux_[0-9]+_[0-9]+_[a-z0-9_]+"' | grep -oE 'manylinux_[^"]+') \
    || { log "auditwheel show reports no manylinux tag: $show"; exit 1; }
log "auditwheel show: $tag"

work=$(mktemp -d /tmp/maru-wheel-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
python3 - "$whl" "$work/libmaru.so" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
libs = [n for n in z.namelist() if n.startswith("maru/libmaru") and n.endswith(".so")]
assert len(libs) == 1, f"libmaru in the wheel: {libs}"
open(sys.argv[2], "wb").write(z.read(libs[0]))
PY
if readelf -S "$work/libmaru.so" | grep -qE '\.symtab|\.debug_info'; then
    log "libmaru.so in the wheel is not stripped (.symtab or .debug_info present)"
    exit 1
fi
log "libmaru.so inside: $(stat -c %s "$work/libmaru.so") bytes, stripped"

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check pytest numpy
"$py" -m pip install -q --disable-pip-version-check --no-deps "$whl"
cd /
env -u MARU_LIB -u PYTHONPATH MARU_BIN_DIR="$bin" MARU_EXPECT_INSTALLED="$work/venv" \
    "$py" -m pytest -q -rs -p no:cacheprovider "$root/bindings/python/tests" "$@"
