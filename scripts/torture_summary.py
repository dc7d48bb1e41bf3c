#!/usr/bin/env python3
"""Sums the figures of a `make torture` log (target/torture.log) into the tables of
docs/reliability.md: each step's exit and time, and every test's totals added over its lanes.

Usage: python3 scripts/torture_summary.py [target/torture.log]

It reads only what the tests print; a figure missing from the log (a step that failed before
printing it) is shown as "missing", never as zero.
"""

import re
import sys
from collections import Counter


def parse_debug_totals(text):
    """Adds up every `name: integer` inside Rust `{:#?}` or `{:?}` output of a Totals struct.
    Nested maps count under `outer.inner` (a simulator scenario, a fault point, a fate)."""
    totals = Counter()
    stack = []
    for token in re.finditer(r'"?([A-Za-z_][A-Za-z0-9_]*)"?: (\d+|[A-Za-z]+ \{|\{)|(\})', text):
        name, value, close = token.group(1), token.group(2), token.group(3)
        if close:
            if stack:
                stack.pop()
            continue
        if value.endswith("{"):
            stack.append(name)
            continue
        path = ".".join([s for s in stack if s not in ("Totals",)] + [name])
        totals[path] += int(value)
    return totals


def blocks_after(log, marker):
    """The text of each `marker ... }` block (a pretty-printed struct that closes at column 0)."""
    blocks = []
    for match in re.finditer(re.escape(marker), log):
        end = log.find("\n}", match.end())
        if end != -1:
            blocks.append(log[match.end():end + 2])
    return blocks


def add(totals, more):
    """Adds lane totals: sums, except `max_*` figures, which take the largest. Keeps zeros
    (Counter's `+=` would drop them, and a zero is a figure too)."""
    for name, value in more.items():
        if name.rsplit(".", 1)[-1].startswith("max_"):
            totals[name] = max(totals.get(name, 0), value)
        else:
            totals[name] = totals.get(name, 0) + value


def fmt(number):
    return f"{number:,}"


def print_totals(title, totals):
    """One step's summed figures, or that its lanes printed none."""
    print(f"{title} (summed over lanes):" if totals else f"{title}: missing")
    for name in sorted(totals):
        print(f"- {name}: {fmt(totals[name])}")
    print()


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "target/torture.log"
    log = open(path, encoding="utf-8", errors="replace").read()

    head = re.search(r"=== torture: (.*)", log)
    print(f"run: {head.group(1) if head else 'missing'}")
    starts = re.findall(r"=== torture step: \S+ \((.*?)\)", log)
    if starts:
        print(f"first step started: {starts[0]}")
    print()
    print("| step | exit | seconds |")
    print("|---|---:|---:|")
    for name, status, took in re.findall(r"=== torture step: (\S+): exit (\d+) after (\d+) s", log):
        print(f"| {name} | {status} | {fmt(int(took))} |")
    print()

    print("Mutation fuzzer (in-tree):")
    for target, inputs, seconds in re.findall(r"fuzz (\S+): (\d+) inputs in ([\d.]+) s", log):
        print(f"- {target}: {fmt(int(inputs))} inputs in {seconds} s")
    print("Coverage-guided (cargo-fuzz), in the order slab_page, manifest, resp_request:")
    done = re.findall(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/", log)
    runs = re.findall(r"Done (\d+) runs in (\d+) second", log)
    for (executed, cov, features, corpus), (_, seconds) in zip(done, runs):
        print(f"- {fmt(int(executed))} inputs in {seconds} s, coverage {cov} edges, "
              f"{features} features, corpus {corpus}")
    print()

    sim = Counter()
    for block in blocks_after(log, "simulator totals: "):
        add(sim, parse_debug_totals(block))
    print_totals("Simulator", sim)

    for title, marker in [
        ("Collector scenario", "collector scenario totals: "),
        ("Lost writes across a crash", "lost-then-crash totals: "),
    ]:
        scenario = Counter()
        for block in blocks_after(log, marker):
            add(scenario, parse_debug_totals(block))
        print_totals(title, scenario)

    crash = Counter()
    for line in re.findall(r"crash test: \d+ seeds from \d+ in [\d.]+ s: (Totals \{.*\})", log):
        add(crash, parse_debug_totals(line))
    print_totals("Crash test", crash)

    batch = Counter()
    for seeds, prepared, committed in re.findall(
        r"(\d+) seeds: recoveries found (\d+) prepared and (\d+) committed parts", log
    ):
        batch.update(seeds=int(seeds), prepared=int(prepared), committed=int(committed))
    print(f"Batch crash test: {dict(batch) if batch else 'missing'}")

    writer = re.search(
        r"kill test: (\d+) cycles in ([\d.]+\w+): (\d+) acknowledged writes checked, (\d+) in "
        r"flight at kills, (\d+) kills while opening, slowest open ([\d.]+\w+)",
        log,
    )
    print(f"Kill loop, writer: {writer.groups() if writer else 'missing'}")
    server = re.search(r"server kill loop: (.*)", log)
    print(f"Kill loop, server: {server.group(1) if server else 'missing'}")
    lin = re.search(r"linearizability: (\d+ histories checked .*)", log)
    print(f"Linearizability: {lin.group(1) if lin else 'missing'}")


if __name__ == "__main__":
    main()
