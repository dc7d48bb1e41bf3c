# copse: the commands a newcomer and CI need. `make test` is exactly what CI runs (.ci/run).

CARGO ?= cargo
SHELL := /bin/bash

# Python packages the tests need, installed by `make test-deps`. None yet; the RESP server's tests
# will add `redis` (the client they talk to the server with).
PYTHON ?= python3
PYTHON_TEST_PACKAGES ?=

.PHONY: build run test test-deps fmt clippy bench

build:
	$(CARGO) build --release -p copse-cli

# A first write and read on a real store in ./data. The server issue turns this into
# `copse serve` (then try it with `redis-cli -p 6380`).
run: build
	./target/release/copse --path ./data demo

# Everything the tests need beyond cargo.
test-deps:
ifneq ($(strip $(PYTHON_TEST_PACKAGES)),)
	$(PYTHON) -m pip install --quiet $(PYTHON_TEST_PACKAGES)
endif

# Release mode: the crash tests run many seeds each, and are slow unoptimised. The last line
# totals every test binary's result (cargo's own last line is a doc-test run with no tests).
test: test-deps
	@mkdir -p target
	set -o pipefail; CARGO_TERM_COLOR=never $(CARGO) test --workspace --release 2>&1 | tee target/test-output.log
	@awk '/^test result:/ { passed += $$4; failed += $$6 } END { printf "tests: %d passed, %d failed\n", passed, failed }' target/test-output.log

fmt:
	$(CARGO) fmt --all

clippy:
	$(CARGO) clippy --all-targets -- -D warnings

# The API benchmark (crates/copse/examples/api_bench.rs); it removes ./bench-data when done.
bench:
	$(CARGO) run --release --example api_bench -p copse -- --path ./bench-data
