#!/usr/bin/env python3
"""Instructions per request from a callgrind output file (benches/instr.sh).

    instr-top.py FILE REQUESTS [TOP] [--inclusive PATTERN]
    instr-top.py FILE REQUESTS [TOP] --diff BASE_FILE BASE_REQUESTS

First line: `total <instructions per request>`. Then the TOP functions by
their own instructions per request; with --inclusive, the functions whose
name contains PATTERN by their instructions including their callees' (what
they cost all told; a recursive function's own calls are not added twice);
with --diff, the functions whose own instructions per request moved most
from BASE_FILE's (an A/B's "where did it change"), FILE minus BASE.
Reads callgrind's compressed format itself: callgrind_annotate 3.19 puts
every cost of a file dumped with `callgrind_control -d` under `clone`.
"""
import collections
import re
import sys

NAME = re.compile(r"\((\d+)\)(?:\s+(.*))?")


def parse(path):
    """Own cost per function, and inclusive cost per (caller, callee)."""
    names = {}
    own = collections.Counter()
    calls = collections.Counter()
    fn = cfn = None
    call_line_next = False

    def name(token):
        m = NAME.match(token)
        if not m:
            return token
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), "?" + m.group(1))

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("fn="):
                fn = name(line[3:].strip())
            elif line.startswith("cfn="):
                cfn = name(line[4:].strip())
            elif line.startswith("calls="):
                call_line_next = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if len(parts) < 2:
                    continue
                cost = int(parts[1])
                if call_line_next:
                    calls[(fn, cfn)] += cost
                    call_line_next = False
                else:
                    own[fn] += cost
    return own, calls


def main():
    args = sys.argv[1:]
    pattern = None
    base = None
    if "--diff" in args:
        i = args.index("--diff")
        base = (args[i + 1], int(args[i + 2]))
        del args[i : i + 3]
    if "--inclusive" in args:
        i = args.index("--inclusive")
        pattern = args[i + 1]
        del args[i : i + 2]
    path, requests = args[0], int(args[1])
    top = int(args[2]) if len(args) > 2 else 25
    own, calls = parse(path)
    total = sum(own.values())
    print(f"total {total / requests:.0f}")
    if base is not None:
        base_own, _ = parse(base[0])
        print(f"base {sum(base_own.values()) / base[1]:.0f}")
        names = set(own) | set(base_own)
        moved = [(own[f] / requests - base_own[f] / base[1], f) for f in names]
        for d, f in sorted(moved, key=lambda m: -abs(m[0]))[:top]:
            print(f"{d:+10.1f}  {f}")
        return
    if pattern is None:
        for f, v in own.most_common(top):
            print(f"{v / requests:10.1f} {100 * v / total:6.2f}%  {f}")
        return
    inclusive = collections.Counter(own)
    for (caller, callee), v in calls.items():
        if caller != callee:
            inclusive[caller] += v
    rows = [(v, f) for f, v in inclusive.items() if pattern in f]
    for v, f in sorted(rows, reverse=True)[:top]:
        print(f"{v / requests:10.1f} {100 * v / total:6.2f}%  {f}")


if __name__ == "__main__":
    main()
