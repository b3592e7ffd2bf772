# Gangway: the two commands a newcomer needs are `make dev` and `make test`.
# Builds share one target directory outside the clone so repeated runs (and CI
# on the same machine) stay warm; RocksDB's C++ takes ~15 minutes cold.
SHELL := /bin/bash
export CARGO_TARGET_DIR ?= $(HOME)/.cache/gangway/target
CARGO ?= cargo
BIN := $(CARGO_TARGET_DIR)/debug/gangway

.PHONY: setup build dev test verify fix bench bench-peers chaos chaos-long previous fuzz fuzz-smoke sim image image-check k8s-check deb deb-check console-check

setup:
	@bash deploy/setup-debian.sh

build: setup
	$(CARGO) build --bin gangway
	@mkdir -p bin && ln -sf $(BIN) bin/gangway

# Starts a 3-replica controller cluster with simulated GPU nodes; Ctrl-C stops it.
dev: build
	bin/gangway dev

# The previous data format's build, which the rolling-upgrade test replaces
# replica by replica: the commit just before the one that raised
# FORMAT_NEWEST to its value today, found in this repository's history (so
# every format bump is tested N-1 -> N under load; a shallow clone cannot
# find it). With the newest format not yet committed, that is HEAD. Built
# from `git archive` into a target directory of its own, kept when the
# commit moves (its dependencies stay built): never the shared one, where
# cargo names the two builds' crates alike (hashed relative to the workspace
# root) and would take one's artifacts for the other's. (Format 4's store is
# a checked-in fixture: raft-store/tests.)
NEWEST_FORMAT := $(shell sed -n 's/^pub const FORMAT_NEWEST: u32 = \([0-9]*\);/\1/p' core/src/format.rs)
# The core sat at controller/core before it moved to core/: both paths are
# searched, with renames followed (-M), so the move is no format's commit.
FORMAT_FILES := core/src/format.rs controller/core/src/format.rs
NEWEST_FORMAT_COMMIT := $(shell git log -M -1 --format=%H -S'pub const FORMAT_NEWEST: u32 = $(NEWEST_FORMAT);' -- $(FORMAT_FILES) 2>/dev/null)
PREVIOUS_COMMIT := $(shell git rev-parse --verify --quiet $(if $(NEWEST_FORMAT_COMMIT),$(NEWEST_FORMAT_COMMIT)^,HEAD) 2>/dev/null)
PREVIOUS_DIR := $(HOME)/.cache/gangway/previous
export GANGWAY_PREVIOUS_BIN := $(PREVIOUS_DIR)/gangway
# RocksDB's C++ is compiled once: when the previous commit pins the same
# librocksdb-sys as this one, its build links the library the main target
# directory already holds (built by clippy or the build before it; the
# newest, if several), through librocksdb-sys's ROCKSDB_LIB_DIR. Otherwise
# (none built yet, or another version) it compiles its own. A new target of
# its own starts from copies of the dependencies the main target built (`make
# test` builds the tests first), less the workspace's own crates, which the
# two builds name alike: cold, 3 minutes instead of 8. Copies, never hard
# links: cargo rewrites fingerprints in place, and a link would let one
# build's rewrite the other's (it did: RocksDB's C++ compiled again).
ROCKSDB_PIN := $(shell sed -n '/^name = "librocksdb-sys"$$/{n;s/^version = "\(.*\)"$$/\1/p;}' Cargo.lock)
previous:
	@if [ -z "$(NEWEST_FORMAT)" ] || [ -z "$(PREVIOUS_COMMIT)" ]; then \
		echo "make previous: no commit before data format $(NEWEST_FORMAT) in this history (clone without --depth)"; exit 1; \
	fi
	@prev=$$(for f in $(FORMAT_FILES); do git show $(PREVIOUS_COMMIT):$$f 2>/dev/null; done | sed -n 's/^pub const FORMAT_NEWEST: u32 = \([0-9]*\);/\1/p'); \
	if [ -z "$$prev" ] || [ "$$prev" -ge "$(NEWEST_FORMAT)" ]; then \
		echo "make previous: $(PREVIOUS_COMMIT) reads data format $${prev:-?}, not one below $(NEWEST_FORMAT): the rolling upgrade would upgrade nothing"; exit 1; \
	fi
	@if [ "$$(cat $(PREVIOUS_DIR)/built 2>/dev/null)" != "$(PREVIOUS_COMMIT)" ] || [ ! -x $(GANGWAY_PREVIOUS_BIN) ]; then \
		echo "building gangway at $(PREVIOUS_COMMIT) (the commit before data format $(NEWEST_FORMAT)) for the rolling-upgrade test"; \
		rm -rf $(PREVIOUS_DIR)/src $(PREVIOUS_DIR)/built && mkdir -p $(PREVIOUS_DIR)/src && \
		git archive $(PREVIOUS_COMMIT) | tar -x -C $(PREVIOUS_DIR)/src && \
		if [ ! -d $(PREVIOUS_DIR)/target/debug ] && [ -d $(CARGO_TARGET_DIR)/debug/deps ]; then \
			echo "starting from the dependencies the main target already built (copies; the workspace's own crates are left out)"; \
			for d in deps build .fingerprint; do \
				mkdir -p $(PREVIOUS_DIR)/target/debug/$$d && \
				(cd $(CARGO_TARGET_DIR)/debug/$$d && find . -mindepth 1 -maxdepth 1 ! -name '*gangway*' -exec cp -a -t $(PREVIOUS_DIR)/target/debug/$$d {} +) || exit 1; \
			done; \
		fi && \
		pin=$$(sed -n '/^name = "librocksdb-sys"$$/{n;s/^version = "\(.*\)"$$/\1/p;}' $(PREVIOUS_DIR)/src/Cargo.lock) && \
		lib=$$(ls -t $(CARGO_TARGET_DIR)/debug/build/librocksdb-sys-*/out/librocksdb.a 2>/dev/null | head -1) && \
		if [ -n "$$lib" ] && [ -n "$$pin" ] && [ "$$pin" = "$(ROCKSDB_PIN)" ]; then \
			echo "linking the RocksDB library already built ($$lib)"; \
			export ROCKSDB_LIB_DIR=$$(dirname $$lib) ROCKSDB_STATIC=1; \
		fi && \
		(cd $(PREVIOUS_DIR)/src && CARGO_TARGET_DIR=$(PREVIOUS_DIR)/target $(CARGO) build --bin gangway) && \
		cp $(PREVIOUS_DIR)/target/debug/gangway $(GANGWAY_PREVIOUS_BIN) && \
		echo $(PREVIOUS_COMMIT) > $(PREVIOUS_DIR)/built; \
	fi

