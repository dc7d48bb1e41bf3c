# copse: the commands a newcomer and CI need. `make test` is exactly what CI runs (.ci/run).

CARGO ?= cargo
SHELL := /bin/bash

# Python packages the tests need, installed by `make test-deps`: the server's tests talk to a real
# `copse serve` with redis-py (tests/server/), and run Celery and Django's cache on it
# (tests/server/test_apps.py).
PYTHON ?= python3
PYTHON_TEST_PACKAGES ?= redis pytest celery django django-redis

.PHONY: build run test lint-default-build profile profile-deps test-deps test-rocksdb rocksdb-test-deps fmt clippy bench bench-deps bench-sharded bench-placement torture fuzz fuzz-deps

build:
	$(CARGO) build --release -p copse-cli

# The server on 127.0.0.1:6380 with data in ./data; stop it with Ctrl-C (a clean shutdown).
run: build
	@echo "copse: starting the server on 127.0.0.1:6380 (data in ./data). Connect with: redis-cli -p 6380"
	./target/release/copse --path ./data serve --bind 127.0.0.1 --port 6380

# `apt-get update` once per checkout, before the first `apt-get install` (a fresh machine may
# have no package lists at all); a stamp under target/ remembers it was done.
APT_UPDATE_ONCE = { test -f target/.apt-updated || { apt-get update -qq >/dev/null && mkdir -p target && touch target/.apt-updated; }; }

# Everything the tests need beyond cargo. redis-cli is optional (its tests skip without it); it is
# installed where apt can do it.
test-deps:
ifneq ($(strip $(PYTHON_TEST_PACKAGES)),)
	$(PYTHON) -m pip install --quiet $(PYTHON_TEST_PACKAGES)
endif
	@command -v redis-cli >/dev/null || (command -v apt-get >/dev/null && $(APT_UPDATE_ONCE) && apt-get install -y -qq redis-tools >/dev/null 2>&1) || echo "make: redis-cli not installed; its tests will be skipped"
	@# redis-server: the oracle of the differential tests (tests/server/test_expiry.py), which fail without it.
	@command -v redis-server >/dev/null || (command -v apt-get >/dev/null && $(APT_UPDATE_ONCE) && apt-get install -y -qq redis-server >/dev/null 2>&1) || echo "make: redis-server not installed; the differential tests will fail"

# Release mode: the crash tests run many seeds each, and are slow unoptimised. The last line
# totals every test binary's result (cargo's own last line is a doc-test run with no tests).
# Seconds each fuzz target runs in `make test` (tests/fuzz.rs of copse and copse-server).
FUZZ_SECONDS ?= 60

test: test-deps
	@mkdir -p target
	$(PYTHON) scripts/check_layers.py
	$(MAKE) --no-print-directory lint-default-build
	set -o pipefail; COPSE_FUZZ_SECONDS=$(FUZZ_SECONDS) CARGO_TERM_COLOR=never $(CARGO) test --workspace --release 2>&1 | tee target/test-output.log
	$(CARGO) build --release -p copse-cli
	set -o pipefail; $(PYTHON) -m pytest -q -p no:cacheprovider tests/server 2>&1 | tee target/test-server-output.log
	$(MAKE) --no-print-directory test-rocksdb
	@awk '/^test result:/ { passed += $$4; failed += $$6 } END { printf "rust tests: %d passed, %d failed\n", passed, failed }' target/test-output.log
	@tail -n 1 target/test-server-output.log | sed 's/^/server tests (redis-py): /'
	@awk '/^test result:/ { passed += $$4; failed += $$6 } END { printf "rocksdb engine tests: %d passed, %d failed\n", passed, failed }' target/test-rocksdb-output.log

