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
# CHAOS_SEED picks the fault schedule, CHAOS_DURATION_S the loaded phase.
chaos: build
	$(CARGO) nextest run -p gangway-chaos-tests --no-capture

# The chaos matrix, longer: several seeds per scenario, results as a Markdown table.
chaos-long: build
	@echo "| scenario | seed | submits | acknowledged | faults | violations | worst submit | recovery |" > chaos-results.md
	@echo "|---|---:|---:|---:|---:|---:|---:|---:|" >> chaos-results.md
	for seed in 1 2 3 4 5; do CHAOS_SEED=$$seed CHAOS_DURATION_S=60 CHAOS_RESULTS=$(CURDIR)/chaos-results.md \
		$(CARGO) nextest run -p gangway-chaos-tests --no-capture || exit 1; done
	@cat chaos-results.md
