# copse: the commands a newcomer and CI need. `make test` is exactly what CI runs (.ci/run).

CARGO ?= cargo
SHELL := /bin/bash

# Python packages the tests need, installed by `make test-deps`: the server's tests talk to a real
# `copse serve` with redis-py (tests/server/).
PYTHON ?= python3
PYTHON_TEST_PACKAGES ?= redis pytest

.PHONY: build run test test-deps fmt clippy bench

build:
	$(CARGO) build --release -p copse-cli

# The server on 127.0.0.1:6380 with data in ./data; stop it with Ctrl-C (a clean shutdown).
run: build
	@echo "copse: starting the server on 127.0.0.1:6380 (data in ./data). Connect with: redis-cli -p 6380"
	./target/release/copse --path ./data serve --bind 127.0.0.1 --port 6380

# Everything the tests need beyond cargo. redis-cli is optional (its tests skip without it); it is
# installed where apt can do it.
test-deps:
ifneq ($(strip $(PYTHON_TEST_PACKAGES)),)
	$(PYTHON) -m pip install --quiet $(PYTHON_TEST_PACKAGES)
endif
	@command -v redis-cli >/dev/null || (command -v apt-get >/dev/null && apt-get install -y -qq redis-tools >/dev/null 2>&1) || echo "make: redis-cli not installed; its tests will be skipped"

# Release mode: the crash tests run many seeds each, and are slow unoptimised. The last line
# totals every test binary's result (cargo's own last line is a doc-test run with no tests).
test: test-deps
	@mkdir -p target
	set -o pipefail; CARGO_TERM_COLOR=never $(CARGO) test --workspace --release 2>&1 | tee target/test-output.log
	$(CARGO) build --release -p copse-cli
	set -o pipefail; $(PYTHON) -m pytest -q -p no:cacheprovider tests/server 2>&1 | tee target/test-server-output.log
	@awk '/^test result:/ { passed += $$4; failed += $$6 } END { printf "rust tests: %d passed, %d failed\n", passed, failed }' target/test-output.log
	@tail -n 1 target/test-server-output.log | sed 's/^/server tests (redis-py): /'

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --all-targets -- -D warnings

# The API benchmark (crates/copse/examples/api_bench.rs); it removes ./bench-data when done.
bench:
	$(CARGO) run --release --example api_bench -p copse -- --path ./bench-data