# The engine-generic tests over the RocksDB engine (COPSE_TEST_ENGINE=rocksdb). A bundled RocksDB
# build takes ~20 minutes here, too long for CI; so these tests link Debian's librocksdb 7.8
# through rocksdb 0.20 (seconds). Cargo allows one RocksDB per workspace lock, and the benchmark
# needs 0.25, so the copse crate is tested from a workspace of its own under target/: the same
# sources and lock, with rocksdb pinned to 0.20.1. Published benchmark numbers never come from
# this build (see docs/engines.md).
ROCKSDB_CI_DIR := target/rocksdb-ci
ROCKSDB_SYSTEM_LIB_DIR ?= /usr/lib/x86_64-linux-gnu
ROCKSDB_CI_TESTS ?= --test basic --test model --test kill --test scan --test exec --test engines --test batches --test large_batches --test idle
# Native-only tests in those files: the simulated device, slab files, copse's device counters,
# clustering (append placement).
ROCKSDB_CI_SKIP := --skip simulated --skip updates_alternating_between_small_and_large \
	--skip size_class_opened_while_writes --skip a_scan_reads_only_the_items_it_returns \
	--skip cluster

rocksdb-test-deps:
	@ls $(ROCKSDB_SYSTEM_LIB_DIR)/librocksdb.so >/dev/null 2>&1 && ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 || { $(APT_UPDATE_ONCE) && apt-get install -y -qq librocksdb-dev libclang-dev >/dev/null; }

test-rocksdb: rocksdb-test-deps
	@mkdir -p $(ROCKSDB_CI_DIR)/workspace
	rm -rf $(ROCKSDB_CI_DIR)/workspace/crates && mkdir -p $(ROCKSDB_CI_DIR)/workspace/crates
	cp -r crates/copse $(ROCKSDB_CI_DIR)/workspace/crates/
	sed 's|^members = .*|members = ["crates/copse"]|' Cargo.toml > $(ROCKSDB_CI_DIR)/workspace/Cargo.toml
	cp Cargo.lock $(ROCKSDB_CI_DIR)/workspace/Cargo.lock
	cd $(ROCKSDB_CI_DIR)/workspace && $(CARGO) update --quiet -p rocksdb --precise 0.20.1
	set -o pipefail; cd $(ROCKSDB_CI_DIR)/workspace && CARGO_TERM_COLOR=never ROCKSDB_LIB_DIR=$(ROCKSDB_SYSTEM_LIB_DIR) \
		CARGO_TARGET_DIR=../target COPSE_TEST_ENGINE=rocksdb \
		$(CARGO) test --release -p copse --features rocksdb $(ROCKSDB_CI_TESTS) -- $(ROCKSDB_CI_SKIP) 2>&1 | tee ../../test-rocksdb-output.log

fmt:
	$(CARGO) fmt --all

clippy: lint-default-build
	$(CARGO) clippy --all-targets -- -D warnings

# The libraries as users build them (without the `testing` feature, which every test target
# turns on): code only tests reach shows up here as dead, and fails. Then each crate's own
# targets on their own, as `make torture` builds them: the workspace-wide build unifies
# features across crates and would hide a crate whose tests need a feature it does not ask for.
lint-default-build:
	$(CARGO) clippy -p copse -p copse-server --lib -- -D warnings
	for crate in copse copse-server copse-bench copse-cli; do $(CARGO) check -q -p $$crate --all-targets || exit 1; done

# The standard comparison (docs/benchmarks.md): copse against RocksDB, built with the rocksdb
# feature (a bundled RocksDB 11 build: ~20 minutes on 2 cores the first time, then cached; needs
# libclang for bindgen). It probes the device, runs YCSB load, A, B, C, F, E (uniform and zipfian,
# 1 KiB records, dataset > 3x the cache), then load and A with 128-B records, then A open-loop at
# 80% of copse's peak; engines alternate run by run. It rewrites the sections between the
# copse-bench markers in docs/benchmarks.md and the plots in docs/bench/. About 25 minutes
# (24 measured on 2026-11-22), plus the first RocksDB build.
BENCH_DIR ?= ./bench-data
BENCH_REPEATS ?= 3
BENCH_SECONDS ?= 15
BENCH_CACHE_MB ?= 64
BENCH_RECORDS ?= 220000
BENCH_SMALL_CACHE_MB ?= 16
BENCH_SMALL_RECORDS ?= 400000
BENCH_THREADS ?= 16
BENCH_ENGINES ?= rocksdb,copse
# RocksDB picks hardware CRC32C (SSE4.2, PCLMUL) only when the build targets a CPU that has it;
# target-cpu=native serves both engines alike. A target dir of its own keeps these flags from
# invalidating the `make test` build.
BENCH_TARGET_DIR ?= target/bench
COPSE_BENCH = $(BENCH_TARGET_DIR)/release/copse

