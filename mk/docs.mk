# make docs-check: runs the shell blocks (```sh) of README.md and docs/*.md as a new
# user would, each bounded in time, in a scratch view of the checkout and (as root) its
# own network namespace with private /tmp and /dev/shm (scripts/check-docs.sh says
# how). A block that cannot run here carries `<!-- docs-check: skip: REASON -->` on the
# line before it; `<!-- docs-check: slow: REASON -->` blocks run with DOCS_CHECK_SLOW=1.
# DOCS=FILE.md checks one file; scripts/check-docs.sh --list shows every block.
.PHONY: docs-check

docs-check: deps
	$(CARGO) build --workspace --bins --target-dir $(TARGET_DIR)
	$(CARGO) build -p maru --lib --target-dir $(TARGET_DIR)
	TARGET_DIR=$(TARGET_DIR) scripts/check-docs.sh $(DOCS)
