# Operators' checks: make test-prometheus (Debian's prometheus scraping every daemon with
# deploy/prometheus/ and deploy/grafana/; scripts/prometheus-test.sh).
.PHONY: test-prometheus

test-prometheus: deps
	$(CARGO) build -p maru -p maru-daemons --bins --lib
	scripts/prometheus-test.sh $(DEBUG_DIR)
