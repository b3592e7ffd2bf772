# Gangway: the two commands a newcomer needs are `make dev` and `make test`.
# Builds share one target directory outside the clone so repeated runs (and CI
# on the same machine) stay warm; RocksDB's C++ takes ~15 minutes cold.
export CARGO_TARGET_DIR ?= $(HOME)/.cache/gangway/target
CARGO ?= cargo
BIN := $(CARGO_TARGET_DIR)/debug/gangway

.PHONY: setup build dev test verify fix bench chaos chaos-long

setup:
	@bash deploy/setup-debian.sh

build: setup
	$(CARGO) build --bin gangway
	@mkdir -p bin && ln -sf $(BIN) bin/gangway

# Starts a 3-replica controller cluster with simulated GPU nodes; Ctrl-C stops it.
dev: build
	bin/gangway dev

# The test suite: what CI runs.
test: setup
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(CARGO) nextest run --workspace --no-fail-fast; \
	else \
		$(CARGO) test --workspace --no-fail-fast; \
	fi

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
bench: build
	bin/gangway bench submit --clients 1,16,64 --seconds 5
	bin/gangway bench jobs --jobs 500 --nodes 4
	bin/gangway bench failover --runs 10
	bin/gangway bench sched --pending 100000,1000000

# Chaos scenarios on real multi-host clusters (network namespaces; needs root).
# `make chaos` runs every scenario once; SCENARIO, SEED and DURATION (seconds of
# load) pick one run, e.g. `make chaos SCENARIO=partitions SEED=7 DURATION=30`.
SCENARIO ?= all
SEED ?= 1
DURATION ?= 12
CHAOS := $(CARGO_TARGET_DIR)/debug/gangway-chaos
chaos: build
	$(CARGO) build -p gangway-chaos-tests --bin gangway-chaos
	$(CHAOS) --scenario $(SCENARIO) --seed $(SEED) --duration $(DURATION)

# The chaos matrix, longer: five seeds per scenario, 60 s of load each; the
# results table goes to chaos-results.md.
chaos-long: build
	$(CARGO) build -p gangway-chaos-tests --bin gangway-chaos
	$(CHAOS) --scenario all --seed $(SEED) --runs 5 --duration 60 --results chaos-results.md
