#!/usr/bin/env python3
"""Writes registrable_with_suffixes.txt beside this script: every domain of two
or more labels that has a Public Suffix List rule beneath it (amazonaws.com:
s3.amazonaws.com is a public suffix). A wildcard over such a domain covers
other people's sites, so the proposals never merge siblings into one.

Run it with the rules.txt of the psl crate pinned in the workspace
Cargo.toml, after changing that pin:

    python3 policy/data/gen_registrable_with_suffixes.py \\
        ~/.cargo/registry/src/*/psl-<version>/data/rules.txt
"""
import os
import sys

parents = set()
with open(sys.argv[1], encoding="utf-8") as rules:
    for line in rules:
        rule = line.strip()
        if not rule or rule.startswith("//"):
            continue
        rule = rule.lstrip("!")
        if rule.startswith("*."):
            rule = rule[2:]
        labels = rule.split(".")
        for i in range(1, len(labels) - 1):
            parents.add(".".join(labels[i:]).encode("idna").decode("ascii"))
out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "registrable_with_suffixes.txt")
with open(out, "w", encoding="ascii") as f:
    for d in sorted(parents):
        f.write(d + "\n")
print(f"{len(parents)} domains written to {out}")