# Fuzzing with libFuzzer (cargo-fuzz, nightly): every target for FUZZ_SECONDS
# each, from the checked-in seeds, the golden file's encodings (every command
# and snapshot in every data format, written by fuzz/seeds.sh) and what earlier
# runs found (kept outside the clone). A crash stops the run and leaves its
# input in fuzz/artifacts/. FUZZ_SANITIZER: address (the default) or none.
FUZZ_TARGETS := entry_apply snapshot_decode spec_validate text_parsers proto_spec
FUZZ_SECONDS ?= 300
FUZZ_SEED ?= 0
FUZZ_SANITIZER ?= address
FUZZ_OPT_LEVEL ?= 3
FUZZ_CACHE := $(HOME)/.cache/gangway
fuzz:
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	@rustup run nightly rustc --version >/dev/null || { echo "fuzzing needs the nightly toolchain (rustup toolchain install nightly)"; exit 1; }
	@fuzz/seeds.sh core/tests/golden/encodings.txt $(FUZZ_CACHE)/fuzz-seeds
	@cd fuzz && for t in $(FUZZ_TARGETS); do \
		mkdir -p $(FUZZ_CACHE)/fuzz-corpus/$$t $(FUZZ_CACHE)/fuzz-seeds/$$t && \
		CARGO_TARGET_DIR=$(FUZZ_CACHE)/fuzz-target-$(FUZZ_SANITIZER)-o$(FUZZ_OPT_LEVEL) CARGO_PROFILE_RELEASE_OPT_LEVEL=$(FUZZ_OPT_LEVEL) cargo +nightly fuzz run -s $(FUZZ_SANITIZER) $$t $(FUZZ_CACHE)/fuzz-corpus/$$t corpus/$$t $(FUZZ_CACHE)/fuzz-seeds/$$t -- \
			-max_total_time=$(FUZZ_SECONDS) -seed=$(FUZZ_SEED) -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
			-print_final_stats=1 2>&1 | grep -E 'stat::number_of_executed_units|Done|ERROR|SUMMARY|panicked|^error' ; \
		test $${PIPESTATUS[0]} -eq 0 || exit 1; \
	done

