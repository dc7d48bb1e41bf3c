#!/usr/bin/env python3
"""Layout figures of one git revision, as markdown (issue 21's before/after table).

Usage: python3 scripts/layout_stats.py [REV] [--top N] [--per-crate]

REV (default HEAD) is exported with `git archive` into a temporary directory, removed
afterwards; the working tree and the index are not touched. Only `crates/*/src/**.rs` is read
(integration tests, examples and benches are not counted).

What is counted, after a small lexer has blanked comments (`//`, nested `/* */`, doc comments),
string, byte-string, raw-string and char literals:

- test code: an item gated by `#[cfg(test)]` (or `cfg(all(.., test, ..))`), from its attribute
  to its closing brace or semicolon (`mod tests { .. }`, a `mod testing`, a test-only fn), a file
  that such a `mod x;` declares, and a file starting with `#![cfg(test)]`. "Outside tests" lines
  are a file's lines minus those of its test items;
- public items: `pub` followed (after `const`/`async`/`unsafe`/`extern` qualifiers) by `fn`,
  `struct`, `enum`, `trait`, `const`, `static`, `type`, `mod`, `use` or `union`, outside test
  code; `pub(crate)`, `pub(super)` and `pub(in ..)` are not public. A `pub use` statement counts
  once however many names it brings. "Reachable" counts those in files whose module is reached
  from the crate root (lib.rs) through `pub mod` declarations alone (a module declared with the
  crate's `layer!`/`module!` macro is `pub(crate)` in a default build, so it does not count);
- functions: `fn name` items with a body, outside test code (a trait method declared without a
  default body is not counted);
- asserts: `assert!`, `assert_eq!`, `assert_ne!` (release) and `debug_assert!`,
  `debug_assert_eq!`, `debug_assert_ne!` (debug), outside test code;
- import circles, upward imports and seam-rule breaks: scripts/check_layers.py's check_crate
  (the checker next to this script, whatever the revision examined), for the crates its CRATES
  lists. Its KNOWN list is not consulted: every finding is counted.
"""

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(SCRIPTS)
OVER = 800  # the ceiling for a file's lines outside tests

IDENT = re.compile(r"[A-Za-z0-9_]")


def strip_rust(text):
    """`text` with comments blanked and literals emptied (`""`, `' '`); newlines are kept, so
    offsets change but line numbers of what remains do not."""
    out = []
    i, n = 0, len(text)

    def blank(chunk):
        return "".join("\n" if c == "\n" else " " for c in chunk)

    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            end = text.find("\n", i)
            end = n if end < 0 else end
            out.append(blank(text[i:end]))
            i = end
        elif c == "/" and nxt == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif c in "rbc" and (i == 0 or not IDENT.match(text[i - 1])):
            # r"..", r#".."#, br"..", cr"..", b"..", c"..", b'..'
            m = re.compile(r'(?:b|c)?r(#*)"').match(text, i)
            if m:
                close = '"' + m.group(1)
                end = text.find(close, m.end())
                end = n if end < 0 else end + len(close)
                out.append('""' + blank(text[i:end])[2:])
                i = end
            elif nxt in "\"'" and c in "bc":
                out.append(" ")
                i += 1
            else:
                m = re.compile(r"\w+").match(text, i)
                out.append(m.group(0))
                i = m.end()
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append('""' + blank(text[i:j])[2:])
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}', '\'') or a lifetime/label ('a, 'static).
            if nxt == "\\":
                j = i + 1
                while j < n and text[j] != "'":
                    j += 2 if text[j] == "\\" else 1
                j = min(j + 1, n)
                out.append("' '" + blank(text[i:j])[3:])
                i = j
            elif i + 2 < n and text[i + 2] == "'" and nxt != "\n":
                out.append("' '")
                i += 3
            else:
                out.append("'")
                i += 1
        elif IDENT.match(c):
            m = re.compile(r"\w+").match(text, i)
            out.append(m.group(0))
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


TEST_ATTR = re.compile(r"#\[\s*cfg\s*\(\s*(?:test\s*|all\s*\([^\]]*\btest\b[^\]]*\)\s*)\)\s*\]")


