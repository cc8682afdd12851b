#!/usr/bin/env bash
# DNS through the gateway's listener, through dnsdist (a plain forwarding
# proxy) and straight to the upstream, interleaved rounds in one run, on
# loopback only (no namespace needed; root only to read dnsdist's CPU).
#
#   benches/dns-load.sh            # ROUNDS=5 LAT_COUNT=3000 LOAD_COUNT=30000 CONC=32
#   PEERS="direct gateway" benches/dns-load.sh          # without dnsdist
#   BASE_GW=/tmp/egress-gateway.old PEERS="direct gateway gateway-base dnsdist" \
#       benches/dns-load.sh                             # an older binary beside the current one
#   unshare -n sh -c 'ip link set lo up && benches/dns-load.sh'   # a loopback-only namespace
#   SKIP_BUILD=1 GW_BIN=/tmp/egress-gateway benches/dns-load.sh   # measure a copied binary as is
#   BASE_GW=/tmp/egress-gateway.pre-budgets BASE_BUDGETS=0 PEERS="direct gateway gateway-base" \
#       benches/dns-load.sh                             # against a binary from before the DNS budgets
#
# The upstream is `egress-dnsload serve` (hickory-server) on 127.0.0.1:25353.
# The release gateway answers for 8.8.8.8 on 127.0.0.1:25053 and forwards to
# it; the sandbox is 127.0.0.2 (policy: the resolver and *.bench.test), so
# every query is admitted, forwarded and attributed. dnsdist (Debian's
# `dnsdist`, when installed) listens on 127.0.0.1:25054 with that upstream as
# its only server: no cache, no console, no web server, no carbon, no
# security polling. `gateway2` is the gateway with two worker threads
# (127.0.0.1:25056), `gateway-pc` the same two threads with a runtime and a
# SO_REUSEPORT socket each (limits.thread_per_core, 127.0.0.1:25057);
# `gateway-base` is $BASE_GW (127.0.0.1:25055); BASE_BUDGETS=0 leaves the
# budget keys out of its configuration (a binary that predates them refuses
# them).
# Every query asks for a name not asked before; the same generator and the
# same names for every path. Latency: one query outstanding; throughput:
# CONC (32) outstanding. The order of the paths rotates from round to round.
# Prints a Markdown section on stdout; the raw rows stay in $KEEP (if set).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-5}
lat_count=${LAT_COUNT:-3000}
load_count=${LOAD_COUNT:-30000}
conc=${CONC:-32}
up_addr=127.0.0.1:25353
sandbox=127.0.0.2
default_peers="direct gateway"
command -v dnsdist >/dev/null && default_peers="$default_peers dnsdist"
read -r -a peers <<< "${PEERS:-$default_peers}"
# shellcheck source=benches/dns-bench-lib.sh
source "$root/benches/dns-bench-lib.sh"
dns_bench_setup dns-load

declare -A target pid
target[direct]=$up_addr

"$load" serve --listen "$up_addr" > "$state/upstream.out" &
pids+=($!)

# gateway NAME BINARY DNS_PORT ADMIN_PORT WORKERS [PER_CORE] [BUDGET_KEYS]
gateway() {
    local name=$1 bin=$2 port=$3 admin=$4 workers=$5 per_core=${6:-false} budgets=${7:-1} dir=$state/$1
    # One sandbox sends every query: budgets on, but out of the load's reach
    # (a query within budget costs the same whatever the limit).
    local budget_keys=$'budget_qps = 1000000\nbudget_new_names_per_minute = 1000000'
    [ "$budgets" = 1 ] || budget_keys="# budgets: none (a binary from before them)"
    mkdir -p "$dir"
    printf '{"version": 1, "sandboxes": [{"id": "dns-bench", "addresses": ["%s"], "policy": %s}]}\n' "$sandbox" \
        '{"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.bench.test"}]}' > "$dir/snapshot.json"
    cat > "$dir/gateway.toml" <<EOF
state_dir = "$dir"
[listen]
transparent = "127.0.0.1:0"
dns = "127.0.0.1:$port"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:$admin"
[dns]
upstreams = ["$up_addr"]
$budget_keys
[limits]
# No TCP in this bench: a bound that fits any open-file limit.
max_connections = 4000
worker_threads = $workers
thread_per_core = $per_core
[log]
flow_log = "off"
EOF
    RUST_LOG=warn "$bin" run --config "$dir/gateway.toml" 2> "$dir/gateway.err" &
    pid[$name]=$!
    pids+=($!)
    target[$name]=127.0.0.1:$port
    for _ in $(seq 50); do
        if curl -sf "http://127.0.0.1:$admin/readyz" >/dev/null 2>&1; then return; fi
        sleep 0.1
    done
    cat "$dir/gateway.err" >&2
    exit 1
}

# Forwarding only, to the loopback upstream only; nothing listens but the
# one loopback DNS socket, and nothing is sent anywhere else.
dnsdist_start() {
    cat > "$state/dnsdist.conf" <<EOF
setSecurityPollSuffix("")
setLocal("127.0.0.1:25054")
setACL({"127.0.0.0/8"})
newServer({address="$up_addr", name="upstream"})
EOF
    dnsdist --supervised --disable-syslog -C "$state/dnsdist.conf" > "$state/dnsdist.out" 2>&1 &
    pid[dnsdist]=$!
    pids+=($!)
    target[dnsdist]=127.0.0.1:25054
}

for p in "${peers[@]}"; do
    case $p in
        direct) ;;
        gateway) gateway gateway "$gw" 25053 25000 "${GW_WORKERS:-1}" ;;
        gateway2) gateway gateway2 "$gw" 25056 25002 2 ;;
        gateway-pc) gateway gateway-pc "$gw" 25057 25003 2 true ;;
        gateway-base) gateway gateway-base "${BASE_GW:?BASE_GW names the other gateway binary}" 25055 25001 "${GW_WORKERS:-1}" false "${BASE_BUDGETS:-1}" ;;
        dnsdist) dnsdist_start ;;
        *) echo "dns-load.sh: unknown path $p" >&2; exit 2 ;;
    esac