# A short, seeded run of every fuzz target: part of `make test`. Without
# AddressSanitizer: the workspace denies unsafe code, so it would look for
# what cannot happen in our code, and it doubled a cold build (with the real
# gangway-proto's dependencies, 7.6 minutes; with its messages alone and no
# sanitizer, 3.3), and at opt-level 1 (a cold build of 2.2 minutes against
# 3.1 at 3; it runs fewer inputs in its 10 seconds, the point being to find
# what any input breaks). `make fuzz` keeps both (each in a target directory
# of its own: their flags differ, so one would rebuild the other's every time).
fuzz-smoke:
	@$(MAKE) --no-print-directory fuzz FUZZ_SECONDS=10 FUZZ_SEED=1 FUZZ_SANITIZER=none FUZZ_OPT_LEVEL=1

# The test suite: what CI runs. The tests are built before the previous
# build, which then starts from the dependencies they built.
test: setup fuzz-smoke
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(CARGO) nextest run --workspace --no-run && \
		$(MAKE) --no-print-directory previous && \
		$(CARGO) nextest run --workspace --no-fail-fast; \
	else \
		$(CARGO) test --workspace --no-run && \
		$(MAKE) --no-print-directory previous && \
		$(CARGO) test --workspace --no-fail-fast; \
	fi
	@$(MAKE) --no-print-directory image-check k8s-check deb-check console-check

# Part of `make test`: the web console in headless Chromium against a dev
# cluster; screenshots of every page land in $(CARGO_TARGET_DIR)/console-screenshots.
console-check:
	controller/tests/console/check.sh $(BIN) $(CARGO_TARGET_DIR)/console-screenshots

# Part of `make test`: the Kubernetes manifests against Kubernetes' schemas
# (kubernetes-validate, from PyPI) and their flags against the binary.
k8s-check:
	deploy/kubernetes/check.sh $(BIN)

# Gangway's OCI image, from scratch with buildah (no registry, no daemon):
# the release binary, its libraries and an unprivileged user. Written to
# $(CARGO_TARGET_DIR)/image/gangway-image.tar and tagged localhost/gangway:VERSION.
image: setup
	$(CARGO) build --release --bin gangway
	deploy/image/build.sh $(RELEASE_BIN) $(CARGO_TARGET_DIR)/image localhost/gangway:$$($(RELEASE_BIN) --version | cut -d' ' -f2)
	deploy/image/check.sh $(CARGO_TARGET_DIR)/image/gangway-image.tar

# Gangway's Debian package (dpkg-deb): the release binary, Slurm's command
# names, hardened systemd units and their option files. Written to
# $(CARGO_TARGET_DIR)/deb/gangway_VERSION_ARCH.deb.
deb: setup
	$(CARGO) build --release --bin gangway
	deploy/deb/build.sh $(RELEASE_BIN) $(CARGO_TARGET_DIR)/deb
	deploy/deb/check.sh $(RELEASE_BIN)

# Part of `make test`: the package of the test build, checked offline
# (fields, files, dependencies, a dpkg unpack, the units' sandbox rating).
deb-check:
	deploy/deb/check.sh $(BIN)

