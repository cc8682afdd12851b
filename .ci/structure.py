#!/usr/bin/env python3
"""The structure checks CI runs over every crate's src/ (docs/contributing.md).

    python3 .ci/structure.py [--max-fn-lines N] [CRATE/src ...]

1. No module circles. In each crate, module A depends on module B when A's
   code names `crate::B` (comments and the `#[cfg(test)]` tail do not
   count). A module is a top-level file or folder of src/. A cycle of any
   length fails.
2. No long functions. A non-test function (nothing under a `tests` folder,
   in a `tests.rs`, or after a file's `#[cfg(test)]`) may span at most N
   lines (default 60), from its `fn` line to its closing brace.

Exit 0 when both hold, 1 otherwise; every finding is printed.
"""
import argparse
import os
import re
import sys

FN = re.compile(r"^\s*(?:pub(?:\([a-z]+\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?fn\s+(\w+)")
CRATE_PATH = re.compile(r"crate::([a-z_][a-z0-9_]*)")
STRING = re.compile(r'"(?:\\.|[^"\\])*"')


def sources(src):
    """(path, top-level module) of every non-test .rs file under src."""
    for root, _, files in os.walk(src):
        if os.sep + "tests" in root:
            continue
        for name in sorted(files):
            if not name.endswith(".rs") or name == "tests.rs":
                continue
            path = os.path.join(root, name)
            top = os.path.relpath(path, src)[:-3].split(os.sep)[0]
            yield path, top


def before_tests(text):
    cut = text.find("#[cfg(test)]")
    return text if cut == -1 else text[:cut]


def module_graph(src):
    files = {}
    for path, top in sources(src):
        if top in ("lib", "main") or top.endswith("mod"):
            continue
        files.setdefault(top, []).append(path)
    graph = {m: set() for m in files}
    for m, paths in files.items():
        for p in paths:
            text = re.sub(r"//[^\n]*", "", before_tests(open(p, encoding="utf-8").read()))
            graph[m].update(t for t in CRATE_PATH.findall(text) if t in files and t != m)
    return graph


def cycles(graph):
    """Every elementary cycle, each reported once (rotated to its least module)."""
    found = set()

    def walk(start, node, path):
        for nxt in sorted(graph[node]):
            if nxt == start:
                found.add(tuple(path))
            elif nxt > start and nxt not in path:
                walk(start, nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, start, [start])
    return sorted(found, key=lambda c: (len(c), c))


def long_functions(src, limit):
    out = []
    for path, _ in sources(src):
        lines = before_tests(open(path, encoding="utf-8").read()).split("\n")
        i = 0
        while i < len(lines):
            m = FN.match(lines[i])
            if not m:
                i += 1
                continue
            depth, opened, j = 0, False, i
            while j < len(lines):
                code = STRING.sub('""', lines[j].split("//")[0])
                if not opened and ";" in code and "{" not in code:
                    break  # a declaration without a body
                depth += code.count("{") - code.count("}")
                opened = opened or "{" in code
                if opened and depth <= 0:
                    break
                j += 1
            if opened and j - i + 1 > limit:
                out.append((j - i + 1, f"{path}:{i + 1}", m.group(1)))
            i = j + 1 if opened else i + 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-fn-lines", type=int, default=60)
    ap.add_argument("srcs", nargs="*")
    args = ap.parse_args()
    # Every crate of the root workspace: top-level folders, and the fuzz
    # targets' harness (a member that lives under fuzz/).
    tops = [d for d in os.listdir(".") if os.path.isdir(d + "/src")] + ["fuzz/harness"]
    srcs = args.srcs or sorted(d + "/src" for d in tops if os.path.isdir(d + "/src"))
    bad = False
    for src in srcs:
        for c in cycles(module_graph(src)):
            print(f"circle in {src}: {' -> '.join(c + (c[0],))}")
            bad = True
    long = sorted((f for src in srcs for f in long_functions(src, args.max_fn_lines)), reverse=True)
    for n, where, name in long:
        print(f"function over {args.max_fn_lines} lines: {n:4d} {where} {name}")
    bad = bad or bool(long)
    print(f"structure: {len(srcs)} crates, "
          + ("no module circles, " if not any(cycles(module_graph(s)) for s in srcs) else "module circles found, ")
          + f"{len(long)} functions over {args.max_fn_lines} lines")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