# Flame graphs of the server under redis-benchmark (1 KiB values, 50 clients, pipeline 16),
# GET and SET, sampled with `perf record -g` for 10 s each, into docs/bench/profile/ (SVG; the
# perf data stays in target/perf). Needs perf and redis-benchmark (installed by profile-deps).
PROFILE_PORT ?= 6391
profile-deps:
	@command -v perf >/dev/null || (command -v apt-get >/dev/null && $(APT_UPDATE_ONCE) && apt-get install -y -qq linux-perf >/dev/null) || echo "make: perf not installed"
	@command -v redis-benchmark >/dev/null || (command -v apt-get >/dev/null && $(APT_UPDATE_ONCE) && apt-get install -y -qq redis-tools >/dev/null) || echo "make: redis-benchmark not installed"

profile: profile-deps build
	@mkdir -p docs/bench/profile
	for op in get set; do \
		scripts/profile_server.sh server-$$op target/release/copse $(PROFILE_PORT) $$op && \
		./target/release/copse bench flamegraph --perf-data target/perf/server-$$op.data \
			--svg docs/bench/profile/server-$$op.svg \
			--title "copse serve under redis-benchmark -t $$op -d 1024 -c 50 -P 16 ($$(date -u +%F), $$(git rev-parse --short HEAD))" \
			|| exit 1; \
		tr "\r" "\n" < target/perf/server-$$op.bench.txt | grep . | tail -n 1; \
	done

bench-deps:
	@ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 || (command -v apt-get >/dev/null && $(APT_UPDATE_ONCE) && apt-get install -y -qq libclang-dev >/dev/null) || echo "make: libclang not found; the rocksdb crate's bindgen needs it"

bench: bench-deps
	RUSTFLAGS="-C target-cpu=native" CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) $(CARGO) build --release -p copse-cli --features rocksdb
	@mkdir -p $(BENCH_DIR) docs/bench
	$(COPSE_BENCH) bench device --dir $(BENCH_DIR) --json $(BENCH_DIR)/device.json --quiet \
		--doc docs/benchmarks.md --section device
	$(COPSE_BENCH) --cache-mb $(BENCH_CACHE_MB) bench compare --engines $(BENCH_ENGINES) \
		--repeats $(BENCH_REPEATS) --records $(BENCH_RECORDS) --record-bytes 1024 --threads $(BENCH_THREADS) \
		--phases a@uniform,a@zipfian,b@uniform,b@zipfian,c@uniform,c@zipfian,f@uniform,f@zipfian,e@uniform,e@zipfian \
		--seconds $(BENCH_SECONDS) --dir $(BENCH_DIR) --device-json $(BENCH_DIR)/device.json \
		--open-phases a@zipfian --open-fraction 0.8 --open-reference copse \
		--out-dir $(BENCH_DIR)/standard --plots-dir docs/bench/standard \
		--doc docs/benchmarks.md --section standard --title "Standard comparison: YCSB, 1 KiB records"
	$(COPSE_BENCH) --cache-mb $(BENCH_SMALL_CACHE_MB) bench compare --engines $(BENCH_ENGINES) \
		--repeats $(BENCH_REPEATS) --records $(BENCH_SMALL_RECORDS) --record-bytes 128 --threads $(BENCH_THREADS) \
		--phases a@uniform,a@zipfian --seconds $(BENCH_SECONDS) --dir $(BENCH_DIR) \
		--device-json $(BENCH_DIR)/device.json --out-dir $(BENCH_DIR)/small --plots-dir docs/bench/small \
		--doc docs/benchmarks.md --section small --title "Small records: YCSB load and A, 128-B records"

