# make test-vllm: LMCache's own MaruBackend and SGLang's own StorageBackendFactory with
# maru_sglang.MaruStorage, unedited, between two processes on both backends
# (bindings/python/tests/test_engines.py; LMCache and SGLang installed --no-deps into the
# vLLM venv); then real vLLM engines (vLLM CPU, a tiny random Llama made here) share KV
# through maru.vllm.MaruKVConnector on both backends (examples/vllm/e2e.py): engine A
# stores a prompt, engine B (another process) loads >= 90% of its chunks and answers the
# same as A and as an engine without connector, noise stored under the keys changes the
# answer, another dtype finds nothing. make demo-vllm: TTFT of recompute, vLLM's
# ExampleConnector and Maru cxl / remote_cxl with a larger model (examples/vllm/demo.py).
# vLLM is installed once into $(VLLM_VENV) (about 6 GiB; kept between runs, outside
# the clone); the models are cached beside it.
.PHONY: test-vllm demo-vllm vllm-venv

VLLM_VENV ?= $(or $(MARU_VLLM_VENV),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/maru/vllm-venv)

vllm-venv:
	MARU_VLLM_VENV=$(VLLM_VENV) examples/vllm/install-vllm.sh

test-vllm: deps
	$(CARGO) build -p maru -p maru-daemons --bins --lib
	MARU_VLLM_VENV=$(VLLM_VENV) scripts/cpu-hog.sh examples/vllm/run.sh adapters $(DEBUG_DIR)
	MARU_VLLM_VENV=$(VLLM_VENV) examples/vllm/run.sh e2e $(DEBUG_DIR)

demo-vllm: deps
	$(CARGO) build --release -p maru -p maru-daemons --bins --lib
	MARU_VLLM_VENV=$(VLLM_VENV) examples/vllm/run.sh demo $(TARGET_DIR)/release
