# make deb: Debian packages built with cargo-deb (installed here if missing, version
# CARGO_DEB_VERSION) in target/debian/:
#   libmaru0            libmaru.so.0.X.Y and its SONAME link (Multi-Arch: same)
#   libmaru-dev         maru.h, maru.pc, the libmaru.so link, libmaru.a
#   maru-memory-node    maru-resource-manager, maru-remote-cxl-agent (and its standalone
#                       unit), maru-rm-ctl, maru-rdma-check, units, /etc/maru env files
#   maru-metadata-node  maru-server, maru-usage, its unit and env file
#   maru-dbg            the debug information of all of them (/usr/lib/debug)
# The files are the release build's, staged by scripts/install.sh under
# target/debian/stage exactly as `make install PREFIX=/usr LIBDIR=lib/<multiarch>`
# puts them (stripped, debug files apart, no keys); cargo-deb packs them with the
# maintainer scripts of packaging/debian (the user maru, the key directory, purge).
# NO_BUILD=1 packs the release build as it is (INSTALL_FROM=dir for another).
# make deb-test (root): builds them, installs them into this machine with dpkg -i, starts
# the installed daemons as their units would (no systemd needed), runs examples/c
# against them and the installed library, then dpkg --purge and checks nothing is left
# (scripts/deb-test.sh).
.PHONY: deb deb-tools deb-stage deb-test

CARGO_DEB_VERSION ?= 3.8.0
DEB_OUT := $(TARGET_DIR)/debian
DEB_STAGE := $(DEB_OUT)/stage
DEB_MULTIARCH = $(shell gcc -print-multiarch 2>/dev/null || dpkg-architecture -qDEB_HOST_MULTIARCH)
DEB_VERSION = $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)

deb-tools: deps
	@command -v cargo-deb >/dev/null || $(CARGO) install cargo-deb --locked --version $(CARGO_DEB_VERSION)
	@command -v dpkg-shlibdeps >/dev/null || { echo "make deb needs dpkg-shlibdeps: apt-get install dpkg-dev"; exit 2; }
	@command -v objcopy >/dev/null || { echo "make deb needs objcopy: apt-get install binutils"; exit 2; }

deb-stage:
	$(if $(NO_BUILD),,$(CARGO) build --release -p maru -p maru-daemons --bins --lib)
	@test -n "$(DEB_MULTIARCH)" || { echo "make deb: no multiarch tuple (gcc -print-multiarch, dpkg-architecture)"; exit 2; }
	@grep -q 'depends = "libmaru0 (= $(DEB_VERSION)-1)"' libmaru/Cargo.toml || \
		{ echo "make deb: libmaru-dev must depend on libmaru0 (= $(DEB_VERSION)-1): fix libmaru/Cargo.toml [package.metadata.deb.variants.libmaru-dev]"; exit 2; }
	rm -rf $(DEB_STAGE)
	scripts/install.sh --destdir $(DEB_STAGE) --prefix /usr --libdir lib/$(DEB_MULTIARCH) \
		--unit-dir /usr/lib/systemd/system --bin-dir "$(INSTALL_FROM)" >/dev/null
	scripts/install.sh --destdir $(DEB_STAGE) --prefix /usr --libdir lib/$(DEB_MULTIARCH) \
		--unit-dir /usr/lib/systemd/system --bin-dir "$(INSTALL_FROM)" --metadata >/dev/null
	sed 's|/usr/local/bin/|/usr/bin/|g' daemons/systemd/maru-remote-cxl-agent-standalone.service \
		> $(DEB_STAGE)/usr/lib/systemd/system/maru-remote-cxl-agent-standalone.service
	ln -sfn usr/lib/$(DEB_MULTIARCH) $(DEB_STAGE)/libdir

# cargo-deb warns about every asset taken from outside target/release (all of them
# here: the stage) and about units that come as assets rather than from the
# maintainer-scripts directory (all of them); those two warnings are expected.
DEB_EXPECTED = -e "does not match the pattern, and will not be built" -e "No usable systemd units found"
cargo_deb = set -o pipefail; $(CARGO) deb --no-build -o $(DEB_OUT) $(1) 2>&1 | { grep -v $(DEB_EXPECTED) || true; }

deb: deb-tools deb-stage
	rm -f $(DEB_OUT)/*.deb
	$(call cargo_deb,-p maru --variant libmaru0 --multiarch same)
	$(call cargo_deb,-p maru --variant libmaru-dev --multiarch same)
	$(call cargo_deb,-p maru-daemons --variant memory-node)
	$(call cargo_deb,-p maru-daemons --variant metadata-node)
	$(call cargo_deb,-p maru-daemons --variant dbg)

deb-test: deb
	scripts/deb-test.sh $(DEB_OUT)
