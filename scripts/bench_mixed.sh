#!/bin/bash
# GETs beside SETs (docs/benchmarks.md, "Background flushes, measured alone"): starts BINARY on
# PORT with a fresh store, loads 200,000 SETs of 1 KiB values over 100,000 keys, then runs
# `redis-benchmark -t get -c 25 -P 1` (100,000 requests) while `-t set -c 25 -P 16` keeps
# writing, and prints the GETs' throughput and latency summary (avg, min, p50, p95, p99, max
# in ms). With thread-per-core a shard's flush shares its thread with connections, so this is
# where a flush that blocks the thread shows.
#
# Usage: scripts/bench_mixed.sh BINARY PORT
set -euo pipefail
binary=$1
port=$2
for tool in redis-benchmark redis-cli; do
    command -v "$tool" >/dev/null || { echo "bench_mixed.sh: $tool is not installed" >&2; exit 2; }
done
dir=$(mktemp -d)
"$binary" --path "$dir/data" serve --port "$port" >"$dir/serve.log" 2>&1 &
server=$!
writer=
trap 'kill $writer $server 2>/dev/null || true; wait 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 50); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    sleep 0.1
done
redis-benchmark -p "$port" -t set -d 1024 -c 50 -P 16 -n 200000 -r 100000 -q >/dev/null 2>&1
redis-benchmark -p "$port" -t set -d 1024 -c 25 -P 16 -n 100000000 -r 100000 -q >/dev/null 2>&1 &
writer=$!
sleep 1
redis-benchmark -p "$port" -t get -d 1024 -c 25 -P 1 -n 100000 -r 100000 --precision 3 2>&1 |
    tr '\r' '\n' | grep -A2 -E "throughput summary|latency summary" | grep -vE "^--$|^ *$"
