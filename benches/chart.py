#!/usr/bin/env python3
"""Draws the ratio-vs-direct figures of side-by-side summaries as an SVG bar chart.

    python3 benches/chart.py benches/results/intercept-*.md benches/results/splice-*.md > benches/ratios.svg

Reads the first markdown table of each summary (as run.sh prints it), takes the
"(0.51×)" ratios of the throughput rows, and draws one group of bars per metric,
one bar per column (peer). Standard library only.
"""
import re
import sys

ROWS = {
    "HTTPS keep-alive req/s": "keep-alive req/s",
    "new TLS conn/s": "new conns/s",
    "bulk MiB/s": "bulk MiB/s",
}
COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1"]


def table(path, label):
    lines = open(path).read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("| metric |"))
    head = [c.strip() for c in lines[start].strip("|").split("|")][1:]
    out = {}
    for l in lines[start + 2:]:
        if not l.startswith("|"):
            break
        cells = [c.strip() for c in l.strip("|").split("|")]
        for key, short in ROWS.items():
            if cells[0].startswith(key):
                for peer, cell in zip(head, cells[1:]):
                    m = re.search(r"\(([0-9.]+)×\)", cell)
                    if m:
                        name = f"gateway ({label})" if peer == "gateway" else peer
                        out.setdefault(short, {})[name] = float(m.group(1))
    return out


def main():
    data = {}
    for path in sys.argv[1:]:
        label = "splice" if "splice-" in path.rsplit("/", 1)[-1] else "intercept"
        for metric, peers in table(path, label).items():
            data.setdefault(metric, {}).update(peers)
    peers = sorted({p for m in data.values() for p in m}, key=lambda p: (p.startswith("gateway"), p))
    w, h, left, top, bottom = 760, 360, 60, 40, 80
    plot_h = h - top - bottom
    group_w = (w - left - 20) / max(len(data), 1)
    bar_w = group_w * 0.8 / max(len(peers), 1)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="20" font-size="14">Throughput as a fraction of direct (higher is better; one run, medians of 5 rounds)</text>']
    for t in [0, 0.25, 0.5, 0.75, 1.0]:
        y = top + plot_h * (1 - t)
        svg.append(f'<line x1="{left}" y1="{y:.1f}" x2="{w - 20}" y2="{y:.1f}" stroke="#ddd"/>')
        svg.append(f'<text x="{left - 8}" y="{y + 4:.1f}" text-anchor="end">{t:.2f}×</text>')
    for gi, (metric, values) in enumerate(data.items()):
        x0 = left + gi * group_w + group_w * 0.1
        for pi, peer in enumerate(peers):
            v = values.get(peer)
            if v is None:
                continue
            bh = plot_h * min(v, 1.0)
            x = x0 + pi * bar_w
            svg.append(f'<rect x="{x:.1f}" y="{top + plot_h - bh:.1f}" width="{bar_w - 2:.1f}" height="{bh:.1f}" fill="{COLORS[pi % len(COLORS)]}"/>')
            svg.append(f'<text x="{x + bar_w / 2 - 1:.1f}" y="{top + plot_h - bh - 3:.1f}" text-anchor="middle" font-size="9">{v:g}</text>')
        svg.append(f'<text x="{x0 + group_w * 0.4:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{metric}</text>')
    for pi, peer in enumerate(peers):
        x = left + pi * 110
        svg.append(f'<rect x="{x}" y="{h - 30}" width="10" height="10" fill="{COLORS[pi % len(COLORS)]}"/>')
        svg.append(f'<text x="{x + 14}" y="{h - 21}">{peer}</text>')
    svg.append("</svg>")
    print("\n".join(svg))


if __name__ == "__main__":
    main()
