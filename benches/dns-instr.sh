#!/usr/bin/env bash
# User-space instructions per DNS query of the gateway's listener, counted by
# valgrind's callgrind over a fixed count (the DNS counterpart of instr.sh):
# the count does not move with the machine's load, where dns-load.sh's rates
# move 10-20% between rounds. Loopback only: the upstream is
# `egress-dnsload serve` on 127.0.0.1:25363, the sandbox 127.0.0.2, every
# query a new name under *.bench.test (admitted, forwarded, attributed).
#
#   GW_BIN=/tmp/new GW_BASE_BIN=/tmp/old benches/dns-instr.sh
#
# Environment: GW_BIN (default target/release/egress-gateway), GW_BASE_BIN (a
# second build, counted the same way), LOAD_BIN (default
# target/release/egress-dnsload: cargo build --release -p egress-benches
# --bin egress-dnsload), N=20000 queries at CONC=32 outstanding (3,000 more
# warm up first).
set -euo pipefail
shopt -s inherit_errexit
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
load=${LOAD_BIN:-$target/release/egress-dnsload}
N=${N:-20000}
CONC=${CONC:-32}
command -v valgrind >/dev/null || { echo "dns-instr.sh: valgrind is not installed" >&2; exit 1; }
[ -x "$load" ] || { echo "dns-instr.sh: no load tool at $load" >&2; exit 1; }
state=$(mktemp -d /tmp/egress-dns-instr.XXXXXX)
pids=()
# The gateways start in count()'s subshell: their pids go by file.
cleanup() {
    for p in "${pids[@]}" $(cat "$state"/*.pid 2>/dev/null); do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$state"
}
trap cleanup EXIT
"$load" serve --listen 127.0.0.1:25363 > "$state/upstream.out" 2>&1 &
pids+=($!)

count() {
    local bin=$1 d=$state/$2 gw f total
    mkdir -p "$d"
    printf '{"version": 1, "sandboxes": [{"id": "dns-bench", "addresses": ["127.0.0.2"], "policy": %s}]}\n' \
        '{"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.bench.test"}]}' > "$d/snapshot.json"
    cat > "$d/gateway.toml" <<EOF
state_dir = "$d"
[listen]
transparent = "127.0.0.1:0"
dns = "127.0.0.1:25063"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:25010"
[dns]
upstreams = ["127.0.0.1:25363"]
budget_qps = 1000000
budget_new_names_per_minute = 1000000
[limits]
max_connections = 4000
worker_threads = 1
[log]
flow_log = "off"
EOF
    RUST_LOG=warn valgrind --tool=callgrind --separate-threads=no --dump-instr=no \
        --callgrind-out-file="$d/callgrind.%p" "$bin" run --config "$d/gateway.toml" 2> "$d/gateway.err" &
    gw=$!
    echo "$gw" > "$state/$2.pid"
    local up=0
    for _ in $(seq 300); do
        if curl -sf --noproxy '*' --max-time 1 http://127.0.0.1:25010/readyz >/dev/null 2>&1; then up=1; break; fi
        sleep 0.2
    done
    [ "$up" = 1 ] || { echo "dns-instr.sh: $2 did not become ready ($d/gateway.err)" >&2; exit 1; }
    "$load" query --target 127.0.0.1:25063 --source 127.0.0.2 --count 3000 --concurrency "$CONC" --prefix "warm-$2-" > /dev/null
    callgrind_control -z "$gw" > /dev/null 2>&1
    "$load" query --target 127.0.0.1:25063 --source 127.0.0.2 --count "$N" --concurrency "$CONC" --prefix "load-$2-" > "$d/load.out"
    callgrind_control -d "$gw" > /dev/null 2>&1
    # The dump (counted since the zero): callgrind.PID.1; the file written
    # at exit holds only what ran after it.
    f=$(ls "$d"/callgrind.*.1)
    total=$(awk '/^totals:/ {print $2; exit}' "$f")
    kill "$gw"
    wait "$gw" 2>/dev/null || true
    rm -f "$state/$2.pid"
    grep -q '"failed": 0' "$d/load.out" || { echo "dns-instr.sh: $2: queries failed: $(cat "$d/load.out")" >&2; exit 1; }
    echo "$((total / N))"
}

new=$(count "${GW_BIN:-$target/release/egress-gateway}" gateway)
echo "gateway: $new instructions per query ($N queries, $CONC outstanding)"
if [ -n "${GW_BASE_BIN:-}" ]; then
    base=$(count "$GW_BASE_BIN" gateway-base)
    echo "gateway-base: $base instructions per query"
    awk -v a="$new" -v b="$base" 'BEGIN {printf "gateway / base: %.4f\n", a / b}'
fi
