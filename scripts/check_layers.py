#!/usr/bin/env python3
"""Fails when a source file imports upward across layers or two files import each other in a
circle (issue 21). Run by `make test` (and `make lint`); prints every finding.

How it reads the code: for each crate in CRATES, every `crate::a::b` and `super::x` path in a
file's code (comments and `#[cfg(test)] mod tests` blocks left out) is resolved to the deepest
module file it names, giving a graph of files. Then:

- circles: a strongly connected set of two or more files. An edge from a folder's `mod.rs` to a
  file inside that folder is not counted: the folder's face declares and assembles its parts,
  and the parts may use the types it defines;
- layers: each crate lists its layers bottom to top (module path prefixes); a file may import
  its own layer and those below, never one above. Shared modules (limits, errors, ...) sit at
  the bottom;
- rules: pairs (importer prefix, imported prefix) that must never appear, for seams the layer
  order alone does not express (engine-neutral code must not name an engine's internals).

KNOWN listed the findings that existed when the check was written (issue 21), reported without
failing while they were removed; it is empty now. A finding not on it fails, and so does an
entry of KNOWN that no longer occurs (the list only shrinks).

Usage: python3 scripts/check_layers.py [--graph]
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# crate directory -> (layers bottom to top, each a list of module path prefixes; rules).
CRATES = {
    "crates/copse": (
        [
            ["limits", "hash"],
            ["device"],
            ["error"],
            ["engine"],
            ["shard"],
            ["router"],
            ["store"],
            ["interfaces"],
            ["fuzz"],
            [""],  # lib.rs: the crate root re-exports from every layer
        ],
        [
            # Engine-neutral code must not depend on one engine's encodings (`=engine` is the
            # module engine/mod.rs alone, not its folder).
            ("=engine", "engine::native"),
            ("=engine", "engine::rocks"),
            ("engine::input", "engine::native"),
            ("engine::part", "engine::native"),
            ("engine::input", "engine::rocks"),
            ("engine::part", "engine::rocks"),
            # Above the engine layer nothing names an engine's internals (the engine factory
            # and the neutral stats shape are the seam).
            ("shard", "engine::native"),
            ("router", "engine::native"),
            ("store", "engine::native"),
            ("interfaces", "engine::native"),
            ("shard", "engine::rocks"),
            ("router", "engine::rocks"),
            ("store", "engine::rocks"),
            ("interfaces", "engine::rocks"),
        ],
    ),
    "crates/copse-server": (
        [
            ["config", "resp", "fds", "waiters", "glob", "pubsub"],
            ["keyspace", "databases"],
            ["context"],
            ["cmd"],
            ["net"],
            [""],
        ],
        [],
    ),
    "crates/copse-bench": (
        [
            ["generator", "device", "plot", "flamegraph"],
            ["workload", "engine"],
            ["report", "runner"],
            ["run_args"],
            ["compare"],
            ["cli"],
            [""],
        ],
        [],
    ),
}

# Findings that existed when this check was written (2026-11-25), removed as issue 21 proceeds.
KNOWN = {
    # Empty since 2026-11-25: every circle, upward import and seam break found when the check
    # was written is gone. Add nothing here; fix the import instead.
}


def module_of(crate_src, path):
    """`engine::native::batch` for crate_src/engine/native/batch.rs; `` for lib.rs."""
    rel = os.path.relpath(path, crate_src)[:-3]
    parts = rel.split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return "::".join(parts)


def strip_code(text):
    """The file's code without comments, string contents and its test module."""
    test = re.search(r"#\[cfg\(test\)\]\s*mod tests\b", text)
    if test:
        text = text[: test.start()]
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    return text


def expand_use_groups(code):
    """`crate::a::{b, c::d}` -> `crate::a::b`, `crate::a::c::d` (nested groups too)."""
    out = []
    for match in re.finditer(r"\b(crate|super|self)((?:::\w+)*)::\{", code):
        depth, i = 1, match.end()
        while i < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            i += 1
        inner = code[match.end() : i - 1]
        prefix = match.group(1) + match.group(2)
        for item in split_top(inner):
            item = item.strip()
            if item and item != "self":
                out.extend(expand_use_groups(f"{prefix}::{item}") or [f"{prefix}::{item}"])
            elif item == "self":
                out.append(prefix)
    return out


def split_top(text):
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def paths_in(code):
    found = re.findall(r"\b(?:crate|super|self)(?:::\w+)+", code)
    found += expand_use_groups(code)
    return found


