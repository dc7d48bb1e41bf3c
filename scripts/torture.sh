#!/usr/bin/env bash
# The long reliability run behind `make torture` (docs/reliability.md).
#
# Every step runs even when an earlier one fails: a run takes hours, and one failing step should
# not hide what the others would find. Each step's wall time and exit status are printed as it
# ends, and a summary table closes the run; the script exits non-zero if any step failed.
#
# Env: CARGO, PYTHON, TORTURE_SEEDS, TORTURE_KILL_CYCLES, TORTURE_FUZZ_INPUTS (set by the Makefile).
set -u -o pipefail

CARGO=${CARGO:-cargo}
PYTHON=${PYTHON:-python3}
SEEDS=${TORTURE_SEEDS:?}
KILL_CYCLES=${TORTURE_KILL_CYCLES:?}
FUZZ_INPUTS=${TORTURE_FUZZ_INPUTS:?}

summary=()
failed=0

step() {
    local name=$1
    shift
    echo "=== torture step: $name ($(date -u '+%Y-%m-%d %H:%M:%S UTC'))"
    local started=$SECONDS
    env "$@"
    local status=$?
    local took=$((SECONDS - started))
    echo "=== torture step: $name: exit $status after ${took} s"
    summary+=("$(printf '%-22s exit %-3d %6d s' "$name" "$status" "$took")")
    [ "$status" -eq 0 ] || failed=1
}

echo "=== torture: commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(nproc) cores, seeds $SEEDS, kill cycles $KILL_CYCLES, fuzz inputs $FUZZ_INPUTS"

step fuzz-copse COPSE_FUZZ_INPUTS="$FUZZ_INPUTS" COPSE_FUZZ_SECONDS=86400 \
    "$CARGO" test --release -p copse --test fuzz -- --nocapture --test-threads 1
step fuzz-server COPSE_FUZZ_INPUTS="$FUZZ_INPUTS" COPSE_FUZZ_SECONDS=86400 \
    "$CARGO" test --release -p copse-server --test fuzz -- --nocapture
step fuzz-coverage-guided make --no-print-directory fuzz CARGO="$CARGO" FUZZ_RUNS="$FUZZ_INPUTS"
step simulator COPSE_SIM_SEEDS="$SEEDS" COPSE_SIM_KEEP_GOING=1 \
    "$CARGO" test --release -p copse --test sim seeded_simulation -- --nocapture
step crash COPSE_CRASH_SEEDS="$SEEDS" \
    "$CARGO" test --release -p copse --test crash every_acknowledged_write -- --nocapture
step batch-crash COPSE_BATCH_CRASH_SEEDS="$SEEDS" \
    "$CARGO" test --release -p copse --test batches simulated -- --nocapture
step kill-writer COPSE_KILL_CYCLES="$KILL_CYCLES" \
    "$CARGO" test --release -p copse --test kill -- --nocapture
step linearizability COPSE_LIN_ROUNDS="$KILL_CYCLES" \
    "$CARGO" test --release -p copse-cli --test linearizability -- --nocapture
step kill-server COPSE_SERVER_KILL_CYCLES="$KILL_CYCLES" \
    "$PYTHON" -m pytest -q -s -p no:cacheprovider tests/server/test_crash.py -k sigkill

echo "=== torture summary"
printf '%s\n' "${summary[@]}"
if [ "$failed" -ne 0 ]; then
    echo "=== torture: FAILED"
    exit 1
fi
echo "=== torture: every step passed"
