# make deny: dependency check with cargo-deny (deny.toml) — licenses, bans
# (duplicates, wildcards) and sources (crates.io only, no git). It needs no network
# beyond crates.io (cargo fetch of every platform's crates, for cargo metadata).
# make deny-advisories: RustSec advisories too; it fetches the advisory database from
# GitHub, so it only works where that is reachable (not on the build hosts here).
.PHONY: deny deny-advisories deny-tools

deny-tools:
	@command -v cargo-deny >/dev/null || $(CARGO) install cargo-deny --locked

deny: deny-tools
	$(CARGO) fetch --locked
	$(CARGO) deny check licenses bans sources

deny-advisories: deny-tools
	$(CARGO) fetch --locked
	$(CARGO) deny check advisories
