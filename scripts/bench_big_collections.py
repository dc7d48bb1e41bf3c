#!/usr/bin/env python3
"""One large sorted set, hash, list and set on copse and on redis-server with appendfsync always,
one after the other in one run (issue 23: collections bigger than one batch, on SSD).

For each server: `--members` elements loaded into each of one sorted set `myzset`, one hash
`myhash`, one list `mylist` and one set `myset` (redis-benchmark's own key names),
`--per-command` per ZADD/HSET/RPUSH/SADD, pipelined (elements per second, server CPU per
element); then redis-benchmark's `zadd`, `hset`, `lpush`, `lpop` and `sadd` tests (one random
element per command, into the same keys, `--requests` each) and ZRANGE myzset 0 9, with
throughput and server CPU per request; ZCARD, HLEN, LLEN and SCARD; the server's RSS; for copse
the index bytes per item and per element (a sorted set member is two items, the rest one) from
INFO, and the time to reopen the store. `--types` picks the collections (default all four).

    python3 scripts/bench_big_collections.py --members 10000000
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_redis  # noqa: E402
import redis  # noqa: E402


KEYS = {"zset": "myzset", "hash": "myhash", "list": "mylist", "set": "myset"}


def load(server, members, per_command, types):
    """Loads `members` elements into each collection of `types`, in commands of `per_command`;
    elements/s, CPU µs each."""
    client = redis.Redis(port=server.port, socket_timeout=600)
    cpu_before = bench_redis.process_cpu_seconds(server.process.pid)
    started = time.monotonic()
    for ty in types:
        key = KEYS[ty]
        pipe = client.pipeline(transaction=False)
        for start in range(0, members, per_command):
            names = [f"element:{i:012d}" for i in range(start, min(start + per_command, members))]
            if ty == "zset":
                pipe.zadd(key, {name: i for i, name in enumerate(names, start)})
            elif ty == "hash":
                pipe.hset(key, mapping={name: "value" for name in names})
            elif ty == "list":
                pipe.rpush(key, *names)
            else:
                pipe.sadd(key, *names)
            if len(pipe) >= 16:
                pipe.execute()
        pipe.execute()
    elapsed = time.monotonic() - started
    cpu = bench_redis.process_cpu_seconds(server.process.pid) - cpu_before
    client.close()
    total = len(types) * members
    return total / elapsed, cpu * 1e6 / total


def info(port, section):
    out = subprocess.run(["redis-cli", "-p", str(port), "info", section], capture_output=True,
                         text=True, timeout=60).stdout
    return dict(line.split(":", 1) for line in out.splitlines() if ":" in line)


def command(port, *args):
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True,
                          timeout=600).stdout.strip()


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def zrange_rate(server, requests):
    argv = ["redis-benchmark", "-p", str(server.port), "-c", "50", "-P", "16", "-n", str(requests),
            "ZRANGE", "myzset", "0", "9"]
    cpu_before = bench_redis.process_cpu_seconds(server.process.pid)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800).stdout.replace("\r", "\n")
    cpu = (bench_redis.process_cpu_seconds(server.process.pid) - cpu_before) * 1e6 / requests
    rps = float(bench_redis.re.search(r"throughput summary: ([\d.]+) requests per second", out).group(1))
    return rps, cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=1_000_000)
    parser.add_argument("--per-command", type=int, default=1_000)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--pipeline", type=int, default=16)
    parser.add_argument("--types", default="zset,hash,list,set")
    args = parser.parse_args()
    types = args.types.split(",")
    tests = {"zset": ["zadd"], "hash": ["hset"], "list": ["lpush", "lpop"], "set": ["sadd"]}
    tests = [test for ty in types for test in tests[ty]]
    sizes = {"zset": "zcard", "hash": "hlen", "list": "llen", "set": "scard"}
    rows = []
    with tempfile.TemporaryDirectory(dir=os.path.join(bench_redis.ROOT, "target")) as workdir:
        for server in [bench_redis.copse_server(workdir), bench_redis.redis_server(workdir, True)]:
            server.start()
            row = {"server": server.name}
            row["load"] = load(server, args.members, args.per_command, types)
            for test in tests:
                row[test] = bench_redis.run_benchmark(server, test, args.pipeline, args.requests,
                                                      100_000_000, value_bytes=16)
            if "zset" in types:
                row["zrange"] = zrange_rate(server, 200_000)
            for ty in types:
                row[sizes[ty]] = int(command(server.port, sizes[ty], KEYS[ty]))
            row["rss"] = rss_mib(server.process.pid)
            if server.name == "copse":
                memory = info(server.port, "memory")
                copse = info(server.port, "copse")
                row["index_bytes"] = int(memory["copse_index_bytes"])
                row["items"] = int(copse["items"])
                row["file_bytes"] = int(copse["file_bytes"])
                server.stop()
                started = time.monotonic()
                # Reopening scans every item (recovery): allow it minutes, not the usual 30 s.
                server.process = subprocess.Popen(server.argv, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL)
                bench_redis.wait_ping(server.port, timeout_s=600)
                row["open_s"] = time.monotonic() - started
                for ty in types:
                    assert int(command(server.port, sizes[ty], KEYS[ty])) == row[sizes[ty]]
            server.stop()
            rows.append(row)
    print(f"elements loaded: {args.members:,} into each of {', '.join(types)}, "
          f"{args.per_command} per command; redis-benchmark: {args.requests:,} requests per test, "
          f"50 clients, pipeline {args.pipeline}")
    columns = [f"{test.upper()} req/s (CPU µs)" for test in tests]
    if "zset" in types:
        columns.append("ZRANGE 0 9 req/s (CPU µs)")
    columns += [sizes[ty].upper() for ty in types] + ["RSS MiB"]
    print("| server | load elements/s (CPU µs each) | " + " | ".join(columns) + " |")
    print("|---|" + "--:|" * (len(columns) + 1))
    for row in rows:
        cells = [row["server"], f"{row['load'][0]:,.0f} ({row['load'][1]:.1f})"]
        for test in tests:
            cells.append(f"{row[test]['rps']:,.0f} ({row[test]['cpu_us']:.1f})")
        if "zset" in types:
            cells.append(f"{row['zrange'][0]:,.0f} ({row['zrange'][1]:.1f})")
        cells += [f"{row[sizes[ty]]:,}" for ty in types]
        cells.append(f"{row['rss']:,.0f}")
        print("| " + " | ".join(cells) + " |")
    for row in rows:
        if "index_bytes" in row:
            elements = sum(row[sizes[ty]] for ty in types)
            element_items = elements + row.get("zcard", 0)
            print(f"copse: {row['items']:,} items, index {row['index_bytes'] / 2**20:,.0f} MiB = "
                  f"{row['index_bytes'] / row['items']:.1f} B per item, "
                  f"{row['index_bytes'] / max(1, elements):.1f} B per element "
                  f"({element_items:,} element items); files {row['file_bytes'] / 2**20:,.0f} MiB; "
                  f"reopened in {row['open_s']:.1f} s")


if __name__ == "__main__":
    main()
