#!/usr/bin/env python3
"""redis-benchmark against copse and against redis-server, side by side, on this machine.

Cases: SET and GET, 1 KiB values, 50 clients, pipeline 1 and 16, random keys (-r). Servers:
copse (every acknowledged write durable), redis-server in memory (no persistence), and
redis-server with `appendonly yes, appendfsync always` (durable like copse). Runs alternate
server by server (A B C A B C ...) so that the machine's drift hits each alike; the table gives
the median of the repeats and the ratio of copse to each redis.

Usage: python3 scripts/bench_redis.py [--repeats 3] [--requests 100000] [--out FILE]
Needs redis-server and redis-benchmark (Debian: apt-get install redis-server redis-tools) and a
release build of copse (the script builds it).
"""

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ping(port, timeout_s=30):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server on port {port} did not answer PING")


class Server:
    def __init__(self, name, argv, port, workdir):
        self.name, self.argv, self.port, self.workdir = name, argv, port, workdir
        self.process = None

    def start(self):
        self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ping(self.port)

    def stop(self):
        if self.process:
            self.process.terminate()
            self.process.wait(timeout=60)
            self.process = None


def copse_server(workdir):
    port = free_port()
    data = os.path.join(workdir, "copse-data")
    argv = [os.path.join(ROOT, "target/release/copse"), "--path", data, "serve", "--port", str(port)]
    return Server("copse", argv, port, data)


def redis_server(workdir, durable):
    port = free_port()
    name = "redis-aof-always" if durable else "redis-memory"
    data = os.path.join(workdir, name)
    os.makedirs(data, exist_ok=True)
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", data, "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
    return Server(name, argv, port, data)


def run_benchmark(port, test, pipeline, requests, keyspace):
    argv = ["redis-benchmark", "-p", str(port), "-t", test, "-d", "1024", "-c", "50",
            "-P", str(pipeline), "-n", str(requests), "-r", str(keyspace)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800).stdout
    out = out.replace("\r", "\n")
    rps = float(re.search(r"throughput summary: ([\d.]+) requests per second", out).group(1))
    summary = re.search(r"latency summary \(msec\):\s*\n\s*avg\s+min\s+p50\s+p95\s+p99\s+max\s*\n\s*([\d.\s]+)\n", out)
    avg, low, p50, p95, p99, high = (float(x) for x in summary.group(1).split())
    p999 = None
    for line in out.splitlines():
        match = re.match(r"\s*([\d.]+)% <= ([\d.]+) milliseconds", line)
        if match and float(match.group(1)) >= 99.9:
            p999 = float(match.group(2))
            break
    return {"rps": rps, "p50": p50, "p99": p99, "p999": p999 if p999 is not None else high, "max": high}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--keyspace", type=int, default=100_000)
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    args = parser.parse_args()
    for tool in ("redis-server", "redis-benchmark"):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (Debian: apt-get install redis-server redis-tools)")
    subprocess.run(["cargo", "build", "--release", "-p", "copse-cli"], cwd=ROOT, check=True)
    workdir = tempfile.mkdtemp(prefix="copse-bench-redis-", dir=os.environ.get("BENCH_DIR", ROOT))
    servers = [copse_server(workdir), redis_server(workdir, False), redis_server(workdir, True)]
    cases = [(test, pipeline) for pipeline in (1, 16) for test in ("set", "get")]
    results = {}
    try:
        for server in servers:
            server.start()
            # Every server gets the same keys first, so GETs find values everywhere.
            run_benchmark(server.port, "set", 16, args.keyspace * 2, args.keyspace)
        for repeat in range(args.repeats):
            for test, pipeline in cases:
                for server in servers:
                    result = run_benchmark(server.port, test, pipeline, args.requests, args.keyspace)
                    results.setdefault((server.name, test, pipeline), []).append(result)
                    print(f"repeat {repeat + 1} {server.name:18} {test.upper():3} P{pipeline:<2} "
                          f"{result['rps']:>10.0f} req/s  p50 {result['p50']:.3f}  p99 {result['p99']:.3f}  "
                          f"p99.9 {result['p999']:.3f}  max {result['max']:.3f} ms", flush=True)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    def median(name, test, pipeline, field):
        return statistics.median(r[field] for r in results[(name, test, pipeline)])

    lines = ["| case | server | req/s (median) | p50 ms | p99 ms | p99.9 ms | max ms | copse ÷ this |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for test, pipeline in cases:
        copse_rps = median("copse", test, pipeline, "rps")
        for server in servers:
            rps = median(server.name, test, pipeline, "rps")
            lines.append(
                f"| {test.upper()} P{pipeline} | {server.name} | {rps:,.0f} | "
                f"{median(server.name, test, pipeline, 'p50'):.3f} | {median(server.name, test, pipeline, 'p99'):.3f} | "
                f"{median(server.name, test, pipeline, 'p999'):.3f} | {median(server.name, test, pipeline, 'max'):.3f} | "
                f"{copse_rps / rps:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