def item_end(code, i):
    """End offset of the item starting at `i` (after its attributes): its matching `}` or the
    first `;` outside brackets."""
    n, depth = len(code), 0
    while i < n:
        c = code[i]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == ";" and depth <= 0:
            return i + 1
        elif c == "{" and depth <= 0:
            braces = 0
            while i < n:
                if code[i] == "{":
                    braces += 1
                elif code[i] == "}":
                    braces -= 1
                    if braces == 0:
                        return i + 1
                i += 1
            return n
        i += 1
    return n


def skip_attributes(code, i):
    while True:
        m = re.compile(r"\s*#\[").match(code, i)
        if not m:
            return re.compile(r"\s*").match(code, i).end()
        depth, j = 1, m.end()
        while j < len(code) and depth:
            depth += {"[": 1, "]": -1}.get(code[j], 0)
            j += 1
        i = j


def test_spans(code):
    """(start, end, text of the item) for each `#[cfg(test)]` item of stripped code."""
    spans = []
    pos = 0
    while True:
        m = TEST_ATTR.search(code, pos)
        if not m:
            return spans
        start = skip_attributes(code, m.end())
        end = item_end(code, start)
        spans.append((m.start(), end, code[start:end]))
        pos = end


def without_spans(code, spans):
    parts, last = [], 0
    for start, end, _ in spans:
        parts.append(code[last:start])
        parts.append("".join("\n" if c == "\n" else " " for c in code[start:end]))
        last = end
    parts.append(code[last:])
    return "".join(parts)


PUB_ITEM = re.compile(
    r"\bpub\s+(?:(?:const|async|unsafe|extern(?:\s*\"\")?)\s+)*"
    r"(fn|struct|enum|trait|const|static|type|mod|use|union)\b"
)
FN = re.compile(r"\bfn\s+(?:r#)?[A-Za-z_]\w*")
ASSERT = re.compile(r"(?<!\w)(debug_)?assert(?:_eq|_ne)?\s*!")
MOD_DECL = re.compile(r"(?:\b(pub)(\s*\([^)]*\))?\s+)?\bmod\s+(?:r#)?(\w+)\s*([;{])")
# A module declared through the crate's `layer!(name)` / `module!(name)` macro (lib.rs): crate-
# private in a default build, public only under the `testing` feature, so not reachable.
MACRO_MOD_DECL = re.compile(r"\b(?:layer|module)!\s*\(\s*(\w+)\s*\)")
KINDS = ["fn", "struct", "enum", "trait", "const", "static", "type", "mod", "use", "union"]


def count_fns(code):
    count = 0
    for m in FN.finditer(code):
        depth, i = 0, m.end()
        while i < len(code):
            c = code[i]
            if c in "([<":
                depth += 1
            elif c in ")]>" and not (c == ">" and code[i - 1] == "-"):
                depth -= 1
            elif c == "{" and depth <= 0:
                count += 1
                break
            elif c == ";" and depth <= 0:
                break
            i += 1
    return count


def module_of(src, path):
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib", "main"):
        rel = rel[:-1]
    return "::".join(rel)


