#!/usr/bin/env bash
# DNS over HTTPS through the gateway beside DNS over UDP through the same
# gateway, interleaved rounds in one run: what answering a browser's DoH
# (RFC 8484 POSTs over one HTTP/2 connection) costs over port 53.
#
#   benches/doh-load.sh              # ROUNDS=5 LAT_COUNT=3000 LOAD_COUNT=30000 CONC=32
#   SKIP_BUILD=1 benches/doh-load.sh # measure the release binaries as they are
#   SKIP_BUILD=1 GW_BIN=/tmp/gw LOAD_BIN=/tmp/dnsload benches/doh-load.sh  # copied binaries
#
# Root. It re-runs itself in a network namespace of its own with only
# loopback (unshare -n): the sandbox is 127.0.0.2; its TCP to 8.8.8.8:443 is
# redirected by an nftables output rule to the gateway's transparent
# listener (127.0.0.1:25443) — 8.8.8.8 appears only as that redirect target,
# routed to lo, and nothing can leave the namespace. The gateway answers DoH
# itself through its DNS proxy; the upstream is `egress-dnsload serve`
# (hickory-server) on 127.0.0.1:25353. Paths: `direct` (the upstream),
# `udp` (the gateway's DNS listener for 8.8.8.8, 127.0.0.1:25053), `doh`
# (the gateway's DoH at 8.8.8.8:443, CONC streams on one connection).
# Every query asks a name not asked before. Prints a Markdown table.
set -euo pipefail
if [ -z "${EGRESS_DOH_NS:-}" ]; then
    exec unshare -n env EGRESS_DOH_NS=1 bash "$0" "$@"
fi
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-5}
lat_count=${LAT_COUNT:-3000}
load_count=${LOAD_COUNT:-30000}
conc=${CONC:-32}
up_addr=127.0.0.1:25353
sandbox=127.0.0.2
ip link set lo up
ip route add 8.8.8.8/32 dev lo
nft -f - <<'NFT'
table ip egress_doh_bench {
    chain out {
        type nat hook output priority -100; policy accept;
        ip daddr 8.8.8.8 tcp dport 443 redirect to :25443
    }
}
NFT
# shellcheck source=benches/dns-bench-lib.sh
source "$root/benches/dns-bench-lib.sh"
dns_bench_setup doh-load

"$load" serve --listen "$up_addr" > "$state/upstream.out" &
pids+=($!)
printf '{"version": 1, "sandboxes": [{"id": "doh-bench", "addresses": ["%s"], "policy": %s}]}\n' "$sandbox" \
    '{"default": "deny", "tls_interception": "on", "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.bench.test"}]}' \
    > "$state/snapshot.json"
cat > "$state/gateway.toml" <<CFG
state_dir = "$state"
[listen]
transparent = "127.0.0.1:25443"
dns = "127.0.0.1:25053"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:25000"
[dns]
upstreams = ["$up_addr"]
# One sandbox sends every query: budgets on, but out of the load's reach.
budget_qps = 1000000
budget_new_names_per_minute = 1000000
[limits]
worker_threads = ${GW_WORKERS:-1}
[log]
flow_log = "off"
CFG
RUST_LOG=warn "$gw" run --config "$state/gateway.toml" 2> "$state/gateway.err" &
gw_pid=$!
pids+=($gw_pid)
for _ in $(seq 50); do
    curl -sf http://127.0.0.1:25000/readyz >/dev/null 2>&1 && break
    sleep 0.1
done
ca=$state/ca/ca.crt

# query PATH COUNT CONCURRENCY PREFIX
query() {
    case $1 in
        direct) "$load" query --target "$up_addr" --source "$sandbox" --count "$2" --concurrency "$3" --prefix "$4" --deadline-s 120 ;;
        udp) "$load" query --target 127.0.0.1:25053 --source "$sandbox" --count "$2" --concurrency "$3" --prefix "$4" --deadline-s 120 ;;
        doh) "$load" query --target 8.8.8.8:443 --source "$sandbox" --count "$2" --concurrency "$3" --prefix "$4" --deadline-s 120 \
                --doh-sni dns.google --doh-ca "$ca" ;;
    esac
}
peers=(direct udp doh)
for p in "${peers[@]}"; do
    query "$p" 20 1 "warm-$p-" | grep -q '"failed": 0' || { echo "doh-load.sh: $p does not answer" >&2; cat "$state/gateway.err" >&2; exit 1; }
done

cpu() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.4f\n", ($14 + $15) / hz}' "/proc/$gw_pid/stat"; }
results=$state/results.jsonl
for r in $(seq "$rounds"); do
    for k in 0 1 2; do
        path=${peers[$(( (k + r - 1) % 3 ))]}
        for kind in latency load; do
            if [ "$kind" = latency ]; then n=$lat_count c=1; else n=$load_count c=$conc; fi
            before=$(cpu)
            # Bounded by the generator itself: --deadline-s and a timeout per query.
            line=$(query "$path" "$n" "$c" "r$r-$kind-$path-")
            after=$(cpu)
            printf '{"round": %s, "path": "%s", "kind": "%s", "cpu_s": %s, "result": %s}\n' \
                "$r" "$path" "$kind" "$(awk -v a="$after" -v b="$before" 'BEGIN {printf "%.4f", a - b}')" "$line" >> "$results"
        done
    done
done
[ -z "${KEEP:-}" ] || cp "$results" "$KEEP"

python3 - "$results" "$rounds" "$lat_count" "$load_count" "$conc" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rounds, lat_n, load_n, conc = sys.argv[2:6]
peers = ["direct", "udp", "doh"]
rs = sorted({x["round"] for x in rows})
def get(path, kind, key, r):
    row = next(x for x in rows if x["path"] == path and x["kind"] == kind and x["round"] == r)
    return row["cpu_s"] if key == "cpu_s" else row["result"][key]
def spread(v, fmt):
    return f"{fmt(statistics.median(v))} ({fmt(min(v))}–{fmt(max(v))})"
failed = sum(x["result"]["failed"] for x in rows)
print(f"### DoH vs UDP through the gateway ({rounds} interleaved rounds; median, (min–max) over rounds; {failed} queries failed)\n")
print("| figure | " + " | ".join(peers) + " |")
print("|---|" + "---:|" * len(peers))
us = lambda v: f"{v:.0f}"
plus = lambda v: f"{v:+.0f}"
def row(label, cell):
    print(f"| {label} | " + " | ".join(cell(p) for p in peers) + " |")
row(f"queries/s, {conc} outstanding ({load_n} queries)", lambda p: spread([get(p, "load", "qps", r) for r in rs], us))
row("  ratio to udp (same round)", lambda p: spread([get(p, "load", "qps", r) / get("udp", "load", "qps", r) for r in rs], lambda v: f"{v:.2f}×"))
for kind, label in (("latency", f"1 outstanding ({lat_n} queries)"), ("load", f"{conc} outstanding")):
    for q in ("p50_us", "p99_us"):
        row(f"{q[:3]} µs, {label}", lambda p: spread([get(p, kind, q, r) for r in rs], us))
    row(f"  added p50 µs vs udp (same round), {label}", lambda p: spread([get(p, kind, "p50_us", r) - get("udp", kind, "p50_us", r) for r in rs], plus))
row("gateway CPU ms per 1k queries (at 32 outstanding)", lambda p: "—" if p == "direct" else spread(
    [get(p, "load", "cpu_s", r) / get(p, "load", "answered", r) * 1e6 for r in rs], lambda v: f"{v:.1f}"))
PY
