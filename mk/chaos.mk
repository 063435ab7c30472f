# make chaos: RM, agent, maru-server and two engines on loopback (fake DAX, soft
# transport); the engines store and load checksummed chunks while maru-chaos kill -9's
# and restarts the agent (also with a new boot id: a reboot of its memory node, whose
# keys must go), maru-server, the RM and engine A at seeded random points.
# Fails on any load whose bytes differ from what was stored under its key, on a region
# or hold left at the RM once everything closed, or on fewer kills than asked.
# The seed is printed; CHAOS_SEED=<seed> make chaos replays it. CHAOS_KILLS (default
# 60), CHAOS_KEEP=1 keeps the scratch directory (logs of every process).
.PHONY: chaos

CHAOS_KILLS ?= 60
CHAOS_BIN_DIR = $(or $(CARGO_TARGET_DIR),$(TARGET_DIR))/debug

chaos: deps
	$(CARGO) build -p maru-daemons -p maru-chaos --bins
	CHAOS_KILLS=$(CHAOS_KILLS) timeout 600 $(CHAOS_BIN_DIR)/maru-chaos --bin-dir $(CHAOS_BIN_DIR)
