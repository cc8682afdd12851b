#!/usr/bin/env python3
"""Throughput of each column as a fraction of direct, as an SVG bar chart (standard library only).

    chart.py SUMMARY.md [SUMMARY.md ...] > ratios.svg

Reads the results table (the first Markdown table) of each benches/peers
summary and takes the "(0.48×)" per-round-median ratios of the throughput
rows: keep-alive, new connections resumed and full handshake, bulk, HTTP/2.
One group of bars per figure, one bar per column; with several summaries the
gateway, and any column in more than one of them, is labelled with each
session's mode ("gateway (splice)", "squid-splice (intercept)"): a ratio is
only comparable with the others of its own session.  A column without
HTTP/2 (Squid bump negotiates no ALPN) is marked "no h2".  A dashed line marks
direct (1.0×); bars above 1.2× are clipped and labelled.
"""
import html
import re
import sys

FIGURES = [
    ("HTTPS keep-alive req/s", "keep-alive req/s"),
    ("new TLS conn/s, resumed", "new conns/s, resumed"),
    ("new TLS conn/s, full handshake", "new conns/s, full"),
    ("bulk MiB/s", "bulk MiB/s"),
    ("HTTP/2 req/s", "HTTP/2 req/s"),
]
COLORS = {"mitmproxy": "#b07aa1", "squid-bump": "#e15759", "squid-splice": "#f28e2b",
          "squid-splice (intercept)": "#f28e2b", "squid-splice (splice)": "#ffbe7d",
          "gateway": "#4e79a7", "gateway (intercept)": "#4e79a7", "gateway (splice)": "#59a14f"}
SPARE = ["#76b7b2", "#edc948", "#9c755f", "#bab0ac"]


def read(path):
    text = open(path).read()
    m = re.search(r"gateway mode \*\*(\w+)\*\*", text)
    mode = m.group(1) if m else ("splice" if "splice" in path.rsplit("/", 1)[-1] else "intercept")
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| metric |"))
    head = [c.strip() for c in lines[start].strip().strip("|").split("|")][1:]
    ratios = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for prefix, short in FIGURES:
            if cells[0].startswith(prefix):
                for col, value in zip(head, cells[1:]):
                    r = re.search(r"\(([0-9.]+)×\)", value)
                    if r:
                        ratios.setdefault(short, {})[col] = float(r.group(1))
                    elif "no HTTP/2" in value:
                        ratios.setdefault(short, {})[col] = None  # drawn as "no h2"
    return mode, ratios


def main():
    paths = sys.argv[1:]
    if not paths:
        sys.exit(__doc__)
    data, cols, runs = {}, [], [read(path) for path in paths]
    seen = {}
    for mode, ratios in runs:
        for col in {c for per_col in ratios.values() for c in per_col}:
            seen[col] = seen.get(col, 0) + 1
    for mode, ratios in runs:
        for figure, per_col in ratios.items():
            for col, v in per_col.items():
                # A column in several summaries is one bar per session, labelled with its mode.
                name = "%s (%s)" % (col, mode) if seen[col] > 1 or (col == "gateway" and len(runs) > 1) else col
                if name in data.get(figure, {}):
                    continue
                data.setdefault(figure, {})[name] = v
                if name not in cols:
                    cols.append(name)
    cols.sort(key=lambda c: (c.startswith("gateway"), c))
    figures = [short for _, short in FIGURES if short in data]
    colors = {c: COLORS.get(c) or SPARE[i % len(SPARE)] for i, c in enumerate(cols)}

    w, h, left, right, top, bottom = 820, 380, 56, 16, 44, 86
    plot_w, plot_h, top_v = w - left - right, h - top - bottom, 1.2
    group = plot_w / max(len(figures), 1)
    bar = group * 0.84 / max(len(cols), 1)
    y = lambda v: top + plot_h * (1 - min(v, top_v) / top_v)  # noqa: E731
    svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">' % (w, h),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="20" font-size="14">Throughput as a fraction of direct (median of per-round ratios; higher is better)</text>' % left]
    for t in (0, 0.25, 0.5, 0.75, 1.0):
        svg.append('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="%s"%s/>'
                   % (left, y(t), w - right, y(t), "#555" if t == 1.0 else "#ddd", ' stroke-dasharray="5,3"' if t == 1.0 else ""))
        svg.append('<text x="%d" y="%.1f" text-anchor="end">%.2f×</text>' % (left - 6, y(t) + 4, t))
    svg.append('<text x="%d" y="%.1f" font-size="10" fill="#555">= direct</text>' % (left + 4, y(1.0) - 4))
    for gi, figure in enumerate(figures):
        x0 = left + gi * group + group * 0.08
        for ci, col in enumerate(cols):
            if col not in data[figure]:
                continue
            v, x = data[figure][col], x0 + ci * bar
            if v is None:
                svg.append('<text x="%.1f" y="%.1f" text-anchor="middle" font-size="8" fill="#555">no h2</text>'
                           % (x + bar / 2 - 1, top + plot_h - 16))
                continue
            svg.append('<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s, %s: %g×</title></rect>'
                       % (x, y(v), max(bar - 2, 1), top + plot_h - y(v), colors[col], html.escape(col), html.escape(figure), v))
            label = ("%.2f" % v if v >= 0.1 else "%.3f" % v) + ("▲" if v > top_v else "")
            svg.append('<text x="%.1f" y="%.1f" text-anchor="middle" font-size="8">%s</text>' % (x + bar / 2 - 1, y(v) - 3, label))
        svg.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>' % (x0 + group * 0.42, top + plot_h + 16, html.escape(figure)))
    x, row = left, 0
    for col in cols:
        width = 14 + 6.5 * len(col) + 18  # about 6.5 px per character at 11 px
        if x + width > w - right and x > left:
            x, row = left, row + 1
        yy = h - 44 + row * 18
        svg.append('<rect x="%.0f" y="%d" width="10" height="10" fill="%s"/>' % (x, yy, colors[col]))
        svg.append('<text x="%.0f" y="%d">%s</text>' % (x + 14, yy + 9, html.escape(col)))
        x += width
    svg.append("</svg>")
    print("\n".join(svg))


if __name__ == "__main__":
    main()
