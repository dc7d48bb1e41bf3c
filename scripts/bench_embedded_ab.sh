#!/bin/bash
# A/B of the embedded API (copse alone, YCSB through `copse bench compare`): two builds'
# binaries alternating, at 1, 4 and 16 client threads, ROUNDS rounds. Prints one line per
# build, thread count and phase (ops/s, latency, CPU µs per operation, RSS).
#   scripts/bench_embedded_ab.sh BASE_BINARY NEW_BINARY [ROUNDS]
# A base binary for a revision: `git worktree add target/baseline-REV REV`, then build it with
# `cargo build --release -p copse-cli` in that tree.
set -euo pipefail
base=$1
new=$2
rounds=${3:-2}
dir=$(mktemp -d ./bench-data-ab.XXXXXX)
trap 'rm -rf "$dir"' EXIT
for round in $(seq 1 "$rounds"); do
  for threads in 1 4 16; do
    for build in base new; do
      binary=$base
      [ "$build" = new ] && binary=$new
      "$binary" --cache-mb 64 bench compare --engines copse --repeats 1 --records 220000 \
        --record-bytes 1024 --threads "$threads" \
        --phases c@zipfian,c@uniform,b@zipfian,a@zipfian --seconds 8 \
        --dir "$dir/data" --out-dir "$dir/out" 2>/dev/null |
        grep -E '^\| [a-f]@(zipfian|uniform) \| copse' | sed "s/^/round=$round threads=$threads $build /"
    done
  done
done
