#!/bin/bash
# Instructions the server executes per request (user space, all its threads), counted by
# valgrind's callgrind: a figure that does not move with the machine's load or its disk, so a
# change of a few percent in the server's CPU per request shows, where timed runs on this VM
# swing by ±10-25% (docs/benchmarks.md, "Instructions per request"). It counts instructions, not
# time: cache misses and the kernel are not in it, and a `rep movsb`/`rep stosb` copy counts one
# instruction per byte, so large copies weigh more than they cost. Confirm with a timed A/B.
#
# Starts BINARY under callgrind on PORT with a fresh store, loads 20,000 SETs of 1 KiB values over
# 10,000 keys, runs N requests of OP (get or set) unmeasured to warm up (pages read, records
# checked once), then N measured ones, and prints instructions per request. With KEEP=FILE the
# callgrind output is kept there (read it with `callgrind_annotate FILE`).
#
# Usage: scripts/instructions_per_request.sh BINARY PORT get|set [N]
# Environment: PIPELINE (redis-benchmark -P, default 16).
set -euo pipefail
binary=$1
port=$2
op=$3
requests=${4:-50000}
case "$op" in
    get | set) ;;
    *) echo "instructions_per_request.sh: OP must be get or set, not '$op'" >&2; exit 2 ;;
esac
for tool in valgrind callgrind_control callgrind_annotate redis-benchmark redis-cli; do
    command -v "$tool" >/dev/null || { echo "instructions_per_request.sh: $tool is not installed" >&2; exit 2; }
done
# A server still on the port (an earlier count's valgrind takes seconds to exit) would be the one
# measured, and a redis-benchmark left talking to a server that went away spins a core at 100%.
if redis-cli -p "$port" ping >/dev/null 2>&1; then
    echo "instructions_per_request.sh: something already answers on port $port" >&2
    exit 2
fi
dir=$(mktemp -d)
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$dir/out" \
    "$binary" --path "$dir/data" serve --port "$port" >"$dir/serve.log" 2>&1 &
server=$!
# Every command in the trap ends in `|| true`: under `set -e` the first that fails (pkill finding
# nothing) would end the trap and leave the server running (three were found idle hours later).
trap 'pkill -f "redis-benchmark -p $port " 2>/dev/null || true; kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 120); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    sleep 0.5
done
redis-cli -p "$port" ping >/dev/null 2>&1 || {
    echo "instructions_per_request.sh: the server did not answer on port $port" >&2
    exit 1
}
bench() {
    redis-benchmark -p "$port" -t "$1" -d 1024 -c 50 -P "$2" -n "$3" -r 10000 -q >/dev/null
}
bench set 16 20000
bench "$op" "${PIPELINE:-16}" "$requests"
callgrind_control -i on "$server" >/dev/null 2>&1
bench "$op" "${PIPELINE:-16}" "$requests"
callgrind_control -d "$server" >/dev/null 2>&1
callgrind_control -i off "$server" >/dev/null 2>&1
total=$(callgrind_annotate "$dir/out.1" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
[ -n "${KEEP:-}" ] && cp "$dir/out.1" "$KEEP"
echo "$op P${PIPELINE:-16}: $((total / requests)) instructions per request ($binary)"
