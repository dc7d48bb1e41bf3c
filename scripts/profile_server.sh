#!/bin/bash
# Profiles `copse serve` under redis-benchmark (docs/benchmarks.md; `make profile`): starts BINARY
# on PORT with a fresh store, loads 200,000 SETs of 1 KiB values over 100,000 keys, then runs
# `redis-benchmark -t OP -d 1024 -c 50 -P 16 -r 100000` (OP: get or set) and samples the server
# with `perf record -g -F 999` for 10 s in the middle of it. Writes NAME.data (perf),
# NAME.bench.txt (redis-benchmark's output) and NAME.info.txt (the server's backpressure and
# parser counters) under $PERF_DIR (default target/perf). Compare two builds with
# `perf report -i NAME.data --no-children --sort symbol --stdio`, or draw one with
# `copse bench flamegraph --perf-data NAME.data --svg NAME.svg`.
#
# Usage: scripts/profile_server.sh NAME BINARY PORT [get|set]
# Environment (defaults as above): PIPELINE (redis-benchmark -P), PERF_CALL_GRAPH (e.g.
# "--call-graph dwarf,16384", which attributes inlined engine code that frame pointers lose),
# PERF_FREQ (samples per second) and PERF_SECONDS.
set -euo pipefail
name=$1
binary=$2
port=$3
op=${4:-get}
case "$op" in
    get | set) ;;
    *) echo "profile_server.sh: OP must be get or set, not '$op'" >&2; exit 2 ;;
esac
for tool in perf redis-benchmark redis-cli; do
    command -v "$tool" >/dev/null || { echo "profile_server.sh: $tool is not installed" >&2; exit 2; }
done
dir=${PERF_DIR:-target/perf}
mkdir -p "$dir"
rm -rf "$dir/data-$name"
"$binary" --path "$dir/data-$name" serve --port "$port" >"$dir/$name.serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 50); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    sleep 0.2
done
redis-benchmark -p "$port" -t set -d 1024 -c 50 -P 16 -n 200000 -r 100000 -q >/dev/null
redis-benchmark -p "$port" -t "$op" -d 1024 -c 50 -P "${PIPELINE:-16}" -n 6000000 -r 100000 -q \
    >"$dir/$name.bench.txt" 2>&1 &
bench=$!
sleep 3
perf record ${PERF_CALL_GRAPH:--g} -F ${PERF_FREQ:-999} -p "$server" -o "$dir/$name.data" -- sleep ${PERF_SECONDS:-10} 2>/dev/null
kill "$bench" 2>/dev/null || true
wait "$bench" 2>/dev/null || true
redis-cli -p "$port" info stats | grep -E "reply_backpressure|parser_examined" >"$dir/$name.info.txt" || true
kill "$server"
wait "$server" || true
trap - EXIT