def analyse_crate(crate_dir):
    src = os.path.join(crate_dir, "src")
    files = {}
    for folder, _, names in os.walk(src):
        for name in sorted(names):
            if name.endswith(".rs"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    files[path] = f.read()
    parsed = {}
    test_files = set()
    for path, text in files.items():
        code = strip_rust(text)
        spans = test_spans(code)
        if re.match(r"\s*#!\[\s*cfg\s*\(\s*test\s*\)\s*\]", code):
            spans = [(0, len(code), code)]
        folder = os.path.dirname(path)
        if os.path.basename(path) not in ("mod.rs", "lib.rs", "main.rs"):
            folder = path[:-3]
        for _, _, item in spans:
            m = re.match(r"(?:pub\s*(?:\([^)]*\))?\s*)?mod\s+(\w+)\s*;", item)
            if m:
                for candidate in (m.group(1) + ".rs", os.path.join(m.group(1), "mod.rs")):
                    test_files.add(os.path.normpath(os.path.join(folder, candidate)))
        parsed[path] = (code, spans)

    stats = {
        "files": 0, "lines": 0, "outside": 0, "over_total": 0, "over_outside": 0,
        "pub": {k: 0 for k in KINDS}, "reachable": 0, "fns": 0, "asserts": 0, "debug_asserts": 0,
        "largest": [], "root_pub_mods": None,
    }
    # module -> {child: declared pub}, from non-test code
    children, pub_counts = {}, {}
    for path, text in files.items():
        code, spans = parsed[path]
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if os.path.normpath(path) in test_files:
            spans = [(0, len(code), code)]
        test_lines = set()
        for start, end, _ in spans:
            first = code.count("\n", 0, start)
            last = code.count("\n", 0, max(start, end - 1))
            test_lines.update(range(first, last + 1))
        outside = lines - len([l for l in test_lines if l < lines])
        live = without_spans(code, spans)
        stats["files"] += 1
        stats["lines"] += lines
        stats["outside"] += outside
        stats["over_total"] += lines > OVER
        stats["over_outside"] += outside > OVER
        rel = os.path.relpath(path, os.path.dirname(os.path.dirname(crate_dir)))
        stats["largest"].append((lines, outside, rel))
        count = 0
        for m in PUB_ITEM.finditer(live):
            stats["pub"][m.group(1)] += 1
            count += 1
        module = module_of(src, path)
        if os.path.basename(path) == "main.rs" or os.path.relpath(path, src).startswith("bin" + os.sep):
            module = "#bin " + os.path.relpath(path, src)  # a binary's modules are not reachable
        pub_counts[module] = count
        children[module] = {
            m.group(3): bool(m.group(1)) and not m.group(2) for m in MOD_DECL.finditer(live)
        }
        for m in MACRO_MOD_DECL.finditer(live):
            children[module].setdefault(m.group(1), False)
        stats["fns"] += count_fns(live)
        for m in ASSERT.finditer(live):
            stats["debug_asserts" if m.group(1) else "asserts"] += 1
    lib = os.path.join(src, "lib.rs")
    if lib in files:
        stats["root_pub_mods"] = sorted(c for c, public in children.get("", {}).items() if public)
        for module, count in pub_counts.items():
            if module.startswith("#bin"):
                continue
            parts, parent, reachable = module.split("::") if module else [], "", True
            for part in parts:
                reachable = reachable and children.get(parent, {}).get(part, False)
                parent = f"{parent}::{part}" if parent else part
            if reachable:
                stats["reachable"] += count
    return stats


def load_checker():
    spec = importlib.util.spec_from_file_location("check_layers", os.path.join(SCRIPTS, "check_layers.py"))
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    return checker


def import_findings(checker, tree, crate):
    """The checker's findings for `crate` in `tree`, or None when the checker has no layers
    for that crate."""
    if crate not in checker.CRATES:
        return None
    checker.ROOT = tree
    layers, rules = checker.CRATES[crate]
    return checker.check_crate(crate, layers, rules, False)


def export(rev, into):
    archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", rev, "crates"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)


def ratio(a, b):
    return f"{a / b:.3f}" if b else "–"


def largest_table(files, top):
    rows = ["| file | lines | outside tests |", "|---|--:|--:|"]
    for lines, outside, rel in sorted(files, key=lambda f: (-f[0], -f[1], f[2]))[:top]:
        mark = f" **>{OVER}**" if outside > OVER else ""
        rows.append(f"| {rel} | {lines} | {outside}{mark} |")
    return rows


def report(rev, top, per_crate):
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", rev + "^{commit}"],
                            check=True, capture_output=True, text=True).stdout.strip()
    date = subprocess.run(["git", "-C", ROOT, "show", "-s", "--format=%cs", commit],
                          check=True, capture_output=True, text=True).stdout.strip()
    tree = tempfile.mkdtemp(prefix="layout_stats.")
    try:
        export(commit, tree)
        crates = sorted(d for d in os.listdir(os.path.join(tree, "crates"))
                        if os.path.isdir(os.path.join(tree, "crates", d, "src")))
        results = {}
        checker = load_checker()
        for crate in crates:
            stats = analyse_crate(os.path.join(tree, "crates", crate))
            stats["findings"] = import_findings(checker, tree, f"crates/{crate}")
            results[crate] = stats
    finally:
        shutil.rmtree(tree, ignore_errors=True)

    out = [f"Revision `{rev}` = {commit[:10]} (committed {date}); `crates/*/src` only.", ""]

    def found(stats, kind):
        if stats["findings"] is None:
            return None
        return sum(1 for f in stats["findings"] if f.startswith(kind + ":"))

    def show(value):
        return "not checked" if value is None else str(value)

    out += [
        "| crate | .rs files | lines | outside tests | files > 800 lines (total / outside tests) "
        "| public items (reachable) | root `pub mod` | circles | upward imports | seam-rule breaks "
        "| fns | `assert*!` | `debug_assert*!` | asserts per fn: all (release only) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    total = {"files": 0, "lines": 0, "outside": 0, "over_total": 0, "over_outside": 0, "pub": 0,
             "reachable": 0, "mods": 0, "circle": 0, "upward": 0, "rule": 0, "fns": 0,
             "asserts": 0, "debug_asserts": 0}
    for crate, s in results.items():
        pub = sum(s["pub"].values())
        mods = s["root_pub_mods"]
        kinds = {k: found(s, k) for k in ("circle", "upward", "rule")}
        out.append(
            f"| {crate} | {s['files']} | {s['lines']} | {s['outside']} "
            f"| {s['over_total']} / {s['over_outside']} | {pub} ({s['reachable']}) "
            f"| {'– (no lib.rs)' if mods is None else len(mods)} "
            f"| {show(kinds['circle'])} | {show(kinds['upward'])} | {show(kinds['rule'])} "
            f"| {s['fns']} | {s['asserts']} | {s['debug_asserts']} "
            f"| {ratio(s['asserts'] + s['debug_asserts'], s['fns'])} ({ratio(s['asserts'], s['fns'])}) |"
        )
        for key in ("files", "lines", "outside", "over_total", "over_outside", "reachable", "fns",
                    "asserts", "debug_asserts"):
            total[key] += s[key]
        total["pub"] += pub
        total["mods"] += len(mods or [])
        for key, value in kinds.items():
            total[key] += value or 0
    t = total
    out.append(
        f"| **total** | {t['files']} | {t['lines']} | {t['outside']} | {t['over_total']} / {t['over_outside']} "
        f"| {t['pub']} ({t['reachable']}) | {t['mods']} | {t['circle']} | {t['upward']} | {t['rule']} "
        f"| {t['fns']} | {t['asserts']} | {t['debug_asserts']} "
        f"| {ratio(t['asserts'] + t['debug_asserts'], t['fns'])} ({ratio(t['asserts'], t['fns'])}) |"
    )

    out += ["", f"The {top} largest files (all crates, by total lines):", ""]
    out += largest_table([f for s in results.values() for f in s["largest"]], top)
    if per_crate:
        for crate, s in results.items():
            out += ["", f"The {top} largest files of {crate}:", ""]
            out += largest_table(s["largest"], top)

    out += ["", "Public items by kind:", "",
            "| crate | " + " | ".join(f"`{k}`" for k in KINDS) + " |",
            "|---|" + "--:|" * len(KINDS)]
    for crate, s in results.items():
        out.append(f"| {crate} | " + " | ".join(str(s["pub"][k]) for k in KINDS) + " |")
    out.append("| **total** | " + " | ".join(str(sum(s["pub"][k] for s in results.values())) for k in KINDS) + " |")

    out += ["", "`pub mod` at each crate root (lib.rs):", ""]
    for crate, s in results.items():
        mods = s["root_pub_mods"]
        text = "no lib.rs" if mods is None else (", ".join(f"`{m}`" for m in mods) or "none")
        out.append(f"- {crate}: {text}")

    out += ["", "Import findings (scripts/check_layers.py, every finding, KNOWN list ignored):", ""]
    for crate, s in results.items():
        if s["findings"] is None:
            out.append(f"- {crate}: not checked (no layers in check_layers.py)")
        elif not s["findings"]:
            out.append(f"- {crate}: none")
        else:
            for finding in sorted(s["findings"], key=lambda f: (not f.startswith("circle"), not f.startswith("upward"), f)):
                out.append(f"- {crate}: {finding}")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("rev", nargs="?", default="HEAD")
    parser.add_argument("--top", type=int, default=10, help="how many of the largest files to list")
    parser.add_argument("--per-crate", action="store_true", help="also list the largest files of each crate")
    args = parser.parse_args()
    try:
        print(report(args.rev, args.top, args.per_crate))
    except subprocess.CalledProcessError as error:
        detail = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr
        sys.exit(f"layout_stats: {' '.join(error.cmd)} failed: {(detail or '').strip()}")


if __name__ == "__main__":
    main()
