#!/usr/bin/env python3
"""redis-benchmark against copse and against redis-server, side by side, on this machine.

Cases: SET and GET, 1 KiB values, 50 clients, pipeline 1 and 16, random keys (-r). Servers:
copse (every acknowledged write durable), redis-server in memory (no persistence), and
redis-server with `appendonly yes, appendfsync always` (durable like copse). Runs alternate
server by server (A B C A B C ...) so that the machine's drift hits each alike; the table gives
the median of the repeats and the ratio of copse to each redis.

Each run also reads the server's CPU time (utime + stime of /proc/PID/stat) before and after,
and reports the server's CPU microseconds per request beside its throughput.

`--copse-baseline REV` adds copse built at git revision REV (a worktree under target/, built
there) to the alternation, as `copse@REV`, to compare two builds of the server in one run (the two swap places every other repeat, so
neither always runs first);
`--no-redis` leaves the Redis servers out. `--tests`, `--pipelines`, `--clients` and
`--value-bytes` choose the cases. `--expire-s N` makes every SET a `SET key value EX N` (the
preload's too), so GETs read keys that carry an expiry.

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


def process_cpu_seconds(pid):
    """User plus system CPU seconds of process `pid` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


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


def copse_server(workdir, binary=None, name="copse"):
    port = free_port()
    data = os.path.join(workdir, name + "-data")
    binary = binary or os.path.join(ROOT, "target/release/copse")
    argv = [binary, "--path", data, "serve", "--port", str(port)]
    return Server(name, argv, port, data)


def build_baseline(rev):
    """The copse binary built at `rev`, in a worktree of its own (kept for the next run)."""
    short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.strip()
    tree = os.path.join(ROOT, "target", f"baseline-{short}")
    if not os.path.isdir(tree):
        subprocess.run(["git", "worktree", "add", "--detach", tree, short], cwd=ROOT, check=True)
    subprocess.run(["cargo", "build", "--release", "-p", "copse-cli"], cwd=tree, check=True)
    return short, os.path.join(tree, "target/release/copse")


def redis_server(workdir, durable):
    port = free_port()
    name = "redis-aof-always" if durable else "redis-memory"
    data = os.path.join(workdir, name)
    os.makedirs(data, exist_ok=True)
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", data, "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", "always"] if durable else ["--appendonly", "no"]
    return Server(name, argv, port, data)


