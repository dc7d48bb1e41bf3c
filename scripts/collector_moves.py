#!/usr/bin/env python3
"""The collector's moves per SET of a running copse server, from `INFO copse`.

Writes 1 KiB values over `--keys` keys in waves of `--pipeline` SETs (redis-py), in key order or
at random, and prints, per `--sets` SETs, the collector's moves per SET (`gc_bytes_moved` over
the record's size) and the class files' bytes. With `--redis-benchmark`, redis-benchmark does
the writing instead (50 clients, pipeline 16, random keys): the benchmark's shape.

    copse serve --path /tmp/moves --port 6391 --shards 2 --threads 2 --cache-mb 16 &
    python3 scripts/collector_moves.py --port 6391 --keys 512 --order random

(docs/benchmarks.md, "Allocations per request, and a collector that churned small stores").
"""

import argparse
import random
import subprocess
import time

import redis

# A SET of a 16- to 24-byte key and a 1 KiB value is a record of about this many bytes
# (docs/format/slab.md): moves per SET are moved bytes over it.
RECORD_BYTES = 1079
VALUE_BYTES = 1024


def class_totals(client, field):
    return sum(figures.get(field, 0) for figures in client.info("copse").values()
               if isinstance(figures, dict))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=6380)
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--order", choices=["sequential", "random"], default="random")
    parser.add_argument("--pipeline", type=int, default=16)
    parser.add_argument("--sets", type=int, default=8000, help="SETs per line printed")
    parser.add_argument("--lines", type=int, default=3)
    parser.add_argument("--redis-benchmark", action="store_true",
                        help="write with redis-benchmark (-c 50 -P 16 -r KEYS) instead")
    args = parser.parse_args()
    client = redis.Redis(port=args.port)
    value = b"v" * VALUE_BYTES
    rng = random.Random(1)
    written = 0
    for line in range(args.lines):
        moved_before = class_totals(client, "gc_bytes_moved")
        started = time.monotonic()
        if args.redis_benchmark:
            subprocess.run(["redis-benchmark", "-p", str(args.port), "-t", "set", "-d", str(VALUE_BYTES),
                            "-c", "50", "-P", "16", "-r", str(args.keys), "-n", str(args.sets)],
                           check=True, capture_output=True)
        else:
            for wave_start in range(0, args.sets, args.pipeline):
                pipe = client.pipeline(transaction=False)
                for at in range(wave_start, min(wave_start + args.pipeline, args.sets)):
                    key = (written + at) % args.keys if args.order == "sequential" else rng.randrange(args.keys)
                    pipe.set(f"key:{key:020}", value)
                pipe.execute()
        written += args.sets
        moved = class_totals(client, "gc_bytes_moved") - moved_before
        print(f"keys {args.keys} {args.order if not args.redis_benchmark else 'redis-benchmark'} "
              f"line {line}: {moved / RECORD_BYTES / args.sets:.2f} moves per SET, "
              f"files {class_totals(client, 'file_bytes') / 2**20:.1f} MiB, "
              f"{time.monotonic() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main()
