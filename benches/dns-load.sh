#!/usr/bin/env bash
# DNS through the gateway's listener vs asking the local upstream directly,
# interleaved rounds in one run, on loopback only (no namespace, no root).
#
#   benches/dns-load.sh                    # ROUNDS=5 LAT_COUNT=3000 LOAD_COUNT=30000
#
# The upstream is `egress-dnsload serve` (hickory-server) on 127.0.0.1:25353;
# the release gateway answers for 8.8.8.8 on 127.0.0.1:25053 and forwards
# to it; the sandbox is 127.0.0.2 (policy: the resolver and *.bench.test).
# Every query asks for a name not asked before, so each one is forwarded
# and attributed. Latency: one query outstanding; throughput: CONC (32).
# Prints a Markdown section on stdout.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-5}
lat_count=${LAT_COUNT:-3000}
load_count=${LOAD_COUNT:-30000}
conc=${CONC:-32}
up_addr=127.0.0.1:25353
gw_dns=127.0.0.1:25053
sandbox=127.0.0.2
cargo build --release --quiet -p egress-gateway -p egress-benches --bins --manifest-path "$root/Cargo.toml"
gw=$root/target/release/egress-gateway
load=$root/target/release/egress-dnsload
state=$(mktemp -d /tmp/egress-dns-load.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$state"
}
trap cleanup EXIT

"$load" serve --listen "$up_addr" > "$state/upstream.out" &
pids+=($!)
printf '{"version": 1, "sandboxes": [{"id": "dns-bench", "addresses": ["%s"], "policy": %s}]}\n' "$sandbox" \
    '{"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.bench.test"}]}' > "$state/snapshot.json"
cat > "$state/gateway.toml" <<EOF
state_dir = "$state"
[listen]
transparent = "127.0.0.1:0"
dns = "$gw_dns"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:25000"
[dns]
upstreams = ["$up_addr"]
[limits]
worker_threads = ${GW_WORKERS:-1}
[log]
flow_log = "off"
EOF
RUST_LOG=warn "$gw" run --config "$state/gateway.toml" 2> "$state/gateway.err" &
gw_pid=$!
pids+=($gw_pid)
for _ in $(seq 50); do
    if curl -sf http://127.0.0.1:25000/readyz >/dev/null 2>&1 && grep -q ready "$state/upstream.out"; then break; fi
    sleep 0.1
done
curl -sf http://127.0.0.1:25000/readyz >/dev/null || { cat "$state/gateway.err" >&2; exit 1; }

# CPU seconds (user + system) the gateway has used so far.
cpu() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.4f\n", ($14 + $15) / hz}' "/proc/$gw_pid/stat"; }

results=$state/results.jsonl
for r in $(seq "$rounds"); do
    for path in direct gateway; do
        target=$up_addr
        [ "$path" = gateway ] && target=$gw_dns
        for kind in latency load; do
            if [ "$kind" = latency ]; then n=$lat_count c=1; else n=$load_count c=$conc; fi
            before=$(cpu)
            line=$("$load" query --target "$target" --source "$sandbox" --count "$n" --concurrency "$c" --prefix "r$r-$kind-$path-")
            after=$(cpu)
            printf '{"round": %s, "path": "%s", "kind": "%s", "gw_cpu_s": %s, "result": %s}\n' \
                "$r" "$path" "$kind" "$(awk -v a="$after" -v b="$before" 'BEGIN {printf "%.4f", a - b}')" "$line" >> "$results"
        done
    done
done

python3 - "$results" "$rounds" "$lat_count" "$load_count" "$conc" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
rounds, lat_n, load_n, conc = sys.argv[2:6]
def med(path, kind, f):
    return statistics.median(f(r) for r in rows if r["path"] == path and r["kind"] == kind)
failed = sum(r["result"]["failed"] for r in rows)
d50 = med("direct", "latency", lambda r: r["result"]["p50_us"])
g50 = med("gateway", "latency", lambda r: r["result"]["p50_us"])
d99 = med("direct", "latency", lambda r: r["result"]["p99_us"])
g99 = med("gateway", "latency", lambda r: r["result"]["p99_us"])
dq = med("direct", "load", lambda r: r["result"]["qps"])
gq = med("gateway", "load", lambda r: r["result"]["qps"])
dl50 = med("direct", "load", lambda r: r["result"]["p50_us"])
gl50 = med("gateway", "load", lambda r: r["result"]["p50_us"])
cpu = med("gateway", "load", lambda r: r["gw_cpu_s"] / r["result"]["answered"] * 1000 * 1000)
print(f"### DNS through the gateway ({rounds} interleaved rounds, medians; {failed} queries failed)\n")
print("| figure | direct to the upstream | through the gateway | added / ratio |")
print("|---|---|---|---|")
print(f"| p50 latency, 1 outstanding ({lat_n} queries) | {d50} µs | {g50} µs | +{g50 - d50} µs |")
print(f"| p99 latency, 1 outstanding | {d99} µs | {g99} µs | +{g99 - d99} µs |")
print(f"| queries/s, {conc} outstanding ({load_n} queries) | {dq:.0f} | {gq:.0f} | {gq / dq:.2f}× |")
print(f"| p50 latency, {conc} outstanding | {dl50} µs | {gl50} µs | +{gl50 - dl50} µs |")
print(f"| gateway CPU per 1k queries | — | {cpu:.1f} ms | |")
EOF
