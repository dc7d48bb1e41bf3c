#!/usr/bin/env python3
"""EVALSHA, MULTI/EXEC and PUBLISH on copse beside redis-server with appendfsync always, in one
run on this machine (issue 24's benchmark; docs/benchmarks.md).

Cases (each server fresh, 50 clients unless said):
- EVALSHA of a one-key script (`INCR` of a random key of 100,000) by redis-benchmark, pipeline 1
  and 16;
- PUBLISH to a channel with one subscriber (a redis-cli reading it), pipeline 16;
- MULTI/EXEC transactions of 4 SETs on random keys (spread over copse's shards), by 8 client
  processes with redis-py for a fixed time: redis-benchmark cannot send a transaction.
Prints a markdown table with requests (or transactions) per second and the server's CPU per
request (process CPU time over requests), and the ratio copse / redis-server.

Usage: python3 scripts/bench_scripting.py [--repeats 3] [--requests 200000] [--seconds 8]
"""

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_redis import free_port, process_cpu_seconds, wait_ping  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = "return redis.call('INCR', KEYS[1])"


def start(kind, workdir):
    port = free_port()
    data = os.path.join(workdir, f"{kind}-{port}")
    os.makedirs(data)
    if kind == "copse":
        argv = [os.path.join(ROOT, "target/release/copse"), "--path", data, "serve", "--port", str(port)]
    else:
        argv = ["redis-server", "--port", str(port), "--dir", data, "--save", "",
                "--appendonly", "yes", "--appendfsync", "always"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ping(port)
    return proc, port


def redis_benchmark(port, pipeline, requests, *command):
    argv = ["redis-benchmark", "-p", str(port), "-c", "50", "-P", str(pipeline), "-n",
            str(requests), "-r", "100000", "-q", *command]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600).stdout
    rates = re.findall(r"([\d.]+) requests per second", out.replace("\r", "\n"))
    return float(rates[-1])


def transactions(port, seconds, seed, results):
    import random

    import redis

    client = redis.Redis(port=port)
    rng = random.Random(seed)
    done = 0
    deadline = time.time() + seconds
    while time.time() < deadline:
        pipe = client.pipeline(transaction=True)
        for _ in range(4):
            pipe.set(f"tx:{rng.randrange(100000)}", "x" * 100)
        pipe.execute()
        done += 1
    results.put(done)


def multi_exec(port, seconds, processes=8):
    results = multiprocessing.Queue()
    workers = [multiprocessing.Process(target=transactions, args=(port, seconds, i, results))
               for i in range(processes)]
    for worker in workers:
        worker.start()
    total = sum(results.get() for _ in workers)
    for worker in workers:
        worker.join()
    return total / seconds


def measure(kind, case, args, workdir):
    proc, port = start(kind, workdir)
    try:
        import redis

        client = redis.Redis(port=port)
        sha = client.script_load(SCRIPT)
        before = process_cpu_seconds(proc.pid)
        if case.startswith("EVALSHA"):
            pipeline = 16 if case.endswith("P16") else 1
            requests = args.requests if pipeline == 16 else args.requests // 4
            rate = redis_benchmark(port, pipeline, requests, "EVALSHA", sha, "1", "k:__rand_int__")
            count = requests
        elif case == "PUBLISH P16":
            listener = subprocess.Popen(["redis-cli", "-p", str(port), "subscribe", "bench"],
                                        stdout=subprocess.DEVNULL)
            time.sleep(0.5)
            rate = redis_benchmark(port, 16, args.requests, "PUBLISH", "bench", "message")
            listener.terminate()
            count = args.requests
        else:
            rate = multi_exec(port, args.seconds)
            count = rate * args.seconds
        cpu_us = (process_cpu_seconds(proc.pid) - before) * 1e6 / count
        return rate, cpu_us
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200000)
    parser.add_argument("--seconds", type=int, default=8)
    args = parser.parse_args()
    subprocess.run(["cargo", "build", "--release", "-p", "copse-cli"], cwd=ROOT, check=True)
    cases = ["EVALSHA P1", "EVALSHA P16", "PUBLISH P16", "MULTI/EXEC (4 SETs)"]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for case in cases:
            figures = {}
            for kind in ("copse", "redis-aof-always"):
                runs = [measure(kind, case, args, workdir) for _ in range(args.repeats)]
                figures[kind] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
                print(f"{case:22} {kind:17} {figures[kind][0]:12,.0f}/s  {figures[kind][1]:7.1f} us CPU", flush=True)
            ratio = figures["copse"][0] / figures["redis-aof-always"][0]
            rows.append((case, figures, ratio))
    print("\n| case | copse /s (CPU µs) | redis-server aof always /s (CPU µs) | copse ÷ redis |")
    print("|---|--:|--:|--:|")
    for case, figures, ratio in rows:
        ours, theirs = figures["copse"], figures["redis-aof-always"]
        print(f"| {case} | {ours[0]:,.0f} ({ours[1]:.1f}) | {theirs[0]:,.0f} ({theirs[1]:.1f}) | {ratio:.2f} |")


if __name__ == "__main__":
    main()