done

# Every path answers before the first round (bounded: 50 tries).
for p in "${peers[@]}"; do
    ok=0
    for _ in $(seq 50); do
        if timeout 10 "$load" query --target "${target[$p]}" --source "$sandbox" --count 20 --concurrency 1 \
            --timeout-ms 200 --prefix "warm-$p-" 2>/dev/null | grep -q '"refused": 0, "failed": 0'; then ok=1; break; fi
        sleep 0.1
    done
    [ "$ok" = 1 ] || { echo "dns-load.sh: $p does not answer" >&2; cat "$state"/*.out "$state"/*/gateway.err >&2 || true; exit 1; }
done

# CPU seconds (user + system, all threads) a process has used so far; 0 for direct.
cpu() {
    local p=${pid[$1]:-}
    [ -n "$p" ] || { echo 0; return; }
    awk -v hz="$(getconf CLK_TCK)" '{printf "%.4f\n", ($14 + $15) / hz}' "/proc/$p/stat"
}

results=$state/results.jsonl
n_peers=${#peers[@]}
for r in $(seq "$rounds"); do
    for k in $(seq 0 $((n_peers - 1))); do
        path=${peers[$(( (k + r - 1) % n_peers ))]}
        for kind in latency load; do
            if [ "$kind" = latency ]; then n=$lat_count c=1; else n=$load_count c=$conc; fi
            before=$(cpu "$path")
            line=$(timeout 300 "$load" query --target "${target[$path]}" --source "$sandbox" --count "$n" \
                --concurrency "$c" --deadline-s 120 --prefix "r$r-$kind-$path-")
            after=$(cpu "$path")
            printf '{"round": %s, "path": "%s", "kind": "%s", "cpu_s": %s, "result": %s}\n' \
                "$r" "$path" "$kind" "$(awk -v a="$after" -v b="$before" 'BEGIN {printf "%.4f", a - b}')" "$line" >> "$results"
        done
    done
done
[ -z "${KEEP:-}" ] || cp "$results" "$KEEP"

python3 - "$results" "$rounds" "$lat_count" "$load_count" "$conc" "${peers[@]}" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rounds, lat_n, load_n, conc = sys.argv[2:6]
peers = sys.argv[6:]
proxies = [p for p in peers if p != "direct"]
def get(path, kind, key, r):
    row = next(x for x in rows if x["path"] == path and x["kind"] == kind and x["round"] == r)
    return row["cpu_s"] if key == "cpu_s" else row["result"][key]
rs = sorted({x["round"] for x in rows})
def per_round(f):
    return [f(r) for r in rs]
def spread(v, fmt):
    return f"{fmt(statistics.median(v))} ({fmt(min(v))}–{fmt(max(v))})"
failed = sum(x["result"]["failed"] + x["result"].get("refused", 0) for x in rows)
title = "the gateway's listener vs dnsdist" if "dnsdist" in peers else "through the gateway's listener"
print(f"### DNS: {title} ({rounds} interleaved rounds; median, (min–max) over rounds; {failed} queries failed)\n")
print("| figure | " + " | ".join(peers) + " |")
print("|---|" + "---:|" * len(peers))
us = lambda v: f"{v:.0f}"
plus = lambda v: f"{v:+.0f}"
x2 = lambda v: f"{v:.2f}×"
def row(label, cell):
    print(f"| {label} | " + " | ".join(cell(p) for p in peers) + " |")
row(f"queries/s, {conc} outstanding ({load_n} queries)", lambda p: spread(per_round(lambda r: get(p, "load", "qps", r)), us))
row("  ratio to direct (same round)", lambda p: "1" if p == "direct" else spread(
    per_round(lambda r: get(p, "load", "qps", r) / get("direct", "load", "qps", r)), x2))
for kind, label in (("latency", f"1 outstanding ({lat_n} queries)"), ("load", f"{conc} outstanding")):
    for q in ("p50_us", "p99_us"):
        row(f"{q[:3]} µs, {label}", lambda p: spread(per_round(lambda r: get(p, kind, q, r)), us))
        row(f"  added {q[:3]} µs vs direct (same round)", lambda p: "—" if p == "direct" else spread(
            per_round(lambda r: get(p, kind, q, r) - get("direct", kind, q, r)), plus))
row("proxy CPU ms per 1k queries (at 32 outstanding)", lambda p: "—" if p == "direct" else spread(
    per_round(lambda r: get(p, "load", "cpu_s", r) / get(p, "load", "answered", r) * 1e6), lambda v: f"{v:.1f}"))
others = [p for p in proxies if p != "gateway"]
if "gateway" in proxies and others:
    print("\nThe gateway against each other proxy, round by round (queries/s at 32 outstanding, gateway ÷ other):\n")
    for o in others:
        v = per_round(lambda r: get("gateway", "load", "qps", r) / get(o, "load", "qps", r))
        print(f"- vs {o}: " + ", ".join(f"{x:.2f}" for x in v) + f" (median {statistics.median(v):.2f}×)")
    print("\nAnd p50 latency, gateway ÷ other (1 outstanding; 32 outstanding):\n")
    for o in others:
        for kind in ("latency", "load"):
            v = per_round(lambda r: get("gateway", kind, "p50_us", r) / get(o, kind, "p50_us", r))
            print(f"- vs {o}, {kind}: " + ", ".join(f"{x:.2f}" for x in v) + f" (median {statistics.median(v):.2f}×)")
EOF