# Sharding RocksDB (p2KVS, docs/benchmarks.md "Sharding RocksDB"): one RocksDB, copse's router over
# one RocksDB per shard (rocksdb-sharded) and copse, YCSB load and A with 1 KiB and 128-B records.
# About 15 minutes after the build.
SHARDED_ENGINES ?= rocksdb,rocksdb-sharded,copse

bench-sharded: bench-deps
	RUSTFLAGS="-C target-cpu=native" CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) $(CARGO) build --release -p copse-cli --features rocksdb
	@mkdir -p $(BENCH_DIR) docs/bench
	$(COPSE_BENCH) --cache-mb $(BENCH_CACHE_MB) bench compare --engines $(SHARDED_ENGINES) \
		--repeats $(BENCH_REPEATS) --records $(BENCH_RECORDS) --record-bytes 1024 --threads $(BENCH_THREADS) \
		--phases a@uniform,a@zipfian --seconds $(BENCH_SECONDS) --dir $(BENCH_DIR) \
		--out-dir $(BENCH_DIR)/sharded-1k --plots-dir docs/bench/sharded-1k \
		--doc docs/benchmarks.md --section sharded-1k --title "Sharding RocksDB: YCSB load and A, 1 KiB records"
	$(COPSE_BENCH) --cache-mb $(BENCH_SMALL_CACHE_MB) bench compare --engines $(SHARDED_ENGINES) \
		--repeats $(BENCH_REPEATS) --records $(BENCH_SMALL_RECORDS) --record-bytes 128 --threads $(BENCH_THREADS) \
		--phases a@uniform,a@zipfian --seconds $(BENCH_SECONDS) --dir $(BENCH_DIR) \
		--out-dir $(BENCH_DIR)/sharded-128 --plots-dir docs/bench/sharded-128 \
		--doc docs/benchmarks.md --section sharded-128 --title "Sharding RocksDB: YCSB load and A, 128-B records"

# Placement (docs/placement.md, docs/benchmarks.md "Placement"): copse with every in-page class
# in place, appended, and as `auto` chose from its write probe, against one RocksDB and copse's
# router over RocksDB, YCSB load and A with 1 KiB and 128-B records. About 30 minutes after the
# build.
PLACEMENT_ENGINES ?= copse-in-place,copse-append,copse,rocksdb,rocksdb-sharded

bench-placement: bench-deps
	RUSTFLAGS="-C target-cpu=native" CARGO_TARGET_DIR=$(BENCH_TARGET_DIR) $(CARGO) build --release -p copse-cli --features rocksdb
	@mkdir -p $(BENCH_DIR) docs/bench
	$(COPSE_BENCH) bench device --dir $(BENCH_DIR) --json $(BENCH_DIR)/device.json --quiet
	$(COPSE_BENCH) --cache-mb $(BENCH_CACHE_MB) bench compare --engines $(PLACEMENT_ENGINES) \
		--repeats $(BENCH_REPEATS) --records $(BENCH_RECORDS) --record-bytes 1024 --threads $(BENCH_THREADS) \
		--phases a@uniform,a@zipfian --seconds $(BENCH_SECONDS) --dir $(BENCH_DIR) \
		--device-json $(BENCH_DIR)/device.json --out-dir $(BENCH_DIR)/placement-1k \
		--plots-dir docs/bench/placement-1k --doc docs/benchmarks.md --section placement-1k \
		--title "Placement: YCSB load and A, 1 KiB records"
	$(COPSE_BENCH) --cache-mb $(BENCH_SMALL_CACHE_MB) bench compare --engines $(PLACEMENT_ENGINES) \
		--repeats $(BENCH_REPEATS) --records $(BENCH_SMALL_RECORDS) --record-bytes 128 --threads $(BENCH_THREADS) \
		--phases a@uniform,a@zipfian --seconds $(BENCH_SECONDS) --dir $(BENCH_DIR) \
		--device-json $(BENCH_DIR)/device.json --out-dir $(BENCH_DIR)/placement-128 \
		--plots-dir docs/bench/placement-128 --doc docs/benchmarks.md --section placement-128 \
		--title "Placement: YCSB load and A, 128-B records"

