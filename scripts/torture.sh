#!/usr/bin/env bash
# The long reliability run behind `make torture` (docs/reliability.md).
#
# Every step runs even when an earlier one fails: a run takes hours, and one failing step should
# not hide what the others would find. Each step's wall time and exit status are printed as it
# ends, and a summary table closes the run; the script exits non-zero if any step failed.
#
# The seeded tests (simulator, crash, batch crash) each keep about one core busy, so their seeds
# are split over TORTURE_LANES processes (default: one per core) that run at once, each over its
# own range of seeds; the two kill loops run side by side. Each lane's output is kept in
# target/torture-logs and printed whole when its step ends.
#
# Env: CARGO, PYTHON, TORTURE_SEEDS (the simulator), TORTURE_COLLECTOR_SEEDS (its collector
# scenario), TORTURE_LOST_SEEDS (its lost-then-crash measurement), TORTURE_CRASH_SEEDS (each crash test), TORTURE_POWER_LOSS_SEEDS and
# TORTURE_POWER_LOSS_CUTS (the power-loss test of the real backends), TORTURE_WRITE_GROUP_CRASH_RUNS
# (crash runs of a hot key's write groups), TORTURE_KILL_CYCLES,
# TORTURE_FUZZ_INPUTS (set by the Makefile), TORTURE_LANES, TORTURE_STEPS (run only these steps).
set -u -o pipefail

CARGO=${CARGO:-cargo}
PYTHON=${PYTHON:-python3}
SEEDS=${TORTURE_SEEDS:?}
COLLECTOR_SEEDS=${TORTURE_COLLECTOR_SEEDS:?}
LOST_SEEDS=${TORTURE_LOST_SEEDS:?}
POWER_LOSS_SEEDS=${TORTURE_POWER_LOSS_SEEDS:?}
POWER_LOSS_CUTS=${TORTURE_POWER_LOSS_CUTS:?}
CRASH_SEEDS=${TORTURE_CRASH_SEEDS:?}
WRITE_GROUP_CRASH_RUNS=${TORTURE_WRITE_GROUP_CRASH_RUNS:?}
KILL_CYCLES=${TORTURE_KILL_CYCLES:?}
FUZZ_INPUTS=${TORTURE_FUZZ_INPUTS:?}
LANES=${TORTURE_LANES:-$(nproc)}
# The fewest seeds a lane runs (see `seeded`).
LANE_SEEDS_MIN=1000
LOG_DIR=target/torture-logs
mkdir -p "$LOG_DIR"

summary=()
failed=0

# step NAME COMMAND...: runs the command, records its exit status and wall time. With
# TORTURE_STEPS set (names separated by spaces), only the steps it names run: a partial rerun
# after a change, e.g. TORTURE_STEPS="write-group-crash kill-loops linearizability".
step() {
    local name=$1
    shift
    if [ -n "${TORTURE_STEPS:-}" ] && [[ " $TORTURE_STEPS " != *" $name "* ]]; then
        echo "=== torture step: $name: skipped (not in TORTURE_STEPS)"
        summary+=("$(printf '%-24s skipped' "$name")")
        return 0
    fi
    echo "=== torture step: $name ($(date -u '+%Y-%m-%d %H:%M:%S UTC'))"
    local started=$SECONDS
    "$@"
    local status=$?
    local took=$((SECONDS - started))
    echo "=== torture step: $name: exit $status after ${took} s"
    summary+=("$(printf '%-24s exit %-3d %6d s' "$name" "$status" "$took")")
    [ "$status" -eq 0 ] || failed=1
}

# The path of a release test binary of PACKAGE named TEST (built if needed). The lanes run it
# directly: cargo holds its build-directory lock while `cargo test` runs, so two `cargo test`
# processes would run one after the other.
test_binary() {
    "$CARGO" test --release -p "$1" --test "$2" --no-run --message-format=json |
        "$PYTHON" -c '
import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable"):
        print(message["executable"])'
}

