#!/usr/bin/env python3
"""Summary of a benches/peers results directory as Markdown (standard library only).

    summarize.py RESULTS_DIR [--json FILE]

Reads RESULTS_DIR/runs.tsv (one line per run), the raw outputs it names and
env.txt.  Every cell is the median over rounds; a ratio (×) or added latency
(+ ms) is the median of the per-round values against the direct run of the
same round and test (taken seconds apart), not a ratio of medians.  Prints:
the results table, the CPU table, the spread across rounds (values and
per-round ratios) and sanity lines.  --json also writes the medians and
ratios for other tools.
"""
import argparse
import csv
import json
import os
import re
import statistics
import sys
from collections import defaultdict

SIZE = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def wrk(text):
    out = {}
    m = re.search(r"Requests/sec:\s+([\d.]+)", text)
    if m:
        out["rate"] = float(m.group(1))
    m = re.search(r"Transfer/sec:\s+([\d.]+)([KMGT]?B)", text)
    if m:
        out["mib_s"] = float(m.group(1)) * SIZE[m.group(2)] / (1 << 20)
    m = re.search(r"(\d+) requests in", text)
    out["count"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    errors = sum(int(x) for x in m.groups()) if m else 0
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors += int(m.group(1)) if m else 0
    out["errors"] = errors
    return out


def h2load(text):
    out = {}
    m = re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", text)
    if m:
        out["rate"] = float(m.group(1))
    m = re.search(r"requests: (\d+) total, \d+ started, \d+ done, (\d+) succeeded, (\d+) failed, (\d+) errored, (\d+) timeout", text)
    if m:
        out["count"] = int(m.group(2))
        out["errors"] = int(m.group(3)) + int(m.group(4)) + int(m.group(5))
    m = re.search(r"Application protocol: (\S+)", text)
    out["proto"] = m.group(1) if m else None
    return out


def last_json(text):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return {}


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def num(v):
    if v is None:
        return "n/a"
    if abs(v) >= 100:
        return "{:,.0f}".format(v)
    if abs(v) >= 10:
        return "{:.1f}".format(v)
    return "{:.2f}".format(v)


def ratio(v):
    return "{:.3f}".format(v) if v < 0.1 else "{:.2f}".format(v)


class Runs:
    def __init__(self, directory):
        self.dir = directory
        self.env = {}
        path = os.path.join(directory, "env.txt")
        if os.path.exists(path):
            for line in open(path):
                key, _, value = line.partition(":")
                self.env[key.strip()] = value.strip()
        self.values = defaultdict(lambda: defaultdict(dict))  # metric -> peer -> round -> value
        self.notes = defaultdict(lambda: defaultdict(list))  # peer -> kind -> [str]
        self.rounds = set()
        for row in csv.DictReader(open(os.path.join(directory, "runs.tsv")), delimiter="\t"):
            self.add(row)

    def add(self, row):
        rnd, test, peer = int(row["round"]), row["test"], row["peer"]
        self.rounds.add(rnd)
        raw = os.path.join(self.dir, row["raw"])
        text = open(raw).read() if os.path.exists(raw) else ""
        cpu = float(row["cpu_s"]) if row["cpu_s"] else None
        wall = float(row["wall_s"])
        conns, syns = int(row["cl_conns"]), int(row["origin_syns"])
        v, note = self.values, self.notes[peer]
        tag = "%s r%d" % (test, rnd)

        def cost(key, count, scale):
            if cpu is not None and count:
                v[key][peer][rnd] = cpu * scale / count
            if cpu is not None and test in ("ka", "h2"):
                v[test + "_cores"][peer][rnd] = cpu / wall

        if test in ("ka", "bulk"):
            r = wrk(text)
            if "rate" not in r or not r["count"]:
                note["failed"].append(tag)
                return
            if r["errors"]:
                note["errors"].append("%s: %d" % (tag, r["errors"]))
            if test == "ka":
                v["ka"][peer][rnd] = r["rate"]
                cost("ka_cpu", r["count"], 1e6)
                note["ka_conns"].append(conns)
                note["ka_syns"].append(syns)
            else:
                v["bulk"][peer][rnd] = r["mib_s"]
                cost("bulk_cpu", r["count"], 1024.0)  # s per GiB: count MiB bodies
        elif test in ("newres", "newfull"):
            r = last_json(text)
            if not r.get("ok"):
                note["failed"].append("%s%s" % (tag, ": " + r["first_error"] if r.get("first_error") else ""))
                return
            if r.get("errors"):
                note["errors"].append("%s: %d (%s)" % (tag, r["errors"], r.get("first_error", "")))
            v[test][peer][rnd] = r["rate"]
            cost(test + "_cpu", r["ok"], 1e6)
            note[test + "_resumed"].append(r["resumed"] / r["ok"])
            note[test + "_conns"].append(conns / r["ok"])
            note[test + "_syns"].append(syns / r["ok"])
        elif test == "h2":
            r = h2load(text)
            if r.get("proto") and r["proto"] != "h2":
                note["h2_proto"].append("%s (%s req/s)" % (r["proto"], num(r.get("rate"))))
                return
            if "rate" not in r or not r.get("count"):
                note["failed"].append(tag)
                return
            if r.get("errors"):
                note["errors"].append("%s: %d" % (tag, r["errors"]))
            v["h2"][peer][rnd] = r["rate"]
            cost("h2_cpu", r["count"], 1e6)
            note["h2_conns"].append(conns)
            note["h2_syns"].append(syns)
        elif test in ("latka", "latnew"):
            r = last_json(text)
            if not r.get("n"):
                note["failed"].append(tag)
                return
            if r.get("errors"):
                note["errors"].append("%s: %d" % (tag, r["errors"]))
            key = "lka" if test == "latka" else "lnew"
            v[key + "_p50"][peer][rnd] = r["p50_ms"]
            v[key + "_p99"][peer][rnd] = r["p99_ms"]
            if test == "latnew":
                note["latnew_resumed"].append(r.get("resumed", 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--json")
    a = ap.parse_args()
    runs = Runs(a.dir)
    env = runs.env
    peers = env.get("peers", "").split() or sorted(runs.notes)
    rounds = sorted(runs.rounds)
    e = lambda k, d="?": env.get(k, d)  # noqa: E731

    results = [
        ("ka", "HTTPS keep-alive req/s (1 KiB, %s conns)" % e("ka_conns"), "ratio"),
        ("newres", "new TLS conn/s, resumed (1 req each, %s conns)" % e("new_conns"), "ratio"),
        ("newfull", "new TLS conn/s, full handshake (1 req each, %s conns)" % e("new_conns"), "ratio"),
        ("bulk", "bulk MiB/s (1 MiB body, %s conns)" % e("bulk_conns"), "ratio"),
        ("h2", "HTTP/2 req/s (h2load, %s conns × %s streams, 1 KiB)" % (e("h2_conns"), e("h2_streams")), "ratio"),
        ("lka_p50", "latency keep-alive p50 ms (paced, 1 conn)", "delta"),
        ("lka_p99", "latency keep-alive p99 ms", "delta"),
        ("lnew_p50", "latency new conn p50 ms (paced, TCP + full TLS handshake + req)", "delta"),
        ("lnew_p99", "latency new conn p99 ms", "delta"),
    ]
    costs = [
        ("ka_cpu", "gw CPU ms per 1k keep-alive req", None),
        ("newres_cpu", "gw CPU ms per 1k resumed new conns", None),
        ("newfull_cpu", "gw CPU ms per 1k full-handshake conns", None),
        ("bulk_cpu", "gw CPU s per GiB bulk", None),
        ("h2_cpu", "gw CPU ms per 1k HTTP/2 req", None),
        ("ka_cores", "gw cores busy, keep-alive test", None),
        ("h2_cores", "gw cores busy, HTTP/2 test", None),
    ]
    values = runs.values

    def paired(key, peer, kind):
        base, mine = values[key].get("direct", {}), values[key].get(peer, {})
        pairs = [(mine[r], base[r]) for r in rounds if r in mine and r in base and mine[r] is not None and base[r] is not None]
        if kind == "ratio":
            return [x / b for x, b in pairs if b]
        return [x - b for x, b in pairs]

    def cell(key, peer, kind):
        if key == "h2" and runs.notes[peer]["h2_proto"] and not values[key].get(peer):
            return "n/a: no HTTP/2"
        m = median(values[key].get(peer, {}).values())
        text = num(m)
        if m is not None and peer != "direct" and kind in ("ratio", "delta"):
            d = median(paired(key, peer, kind))
            if d is not None:
                text += " (%s×)" % ratio(d) if kind == "ratio" else " (%+.2f)" % d
        return text

    def table(rows, cols):
        lines = ["| metric | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
        for key, label, kind in rows:
            if not any(values[key].get(p) for p in cols) and not (key == "h2" and any(runs.notes[p]["h2_proto"] for p in cols)):
                continue
            lines.append("| %s | %s |" % (label, " | ".join(cell(key, p, kind) for p in cols)))
        return "\n".join(lines)

    out = []
    out.append("Run %s, gateway mode **%s**: %d round(s), interleaved (column order rotated per round), %s s per throughput run; %s"
               % (e("date_utc"), e("mode"), len(rounds), e("dur"), e("host", "")))
    out.append("Gateway: %s; limits.worker_threads = %s; flow log %s. Tools: %s."
               % (e("gw_bin", "not in this run"), e("gw_workers"), e("gw_flow_log"), e("versions")))
    out.append("Machine: %s; load average %s before, %s after." % (machine(env), e("loadavg_before"), e("loadavg_after")))
    out.append("Cells: median over rounds; (×) median per-round ratio vs direct; (+) median per-round added ms vs direct.")
    out.append("")
    out.append(table(results, peers))
    out.append("")
    out.append("CPU of the column's process tree (user + system from /proc/<pid>/stat, before and after each run; "
               "direct is kernel forwarding, not measured):")
    out.append("")
    out.append(table(costs, [p for p in peers if p != "direct"]))
    out.append("")
    out.append("Spread across rounds: min – max (coefficient of variation):")
    out.append("")
    lines = ["| metric | " + " | ".join(peers) + " |", "|---|" + "---:|" * len(peers)]
    for key, label, _ in results:
        cells = []
        for p in peers:
            xs = [x for x in values[key].get(p, {}).values() if x is not None]
            if not xs:
                cells.append("n/a")
                continue
            cv = statistics.pstdev(xs) / statistics.mean(xs) * 100 if len(xs) > 1 and statistics.mean(xs) else 0.0
            cells.append("%s – %s (%.0f%%)" % (num(min(xs)), num(max(xs)), cv))
        if any(c != "n/a" for c in cells):
            lines.append("| %s | %s |" % (label, " | ".join(cells)))
    out.append("\n".join(lines))
    others = [p for p in peers if p != "direct"]
    if "direct" in peers and others:
        out.append("")
        out.append("Per-round ratios (added ms for latency) vs direct: min – max:")
        out.append("")
        lines = ["| metric | " + " | ".join(others) + " |", "|---|" + "---:|" * len(others)]
        for key, label, kind in results:
            cells = []
            for p in others:
                xs = paired(key, p, kind)
                if not xs:
                    cells.append("n/a")
                elif kind == "ratio":
                    cells.append("%s – %s×" % (ratio(min(xs)), ratio(max(xs))))
                else:
                    cells.append("%+.2f – %+.2f" % (min(xs), max(xs)))
            if any(c != "n/a" for c in cells):
                lines.append("| %s | %s |" % (label, " | ".join(cells)))
        out.append("\n".join(lines))
    out.append("")
    out.append("Sanity:")
    for p in peers:
        n = runs.notes[p]
        bits = []
        if n["ka_conns"]:
            bits.append("keep-alive runs opened %s client / %s origin connections"
                        % (spread_set(n["ka_conns"]), spread_set(n["ka_syns"])))
        for test, name in (("newres", "resumed"), ("newfull", "full-handshake")):
            if n[test + "_resumed"]:
                share = median(n[test + "_resumed"])
                bits.append("%s runs: %.0f%% of handshakes resumed, %.2f client / %.2f origin connections per request"
                            % (name, share * 100, median(n[test + "_conns"]), median(n[test + "_syns"])))
                if test == "newfull" and max(n[test + "_resumed"]) > 0:
                    bits.append("**WARNING: full-handshake runs resumed sessions**")
        if n["h2_conns"]:
            bits.append("HTTP/2 runs opened %s client / %s origin connections" % (spread_set(n["h2_conns"]), spread_set(n["h2_syns"])))
        if n["h2_proto"]:
            bits.append("h2load got no HTTP/2 (ALPN): %s" % "; ".join(n["h2_proto"][:2]))
        if n["latnew_resumed"] and max(n["latnew_resumed"]):
            bits.append("**WARNING: the new-connection probe resumed sessions**")
        bits.append("errors: %s" % ("; ".join(n["errors"]) if n["errors"] else "none"))
        if n["failed"]:
            bits.append("**FAILED runs: %s**" % ", ".join(n["failed"]))
        out.append("- %s: %s" % (p, ", ".join(bits)))
    guards = [(k[len("blocked_egress_"):], v) for k, v in env.items() if k.startswith("blocked_egress_")]
    if guards:
        out.append("- network guard: packets blocked leaving the namespaces: %s; UDP datagrams sent in the column namespace "
                   "(DNS would be some): %s" % (", ".join("%s %s" % g for g in guards), e("gw_udp_out")))
    print("\n".join(out))

    if a.json:
        data = {"env": env, "peers": peers, "rounds": rounds, "medians": {}, "vs_direct": {}}
        for key, _, kind in results + costs:
            for p in peers:
                m = median(values[key].get(p, {}).values())
                if m is not None:
                    data["medians"].setdefault(key, {})[p] = m
                if p != "direct" and kind:
                    d = median(paired(key, p, kind))
                    if d is not None:
                        data["vs_direct"].setdefault(key, {})[p] = d
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
    return 0


def spread_set(xs):
    lo, hi = min(xs), max(xs)
    return str(lo) if lo == hi else "%d–%d" % (lo, hi)


def machine(env):
    try:
        before = [int(x) for x in env["procstat_before"].split()[1:]]
        after = [int(x) for x in env["procstat_after"].split()[1:]]
    except (KeyError, ValueError):
        return "CPU use not recorded"
    d = [y - x for x, y in zip(before, after)]
    total = sum(d[:8]) or 1  # user nice system idle iowait irq softirq steal
    busy = total - d[3] - d[4]
    return "CPU busy %.0f%% (softirq %.0f%%, steal %.1f%%) over the run, all CPUs" % (
        100.0 * busy / total, 100.0 * d[6] / total, 100.0 * d[7] / total)


if __name__ == "__main__":
    sys.exit(main())