# The long reliability run (docs/reliability.md): each fuzz target for TORTURE_FUZZ_INPUTS inputs
# (in-tree, then coverage-guided), the deterministic simulator (tests/sim.rs) and the
# simulated-device crash tests (every acknowledged write, and cross-shard batches): TORTURE_SEEDS
# simulator seeds, TORTURE_COLLECTOR_SEEDS of its collector scenario, TORTURE_LOST_SEEDS of its
# lost-then-crash measurement, TORTURE_POWER_LOSS_SEEDS
# runs of the power-loss test with TORTURE_POWER_LOSS_CUTS cuts each, and TORTURE_CRASH_SEEDS
# seeds of each crash test (they use real threads and take
# both cores, about 20 seeds a second), TORTURE_WRITE_GROUP_CRASH_RUNS crash runs of a hot key's
# write groups (tests/write_groups.rs, ~200 a second), TORTURE_KILL_CYCLES kill -9 cycles of a writing process and of
# `copse serve` under pipelined load, and as many kill -9 rounds of `copse serve` whose
# GET/SET/DEL/INCR histories are checked for linearizability. scripts/torture.sh splits the seeds
# over one process per core, runs every step even if one fails, and ends with a table of exits
# and times; every figure goes to target/torture.log, and scripts/torture_summary.py adds up the
# lanes into target/torture-summary.md. About an hour on 2 cores.
TORTURE_SEEDS ?= 100000
TORTURE_COLLECTOR_SEEDS ?= 20000
TORTURE_LOST_SEEDS ?= 3000
TORTURE_CRASH_SEEDS ?= 20000
TORTURE_WRITE_GROUP_CRASH_RUNS ?= 20000
TORTURE_POWER_LOSS_SEEDS ?= 10
TORTURE_POWER_LOSS_CUTS ?= 100
TORTURE_KILL_CYCLES ?= 1000
TORTURE_FUZZ_INPUTS ?= 10000000

# Coverage-guided fuzzing (fuzz/: cargo-fuzz, libFuzzer, on nightly) of the same targets the
# in-tree fuzzer runs in `make test`: FUZZ_RUNS inputs per target, from seed corpora written by
# the fuzz_corpus example into fuzz/corpus (kept between runs; findings go to fuzz/artifacts).
FUZZ_TARGETS := slab_page manifest resp_request
FUZZ_RUNS ?= 1000000

fuzz-deps:
	@rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked

fuzz: fuzz-deps
	$(CARGO) run -q --release -p copse-server --example fuzz_corpus -- fuzz/corpus
	set -e; for target in $(FUZZ_TARGETS); do \
	  $(CARGO) +nightly fuzz run --sanitizer none $$target fuzz/corpus/$$target -- \
	    -runs=$(FUZZ_RUNS) -max_len=8192 -print_final_stats=1; \
	done

torture: test-deps fuzz-deps build
	@mkdir -p target
	set -o pipefail; CARGO="$(CARGO)" PYTHON="$(PYTHON)" TORTURE_SEEDS=$(TORTURE_SEEDS) \
	  TORTURE_COLLECTOR_SEEDS=$(TORTURE_COLLECTOR_SEEDS) TORTURE_LOST_SEEDS=$(TORTURE_LOST_SEEDS) \
	  TORTURE_CRASH_SEEDS=$(TORTURE_CRASH_SEEDS) TORTURE_WRITE_GROUP_CRASH_RUNS=$(TORTURE_WRITE_GROUP_CRASH_RUNS) \
	  TORTURE_POWER_LOSS_SEEDS=$(TORTURE_POWER_LOSS_SEEDS) TORTURE_POWER_LOSS_CUTS=$(TORTURE_POWER_LOSS_CUTS) \
	  TORTURE_KILL_CYCLES=$(TORTURE_KILL_CYCLES) TORTURE_FUZZ_INPUTS=$(TORTURE_FUZZ_INPUTS) \
	  scripts/torture.sh 2>&1 | tee target/torture.log; status=$$?; \
	  $(PYTHON) scripts/torture_summary.py target/torture.log | tee target/torture-summary.md; \
	  exit $$status
