#!/usr/bin/env python3
"""Large single-command writes on copse and on redis-server with appendfsync always, alternating
server by server in one run (issue 23 item 7: a single-shard MSET/DEL of any size the request
limits allow is one atomic write).

Cases, each one command of one client, timed from send to reply:
- `mset`: MSET of `--keys` keys with `--value-bytes` values (every key new);
- `mset-over`: the same MSET again, over the keys it wrote;
- `del`: DEL of all of them;
- `hset`: HSET of `--fields` fields into a new hash;
- `del-hash`: DEL of that hash.
copse runs with `--shards` shards (1 by default, so the writes are one shard's batch: a chain of
records past 16 MiB). The table has the median seconds of `--repeats` runs and the server's CPU
seconds for the command (utime + stime of /proc/PID/stat around it), and the ratio
copse ÷ redis of the times (below 1: copse is faster).

    python3 scripts/bench_large_writes.py --keys 200000 --fields 300000 --repeats 3
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_redis  # noqa: E402
import redis  # noqa: E402


def timed(server, client, *command):
    cpu_before = bench_redis.process_cpu_seconds(server.process.pid)
    started = time.monotonic()
    reply = client.execute_command(*command)
    seconds = time.monotonic() - started
    return reply, seconds, bench_redis.process_cpu_seconds(server.process.pid) - cpu_before


def run_cases(server, keys, fields, value_bytes):
    client = redis.Redis(port=server.port, socket_timeout=600)
    client.flushall()
    names = [f"big:{i:07d}".encode() for i in range(keys)]
    value = b"v" * value_bytes
    mset = ["MSET"] + [part for name in names for part in (name, value)]
    other = ["MSET"] + [part for name in names for part in (name, value[::-1] + b"!")]
    hset = ["HSET", "bighash"] + [part for i in range(fields) for part in (f"f{i}", f"v{i}")]
    results = {}
    reply, *results["mset"] = timed(server, client, *mset)
    assert reply in (b"OK", "OK", True), reply
    reply, *results["mset-over"] = timed(server, client, *other)
    assert client.dbsize() == keys
    reply, *results["del"] = timed(server, client, "DEL", *names)
    assert reply == keys, reply
    reply, *results["hset"] = timed(server, client, *hset)
    assert reply == fields, reply
    reply, *results["del-hash"] = timed(server, client, "DEL", "bighash")
    assert reply == 1
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--fields", type=int, default=300_000)
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases = ["mset", "mset-over", "del", "hset", "del-hash"]
    runs = {}
    with tempfile.TemporaryDirectory(dir=os.path.join(bench_redis.ROOT, "target")) as workdir:
        copse = bench_redis.copse_server(workdir)
        copse.argv += ["--shards", str(args.shards)]
        servers = [copse, bench_redis.redis_server(workdir, True)]
        for repeat in range(args.repeats):
            for server in servers if repeat % 2 == 0 else servers[::-1]:
                server.start()
                runs.setdefault(server.name, []).append(
                    run_cases(server, args.keys, args.fields, args.value_bytes))
                server.stop()
    print(f"{args.keys:,} keys of {args.value_bytes} B per MSET/DEL, {args.fields:,} fields per "
          f"HSET; copse with {args.shards} shard(s); median of {args.repeats} runs, one client")
    print("| case | copse s (CPU s) | redis-aof-always s (CPU s) | copse ÷ redis time |")
    print("|---|--:|--:|--:|")
    for case in cases:
        cells = [case]
        medians = {}
        for name in ("copse", "redis-aof-always"):
            seconds = statistics.median(run[case][0] for run in runs[name])
            cpu = statistics.median(run[case][1] for run in runs[name])
            medians[name] = seconds
            cells.append(f"{seconds:.2f} ({cpu:.2f})")
        cells.append(f"{medians['copse'] / medians['redis-aof-always']:.2f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