# Part of `make test`: the test build's image, built the same way and checked
# (config, files, and its binary run from the image's root file system).
image-check:
	deploy/image/build.sh $(BIN) $(CARGO_TARGET_DIR)/image-check localhost/gangway:check
	deploy/image/check.sh $(CARGO_TARGET_DIR)/image-check/gangway-image.tar
	@buildah rmi localhost/gangway:check >/dev/null

# The deterministic whole-cluster simulation over many seeds (CI runs 200 in
# `make test`); a failing seed prints how to replay it with its trace.
SEEDS ?= 10000
SEED_FIRST ?= 1
sim:
	$(CARGO) run --quiet -p gangway-sim -- --seeds $(SEEDS) --first $(SEED_FIRST)
	$(CARGO) run --quiet -p gangway-sim -- --seeds $$(( $(SEEDS) / 10 )) --first $(SEED_FIRST) --shim

# Read-only checks: formatting, lints, tests.
verify: setup
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(MAKE) test

# Rewrites: formatting and machine-applicable lint fixes.
fix:
	$(CARGO) fmt --all
	$(CARGO) clippy --workspace --all-targets --fix --allow-dirty --allow-staged

# Benchmarks print numbers; they are never pass/fail.
# Benchmarks run the release profile (a second build, ~20 minutes cold; CI
# and `make test` never build it). Each starts and stops its own cluster.
RELEASE_BIN := $(CARGO_TARGET_DIR)/release/gangway
bench: setup
	$(CARGO) build --release --bin gangway
	$(RELEASE_BIN) bench submit --clients 1,16,64 --seconds 5
	$(RELEASE_BIN) bench jobs --jobs 500 --nodes 4
	$(RELEASE_BIN) bench failover --runs 10
	$(RELEASE_BIN) bench sched --pending 100000,1000000
	$(RELEASE_BIN) bench fleet --nodes 1000 --seconds 30
	$(RELEASE_BIN) bench fleet --nodes 10000 --seconds 60 --connections 128 --gang-nodes 4096 --failover
	$(RELEASE_BIN) bench fleet --nodes 10000 --seconds 60 --connections 128 --preload-running 100000 --preload-pending 100000

# Slurm (slurmctld, 8 emulated slurmd nodes, munge) and a 3-member etcd,
# installed from Debian's packages when missing (root), raced against Gangway
# on this machine in one run: one Markdown table with the ratios, also left in
# $(CARGO_TARGET_DIR)/bench-peers.md. Never part of `make test`.
PEER_PACKAGES := slurmctld slurmd slurm-client munge etcd-server
bench-peers: setup
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && command -v etcd >/dev/null || { \
		echo "installing the peers from Debian's packages: $(PEER_PACKAGES)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -q $(PEER_PACKAGES) || { apt-get update -q && apt-get install -y -q $(PEER_PACKAGES); }; }
	$(CARGO) build --release --bin gangway
	$(RELEASE_BIN) bench peers --out $(CARGO_TARGET_DIR)/bench-peers.md

# Chaos scenarios on real multi-host clusters (network namespaces; needs root).
# `make chaos` runs every scenario once; SCENARIO, SEED and DURATION (seconds of
# load) pick one run, e.g. `make chaos SCENARIO=partitions SEED=7 DURATION=30`.
SCENARIO ?= all
SEED ?= 1
DURATION ?= 12
CHAOS := $(CARGO_TARGET_DIR)/debug/gangway-chaos
chaos: build previous
	$(CARGO) build -p gangway-chaos-tests --bin gangway-chaos
	$(CHAOS) --scenario $(SCENARIO) --seed $(SEED) --duration $(DURATION)

# The chaos matrix, longer: five seeds per scenario, 60 s of load each; the
# results table goes to chaos-results.md.
chaos-long: build previous
	$(CARGO) build -p gangway-chaos-tests --bin gangway-chaos
	$(CHAOS) --scenario all --seed $(SEED) --runs 5 --duration 60 --results chaos-results.md