# seeded LOG_NAME SEEDS START_VAR SEEDS_VAR COMMAND...: runs COMMAND in LANES processes at once,
# lane i over its share of SEEDS seeds (START_VAR and SEEDS_VAR name the test's variables).
seeded() {
    local name=$1 seeds=$2 start_var=$3 seeds_var=$4
    shift 4
    # Each lane gets at least LANE_SEEDS_MIN seeds: the tests' aggregate checks (every fault
    # point fired, crashes seen just after a recovery, ...) run only from 1,000 seeds up in one
    # process, so more lanes than that would switch them off.
    local lanes=$((LANES < 1 ? 1 : LANES))
    local lanes_max=$(((seeds + LANE_SEEDS_MIN - 1) / LANE_SEEDS_MIN))
    lanes=$((lanes > lanes_max ? lanes_max : lanes))
    lanes=$((lanes < 1 ? 1 : lanes))
    local per_lane=$(((seeds + lanes - 1) / lanes))
    local pids=() lane first count status=0
    for ((lane = 0; lane < lanes; lane++)); do
        first=$((lane * per_lane))
        count=$((seeds - first < per_lane ? seeds - first : per_lane))
        [ "$count" -gt 0 ] || break
        env "$start_var=$first" "$seeds_var=$count" "$@" >"$LOG_DIR/$name-$lane.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || status=1
    done
    for ((lane = 0; lane < ${#pids[@]}; lane++)); do
        echo "--- $name, lane $lane"
        cat "$LOG_DIR/$name-$lane.log"
    done
    return $status
}

# The power-loss test (tests/power_loss.rs) over seeds 1..POWER_LOSS_SEEDS, each with
# POWER_LOSS_CUTS cut points; stops at the first failing seed.
power_loss() {
    local seed
    for ((seed = 1; seed <= POWER_LOSS_SEEDS; seed++)); do
        echo "--- power loss, seed $seed"
        env COPSE_POWER_LOSS_SEED=$seed COPSE_POWER_LOSS_CUTS="$POWER_LOSS_CUTS" \
            "$CARGO" test --release -p copse --test power_loss -- --nocapture || return 1
    done
}

# The kill -9 loops of a writing process and of `copse serve`, side by side.
kill_loops() {
    local writer server status=0
    env COPSE_KILL_CYCLES="$KILL_CYCLES" "$CARGO" test --release -p copse --test kill -- --nocapture \
        >"$LOG_DIR/kill-writer.log" 2>&1 &
    writer=$!
    env COPSE_SERVER_KILL_CYCLES="$KILL_CYCLES" "$PYTHON" -m pytest -q -s -p no:cacheprovider \
        tests/server/test_crash.py -k sigkill >"$LOG_DIR/kill-server.log" 2>&1 &
    server=$!
    wait "$writer" || status=1
    wait "$server" || status=1
    for log in kill-writer kill-server; do
        echo "--- $log"
        cat "$LOG_DIR/$log.log"
    done
    return $status
}

echo "=== torture: commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(nproc) cores, $LANES lanes, simulator seeds $SEEDS, collector seeds $COLLECTOR_SEEDS, lost-then-crash seeds $LOST_SEEDS, crash seeds $CRASH_SEEDS, power-loss seeds $POWER_LOSS_SEEDS x $POWER_LOSS_CUTS cuts, kill cycles $KILL_CYCLES, fuzz inputs $FUZZ_INPUTS"

step fuzz-copse env COPSE_FUZZ_INPUTS="$FUZZ_INPUTS" COPSE_FUZZ_SECONDS=86400 \
    "$CARGO" test --release -p copse --test fuzz -- --nocapture --test-threads 1
step fuzz-server env COPSE_FUZZ_INPUTS="$FUZZ_INPUTS" COPSE_FUZZ_SECONDS=86400 \
    "$CARGO" test --release -p copse-server --test fuzz -- --nocapture
step fuzz-coverage-guided make --no-print-directory fuzz CARGO="$CARGO" FUZZ_RUNS="$FUZZ_INPUTS"

sim=$(test_binary copse sim) || failed=1
crash=$(test_binary copse crash) || failed=1
batches=$(test_binary copse batches) || failed=1
step simulator seeded simulator "$SEEDS" COPSE_SIM_SEED_START COPSE_SIM_SEEDS \
    env COPSE_SIM_KEEP_GOING=1 "$sim" seeded_simulation --nocapture
step collector seeded collector "$COLLECTOR_SEEDS" COPSE_SIM_COLLECTOR_SEED_START \
    COPSE_SIM_COLLECTOR_SEEDS env COPSE_SIM_KEEP_GOING=1 "$sim" collector_moves --nocapture
step lost-across-crash seeded lost-across-crash "$LOST_SEEDS" COPSE_SIM_LOST_SEED_START \
    COPSE_SIM_LOST_SEEDS env COPSE_SIM_KEEP_GOING=1 "$sim" lost_writes_across --nocapture
step power-loss power_loss
step crash seeded crash "$CRASH_SEEDS" COPSE_CRASH_SEED_START COPSE_CRASH_SEEDS \
    "$crash" every_acknowledged_write --nocapture
step batch-crash seeded batch-crash "$CRASH_SEEDS" COPSE_BATCH_CRASH_SEED_START COPSE_BATCH_CRASH_SEEDS \
    "$batches" simulated --nocapture
step write-group-crash env COPSE_WRITE_GROUP_CRASH_RUNS="$WRITE_GROUP_CRASH_RUNS" \
    "$CARGO" test --release -p copse --test write_groups a_crash -- --nocapture
step kill-loops kill_loops
step linearizability env COPSE_LIN_ROUNDS="$KILL_CYCLES" \
    "$CARGO" test --release -p copse-cli --test linearizability -- --nocapture

echo "=== torture summary"
printf '%s\n' "${summary[@]}"
if [ "$failed" -ne 0 ]; then
    echo "=== torture: FAILED"
    exit 1
fi
echo "=== torture: every step passed"
