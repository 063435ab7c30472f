#!/usr/bin/env bash
# make test-vllm / make demo-vllm: installs vLLM CPU into the cached venv if missing
# (install-vllm.sh), makes the model (make_model.py, cached too), then runs e2e.py or
# demo.py, which start the daemons on loopback and stop them at the end.
# adapters: LMCache's and SGLang's own Maru backends (bindings/python/tests/test_engines.py).
# Usage: examples/vllm/run.sh e2e|demo|adapters DIR-WITH-BINARIES [extra args for the script]
set -euo pipefail
what=$1 bin=$2; shift 2
here="$(cd "$(dirname "$0")" && pwd)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/maru"
start=$(date +%s)
venv="$("$here/install-vllm.sh" | tail -n 1)"
py="$venv/bin/python"
case "$what" in
    adapters)
        # LMCache's and SGLang's own Maru backends on this package (test_engines.py):
        # the tests start their daemons from the binaries in $bin.
        echo "vLLM venv $venv (ready after $(( $(date +%s) - start )) s)"
        rc=0
        MARU_BIN_DIR="$bin" MARU_LIB="$bin/libmaru.so" PYTHONPATH="$here/../../bindings/python" \
            timeout -k 30 "${MARU_ADAPTERS_TIMEOUT_S:-1800}" "$py" -m pytest -q "$here/../../bindings/python/tests/test_engines.py" "$@" || rc=$?
        echo "adapters finished in $(( $(date +%s) - start )) s (exit $rc)"
        exit $rc ;;
    e2e)
        model="$("$py" "$here/make_model.py" "$cache/vllm-models/tiny-2l-256" --layers 2 --hidden 256 --heads 4 \
            --kv-heads 2 --intermediate 512 | tail -n 1)"
        script=e2e.py limit=${MARU_VLLM_TEST_TIMEOUT_S:-3000} ;;
    demo)
        model="$("$py" "$here/make_model.py" "$cache/vllm-models/demo-4l-1024" --layers 4 --hidden 1024 --heads 16 \
            --kv-heads 8 --intermediate 2816 | tail -n 1)"
        script=demo.py limit=${MARU_VLLM_DEMO_TIMEOUT_S:-3000} ;;
    *) echo "usage: $0 e2e|demo|adapters DIR" >&2; exit 2 ;;
esac
echo "vLLM venv $venv, model $model (ready after $(( $(date +%s) - start )) s)"
rc=0
# SIGTERM on timeout: the script stops its daemons and engines (bounded waits).
timeout -k 60 "$limit" "$py" "$here/$script" --bin "$bin" --model "$model" "$@" || rc=$?
echo "$what finished in $(( $(date +%s) - start )) s (exit $rc)"
exit $rc
