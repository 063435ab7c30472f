# make bench: the benchmark binary (bench/), results into bench/results/.
.PHONY: bench

bench: deps
	$(CARGO) build --release --workspace --bins
	mkdir -p bench/results
	$(TARGET_DIR)/release/maru-bench --json bench/results/latest.json | tee bench/results/latest.txt
