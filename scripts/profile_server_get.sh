#!/bin/bash
# Profiles `copse serve` under pipelined GETs of 1 KiB values (docs/benchmarks.md, "The server
# after issue 20"): starts BINARY on PORT with a fresh store, loads 200,000 SETs over 100,000
# keys, runs `redis-benchmark -t get -d 1024 -c 50 -P 16 -r 100000` and samples the server with
# `perf record -g -F 999` for 10 s in the middle of it. Writes NAME.data (perf), NAME.bench.txt
# (redis-benchmark's output) and NAME.info.txt (the server's backpressure and parser counters)
# under $PERF_DIR (default target/perf). Compare two builds with
# `perf report -i NAME.data --no-children --sort symbol --stdio`.
#
# Usage: scripts/profile_server_get.sh NAME BINARY PORT
set -euo pipefail
name=$1
binary=$2
port=$3
dir=${PERF_DIR:-target/perf}
mkdir -p "$dir"
rm -rf "$dir/data-$name"
"$binary" --path "$dir/data-$name" serve --port "$port" >"$dir/$name.serve.log" 2>&1 &
server=$!
for _ in $(seq 50); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    sleep 0.2
done
redis-benchmark -p "$port" -t set -d 1024 -c 50 -P 16 -n 200000 -r 100000 -q >/dev/null
redis-benchmark -p "$port" -t get -d 1024 -c 50 -P 16 -n 6000000 -r 100000 -q \
    >"$dir/$name.bench.txt" 2>&1 &
bench=$!
sleep 3
perf record -g -F 999 -p "$server" -o "$dir/$name.data" -- sleep 10 2>/dev/null
kill "$bench" 2>/dev/null || true
wait "$bench" 2>/dev/null || true
redis-cli -p "$port" info stats | grep -E "reply_backpressure|parser_examined" >"$dir/$name.info.txt" || true
kill "$server"
wait "$server" || true