def resolve_relative(path, module, modules, is_mod_file):
    """Resolves `super::`/`self::` paths: in a plain file, `self` is the file's module and
    `super` its folder's; in a mod.rs, `self` is the folder's module and `super` the parent's."""
    segments = path.split("::")
    if segments[0] == "crate":
        names = segments[1:]
    else:
        current = module.split("::") if module else []
        while segments and segments[0] in ("self", "super"):
            if segments[0] == "super":
                current = current[:-1]
            segments = segments[1:]
        names = current + segments
    for n in range(len(names), -1, -1):
        candidate = "::".join(names[:n])
        if candidate in modules:
            return candidate
    return None


def root_reexports(lib_path, modules):
    """Name -> defining module for every `pub use` of the crate root."""
    if lib_path is None:
        return {}
    code = strip_code(open(lib_path, encoding="utf-8").read())
    names = {}
    for statement in re.findall(r"pub use ([^;]+);", code):
        for path in expand_use_groups(statement) or [statement]:
            path = path.strip()
            if " as " in path:
                path, alias = [p.strip() for p in path.split(" as ")]
            else:
                alias = path.split("::")[-1]
            target = resolve_relative("crate::" + path, "", modules, True)
            if target:
                names[alias] = target
    return names


def layer_of(module, layers):
    best, best_len = None, -1
    for rank, prefixes in enumerate(layers):
        for prefix in prefixes:
            if prefix == "" and module == "":
                return rank
            if prefix and (module == prefix or module.startswith(prefix + "::")):
                if len(prefix) > best_len:
                    best, best_len = rank, len(prefix)
    return best


def under(module, prefix):
    """Whether `module` is `prefix` or inside it; `=name` matches the module `name` alone."""
    if prefix.startswith("="):
        return module == prefix[1:]
    return module == prefix or module.startswith(prefix + "::")


def strongly_connected(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on.discard(top)
                group.append(top)
                if top == node:
                    break
            out.append(group)

    sys.setrecursionlimit(10000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def cycle_through(group, graph):
    """One circle through the group's smallest member, for the message."""
    members = set(group)
    start = min(group)
    path, seen = [start], {start}

    def walk(node):
        for nxt in sorted(graph.get(node, ())):
            if nxt == start and len(path) > 1:
                return True
            if nxt in members and nxt not in seen:
                seen.add(nxt)
                path.append(nxt)
                if walk(nxt):
                    return True
                path.pop()
        return False

    walk(start)
    return " -> ".join(path + [start])


def check_crate(crate, layers, rules, show_graph):
    src = os.path.join(ROOT, crate, "src")
    files = {}
    for folder, _, names in os.walk(src):
        for name in names:
            if name.endswith(".rs"):
                path = os.path.join(folder, name)
                files[module_of(src, path)] = path
    modules = set(files)
    reexports = root_reexports(files.get(""), modules)
    graph = {}
    for module, path in files.items():
        code = strip_code(open(path, encoding="utf-8").read())
        targets = set()
        for found in paths_in(code):
            target = resolve_relative(found, module, modules, path.endswith("mod.rs"))
            if target == "" and found.startswith("crate::"):
                # A name the crate root re-exports: the module that defines it.
                target = reexports.get(found.split("::")[1])
            if target is not None and target != module:
                targets.add(target)
        graph[module] = targets
    findings = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            mine, theirs = layer_of(module, layers), layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                findings.append(f"upward: {module or 'lib'} imports {target}")
            for importer, imported in rules:
                if under(module, importer) and under(target, imported):
                    findings.append(f"rule: {module} imports {target} ({importer} must not use {imported})")
    # A folder's face (mod.rs, lib.rs) declaring and using its own parts is not a circle.
    counted = {
        module: {t for t in targets if not (files[module].endswith(("mod.rs", "lib.rs")) and module != t and (module == "" or t.startswith(module + "::")))}
        for module, targets in graph.items()
    }
    for group in strongly_connected(counted):
        if len(group) > 1:
            findings.append("circle: " + cycle_through(group, counted))
    if show_graph:
        for module, targets in sorted(graph.items()):
            print(f"{crate} {module or 'lib'} -> {', '.join(sorted(targets))}")
    return findings


def main():
    show_graph = "--graph" in sys.argv
    failed = False
    for crate, (layers, rules) in CRATES.items():
        findings = check_crate(crate, layers, rules, show_graph)
        known = KNOWN.get(crate, set())
        for finding in findings:
            if finding in known:
                print(f"{crate}: known (issue 21): {finding}")
            else:
                print(f"{crate}: NEW: {finding}")
                failed = True
        for stale in sorted(known - set(findings)):
            print(f"{crate}: fixed, remove from KNOWN in scripts/check_layers.py: {stale}")
            failed = True
    if failed:
        print("check_layers: FAILED (an upward import or an import circle; see ARCHITECTURE.md)")
        sys.exit(1)
    print("check_layers: no new upward import or circle")


if __name__ == "__main__":
    main()
