# make fuzz-smoke: every cargo-fuzz target of fuzz/ for FUZZ_SECONDS (20) each,
# FUZZ_JOBS (2) at a time (nightly or RUSTC_BOOTSTRAP, ASan, overflow checks), from the committed seeds
# (fuzz/corpus/<target>/seed-*) and regression inputs (fuzz/regressions/<target>/).
# New inputs go to a scratch corpus under fuzz/target, so the committed corpus stays
# small. A crash fails the run and leaves its input in fuzz/artifacts/<target>/.
# Execs per target: fuzz/target/fuzz-smoke.txt.
# make fuzz T=meta_core FUZZ_SECONDS=600: one target, longer.
# make fuzz-check: cargo fmt --check and cargo check of every target against today's
# libmaru, on the default toolchain, with libFuzzer's C++ left out (the crate's `link`
# feature off); part of make lint, so a target that no longer builds shows there and
# not in fuzz-smoke (the crate is outside the workspace: `cargo fmt --all` and clippy
# do not see it; `make fmt` formats it).
.PHONY: fuzz-smoke fuzz fuzz-tools fuzz-check

FUZZ_SECONDS ?= 20
# Targets fuzzed at once (each libFuzzer run is one process on one core).
FUZZ_JOBS ?= 2
FUZZ_DIR := $(CURDIR)/fuzz
FUZZ_TARGETS := $(basename $(notdir $(wildcard fuzz/fuzz_targets/*.rs)))
FUZZ_FLAGS := -O
# cargo fuzz needs nightly's -Z flags: the nightly toolchain where rustup has one,
# else the stable one with RUSTC_BOOTSTRAP=1 (its sanitizer runtimes are the same).
FUZZ_TOOLCHAIN := $(shell $(CARGO) +nightly --version >/dev/null 2>&1 && echo +nightly)
ifeq ($(FUZZ_TOOLCHAIN),)
export RUSTC_BOOTSTRAP := 1
endif
# The targets are built once (cargo fuzz build) and their binaries run directly.
FUZZ_BIN = $(FUZZ_DIR)/target/$(shell rustc -vV | sed -n 's/^host: //p')/release

fuzz-check:
	cd $(FUZZ_DIR) && $(CARGO) fmt --check && $(CARGO) check --bins --no-default-features

fuzz-tools:
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked

fuzz-smoke: fuzz-tools
	cd $(FUZZ_DIR) && $(CARGO) $(FUZZ_TOOLCHAIN) fuzz build $(FUZZ_FLAGS)
	@rm -f $(FUZZ_DIR)/target/fuzz-smoke.txt
	@$(MAKE) --no-print-directory -j$(FUZZ_JOBS) $(addprefix fuzz-run-,$(FUZZ_TARGETS))
	@echo "fuzz-smoke: $(words $(FUZZ_TARGETS)) targets, $(FUZZ_SECONDS) s each ($(FUZZ_JOBS) at a time), no crash"
	@sort $(FUZZ_DIR)/target/fuzz-smoke.txt

fuzz-run-%:
	@$(MAKE) --no-print-directory fuzz-one T=$*

fuzz: fuzz-tools
	@test -n "$(T)" || { echo "usage: make fuzz T=<target> [FUZZ_SECONDS=n]; targets: $(FUZZ_TARGETS)"; exit 2; }
	cd $(FUZZ_DIR) && $(CARGO) $(FUZZ_TOOLCHAIN) fuzz build $(FUZZ_FLAGS) $(T)
	@$(MAKE) --no-print-directory fuzz-one T=$(T)

.PHONY: fuzz-one
fuzz-one:
	@mkdir -p $(FUZZ_DIR)/target/corpus-work/$(T) $(FUZZ_DIR)/regressions/$(T)
	@echo "== fuzz $(T) for $(FUZZ_SECONDS) s"
	@cd $(FUZZ_DIR) && status=0; mkdir -p artifacts/$(T); $(FUZZ_BIN)/$(T) \
		-artifact_prefix=artifacts/$(T)/ target/corpus-work/$(T) corpus/$(T) regressions/$(T) \
		-dict=json.dict -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=10 -max_len=8192 \
		-print_final_stats=1 > target/fuzz-$(T).log 2>&1 || status=$$?; \
	grep -E "INITED|DONE|SUMMARY|panicked" target/fuzz-$(T).log | tail -5; \
	runs=$$(sed -n 's/^stat::number_of_executed_units: *//p' target/fuzz-$(T).log | tail -1); \
	printf '%-16s %12s execs in %s s\n' $(T) "$${runs:-?}" $(FUZZ_SECONDS) >> target/fuzz-smoke.txt; \
	if [ $$status -ne 0 ]; then tail -40 target/fuzz-$(T).log; \
		echo "fuzz $(T): FAILED (log fuzz/target/fuzz-$(T).log, input in fuzz/artifacts/$(T)/)"; exit 1; fi