def run_benchmark(server, test, pipeline, requests, keyspace, clients=50, value_bytes=1024,
                  expire_s=None):
    argv = ["redis-benchmark", "-p", str(server.port), "-d", str(value_bytes),
            "-c", str(clients), "-P", str(pipeline), "-n", str(requests)]
    # --keyspace 0: no -r, so every request names the same key (a hot key).
    if keyspace > 0:
        argv += ["-r", str(keyspace)]
    if test == "set" and expire_s:
        # The key names redis-benchmark's own SET uses, so GET finds them; the command last.
        argv += ["SET", "key:__rand_int__", "x" * value_bytes, "EX", str(expire_s)]
    else:
        argv += ["-t", test]
    cpu_before = process_cpu_seconds(server.process.pid)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800).stdout
    cpu_us_per_request = (process_cpu_seconds(server.process.pid) - cpu_before) * 1e6 / requests
    out = out.replace("\r", "\n")
    found = re.search(r"throughput summary: ([\d.]+) requests per second", out)
    if found is None:
        raise RuntimeError(f"{server.name}: redis-benchmark gave no summary: {' '.join(argv)[:300]}\n{out[-2000:]}")
    rps = float(found.group(1))
    summary = re.search(r"latency summary \(msec\):\s*\n\s*avg\s+min\s+p50\s+p95\s+p99\s+max\s*\n\s*([\d.\s]+)\n", out)
    avg, low, p50, p95, p99, high = (float(x) for x in summary.group(1).split())
    p999 = None
    for line in out.splitlines():
        match = re.match(r"\s*([\d.]+)% <= ([\d.]+) milliseconds", line)
        if match and float(match.group(1)) >= 99.9:
            p999 = float(match.group(2))
            break
    return {"rps": rps, "p50": p50, "p99": p99, "p999": p999 if p999 is not None else high, "max": high,
            "cpu_us": cpu_us_per_request}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--keyspace", type=int, default=100_000,
                        help="random keys per run (-r); 0: one key for every request (a hot key)")
    parser.add_argument("--out", default=None, help="write the markdown table here too")
    parser.add_argument("--copse-baseline", default=None, metavar="REV",
                        help="also run copse built at this git revision")
    parser.add_argument("--no-redis", action="store_true", help="leave the Redis servers out")
    parser.add_argument("--tests", default="set,get", help="redis-benchmark tests, comma-separated")
    parser.add_argument("--pipelines", default="1,16", help="pipeline depths, comma-separated")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--value-bytes", type=int, default=1024)
    parser.add_argument("--expire-s", type=int, default=None,
                        help="SET with EX this many seconds (the preload too)")
    args = parser.parse_args()
    for tool in ("redis-server", "redis-benchmark"):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (Debian: apt-get install redis-server redis-tools)")
    subprocess.run(["cargo", "build", "--release", "-p", "copse-cli"], cwd=ROOT, check=True)
    workdir = tempfile.mkdtemp(prefix="copse-bench-redis-", dir=os.environ.get("BENCH_DIR", ROOT))
    servers = [copse_server(workdir)]
    if args.copse_baseline:
        short, binary = build_baseline(args.copse_baseline)
        servers.append(copse_server(workdir, binary, f"copse@{short}"))
    if not args.no_redis:
        servers += [redis_server(workdir, False), redis_server(workdir, True)]
    pipelines = [int(p) for p in args.pipelines.split(",")]
    tests = args.tests.split(",")
    cases = [(test, pipeline) for pipeline in pipelines for test in tests]
    shape = dict(clients=args.clients, value_bytes=args.value_bytes, expire_s=args.expire_s)
    results = {}
    try:
        for server in servers:
            server.start()
            # Every server gets the same keys first, so GETs find values everywhere.
            run_benchmark(server, "set", 16, max(args.keyspace * 2, 1000), args.keyspace, **shape)
        for repeat in range(args.repeats):
            # The two copse builds swap places every other repeat: the one run first has been
            # seen to gain or lose a few percent for it alone (docs/benchmarks.md).
            order = list(servers)
            if args.copse_baseline and repeat % 2 == 1:
                order[0], order[1] = order[1], order[0]
            for test, pipeline in cases:
                for server in order:
                    result = run_benchmark(server, test, pipeline, args.requests, args.keyspace, **shape)
                    results.setdefault((server.name, test, pipeline), []).append(result)
                    print(f"repeat {repeat + 1} {server.name:18} {test.upper():3} P{pipeline:<2} "
                          f"{result['rps']:>10.0f} req/s  p50 {result['p50']:.3f}  p99 {result['p99']:.3f}  "
                          f"p99.9 {result['p999']:.3f}  max {result['max']:.3f} ms  "
                          f"server CPU {result['cpu_us']:.2f} us/req", flush=True)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    def median(name, test, pipeline, field):
        return statistics.median(r[field] for r in results[(name, test, pipeline)])

    lines = ["| case | server | req/s (median) | server CPU µs/req | p50 ms | p99 ms | p99.9 ms | max ms | copse ÷ this |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for test, pipeline in cases:
        copse_rps = median("copse", test, pipeline, "rps")
        for server in servers:
            rps = median(server.name, test, pipeline, "rps")
            lines.append(
                f"| {test.upper()} P{pipeline} | {server.name} | {rps:,.0f} | "
                f"{median(server.name, test, pipeline, 'cpu_us'):.2f} | "
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
