#!/usr/bin/env python3
"""The gateway column against each peer, from one side-by-side summary.

    python3 benches/vs-peers.py benches/results/intercept-<time>.md

Reads the results table and the CPU table as the testbed's run.sh prints them
(medians of one interleaved session) and prints one Markdown table: for
throughput, gateway ÷ peer (above 1: the gateway is faster); for latency, the
gateway's p50/p99 minus the peer's in ms; for CPU, gateway ÷ peer (below 1:
the gateway costs less). Standard library only.
"""
import re
import sys


def tables(path):
    """Every Markdown table of the file: a list of (header, rows)."""
    out, cur = [], None
    for line in open(path).read().splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cur is None:
                cur = (cells, [])
                out.append(cur)
            elif not set("".join(cells)) <= set("-:"):
                cur[1].append(cells)
        else:
            cur = None
    return out


def number(cell):
    m = re.match(r"[-+]?[0-9][0-9,]*\.?[0-9]*", cell)
    return float(m.group(0).replace(",", "")) if m else None


def main():
    # The results table and the CPU table; the spread table after them holds ranges.
    found = [t for t in tables(sys.argv[1]) if t[0][0] == "metric" and "gateway" in t[0]][:2]
    if not found:
        sys.exit("no table with a gateway column")
    peers = [p for p in found[0][0][1:] if p not in ("direct", "gateway")]
    if not peers:
        sys.exit("no peer besides direct and the gateway")
    print("| metric | " + " | ".join(f"gateway vs {p}" for p in peers) + " |")
    print("|---|" + "---:|" * len(peers))
    for header, rows in found:
        col = {name: i for i, name in enumerate(header)}
        for row in rows:
            metric = row[0]
            g = number(row[col["gateway"]])
            cells = []
            for p in peers:
                v = number(row[col[p]]) if p in col else None
                if g is None or v is None or v == 0:
                    cells.append("—")
                elif "latency" in metric:
                    cells.append(f"{g - v:+.2f} ms")
                elif "cores busy" in metric:
                    cells.append(f"{g:.2f} vs {v:.2f}")
                else:
                    cells.append(f"{g / v:.2f}×")
            print(f"| {metric} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
