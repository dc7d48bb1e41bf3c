#!/usr/bin/env python3
"""One large sorted set and one large hash on copse and on redis-server with appendfsync always,
one after the other in one run (issue 23: collections bigger than one batch, on SSD).

For each server: `--members` members loaded into one sorted set `myzset` and as many fields into
one hash `myhash`, `--per-command` per ZADD/HSET, pipelined (elements per second, server CPU per
element); then redis-benchmark's `zadd` and `hset` tests (one random member or field per command,
into the same two keys, `--requests` each) and ZRANGE myzset 0 9, with throughput and server CPU
per request; ZCARD and HLEN; the server's RSS; for copse the index bytes per item and per element
(a member is two items, a field one) from INFO, and the time to reopen the store.

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


def load(server, members, per_command):
    """Loads `members` members and fields in commands of `per_command`; elements/s, CPU µs each."""
    client = redis.Redis(port=server.port, socket_timeout=600)
    cpu_before = bench_redis.process_cpu_seconds(server.process.pid)
    started = time.monotonic()
    for key, add in (("myzset", client.zadd), ("myhash", client.hset)):
        pipe = client.pipeline(transaction=False)
        for start in range(0, members, per_command):
            end = min(start + per_command, members)
            if key == "myzset":
                pipe.zadd(key, {f"element:{i:012d}": i for i in range(start, end)})
            else:
                pipe.hset(key, mapping={f"element:{i:012d}": "value" for i in range(start, end)})
            if len(pipe) >= 16:
                pipe.execute()
        pipe.execute()
    elapsed = time.monotonic() - started
    cpu = bench_redis.process_cpu_seconds(server.process.pid) - cpu_before
    client.close()
    return 2 * members / elapsed, cpu * 1e6 / (2 * members)


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
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=os.path.join(bench_redis.ROOT, "target")) as workdir:
        for server in [bench_redis.copse_server(workdir), bench_redis.redis_server(workdir, True)]:
            server.start()
            row = {"server": server.name}
            row["load"] = load(server, args.members, args.per_command)
            for test in ("zadd", "hset"):
                row[test] = bench_redis.run_benchmark(server, test, args.pipeline, args.requests,
                                                      100_000_000, value_bytes=16)
            row["zrange"] = zrange_rate(server, 200_000)
            row["zcard"] = int(command(server.port, "zcard", "myzset"))
            row["hlen"] = int(command(server.port, "hlen", "myhash"))
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
                assert int(command(server.port, "zcard", "myzset")) == row["zcard"]
            server.stop()
            rows.append(row)
    print(f"members and fields loaded: {args.members:,} each, {args.per_command} per command; "
          f"redis-benchmark: {args.requests:,} requests per test, 50 clients, pipeline {args.pipeline}")
    print("| server | load elements/s (CPU µs each) | ZADD req/s (CPU µs) | HSET req/s (CPU µs) | ZRANGE 0 9 req/s (CPU µs) | ZCARD | HLEN | RSS MiB |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for row in rows:
        cells = [row["server"], f"{row['load'][0]:,.0f} ({row['load'][1]:.1f})"]
        for key in ("zadd", "hset"):
            cells.append(f"{row[key]['rps']:,.0f} ({row[key]['cpu_us']:.1f})")
        cells.append(f"{row['zrange'][0]:,.0f} ({row['zrange'][1]:.1f})")
        cells += [f"{row['zcard']:,}", f"{row['hlen']:,}", f"{row['rss']:,.0f}"]
        print("| " + " | ".join(cells) + " |")
    for row in rows:
        if "index_bytes" in row:
            elements = 2 * row["zcard"] + row["hlen"]
            print(f"copse: {row['items']:,} items, index {row['index_bytes'] / 2**20:,.0f} MiB = "
                  f"{row['index_bytes'] / row['items']:.1f} B per item, "
                  f"{row['index_bytes'] / max(1, row['zcard'] + row['hlen']):.1f} B per element "
                  f"({elements:,} element items); files {row['file_bytes'] / 2**20:,.0f} MiB; "
                  f"reopened in {row['open_s']:.1f} s")


if __name__ == "__main__":
    main()
