#!/usr/bin/env bash
# Machine egress: what the kernel path costs a VM, and how fast a policy applies.
#
#   sudo benches/machine-egress.sh          # ROUNDS=5 SECONDS_PER=4
#
# Three namespaces, all on 100.64.0.0/10 and 203.0.113.0/24 and nothing
# else: a VM stand-in (100.64.4.2), the gateway (forwarding only the VM's
# veth) and an origin (203.0.113.80) running `egress-l4load serve`. Each
# round measures, interleaved, the same VM traffic with no VM registered
# (no table: the bare forwarding path) and registered with a 256-rule
# allowlist whose last two rules allow the origin: TCP connects/s (8 at a
# time) and bulk MiB/s on one connection. Then 20 policy applies of 256
# rules through the admin API (each a different policy), p50/p99 ms.
# Prints a Markdown section on stdout. Everything is removed on exit.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-5}
secs=${SECONDS_PER:-4}
cargo build --release --quiet -p egress-gateway -p egress-benches --bins --manifest-path "$root/Cargo.toml"
gw=$root/target/release/egress-gateway
load=$root/target/release/egress-l4load
tag=$$
vmns=meb-vm-$tag gwns=meb-gw-$tag orns=meb-or-$tag
state=$(mktemp -d /tmp/egress-machine-bench.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    for ns in $vmns $gwns $orns; do ip netns del "$ns" 2>/dev/null || true; done
    rm -rf "$state"
}
trap cleanup EXIT

for ns in $vmns $gwns $orns; do
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1
done
ip -n "$gwns" link add vm1 type veth peer name eth0 netns "$vmns"
ip -n "$gwns" link add or1 type veth peer name eth0 netns "$orns"
ip -n "$gwns" addr add 100.64.4.1/30 dev vm1
ip -n "$gwns" addr add 100.64.5.1/30 dev or1
ip -n "$vmns" addr add 100.64.4.2/30 dev eth0
ip -n "$orns" addr add 100.64.5.2/30 dev eth0
ip -n "$orns" addr add 203.0.113.80/32 dev lo
for l in "$gwns vm1" "$gwns or1" "$vmns eth0" "$orns eth0"; do set -- $l; ip -n "$1" link set "$2" up; done
ip -n "$vmns" route add default via 100.64.4.1
ip -n "$gwns" route add 203.0.113.0/24 via 100.64.5.2
ip -n "$orns" route add 100.64.0.0/10 via 100.64.5.1
ip netns exec "$gwns" sysctl -qw net.ipv4.ip_forward=1
# Only the VM's traffic and replies to it are forwarded.
ip netns exec "$gwns" nft -f - <<'NFT'
table inet bench_forward {
    chain forward {
        type filter hook forward priority 0; policy drop;
        iifname "vm1" oifname "or1" accept
        iifname "or1" oifname "vm1" ct state established,related accept
    }
}
NFT

ip netns exec "$orns" "$load" serve --listen 203.0.113.80:9000 --close-at 203.0.113.80:9001 > "$state/serve.out" &
pids+=($!)
cat > "$state/gateway.toml" <<TOML
state_dir = "$state/gw"
[listen]
transparent = "127.0.0.1:0"
dns = "127.0.0.1:0"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:15000"
[log]
flow_log = "off"
TOML
RUST_LOG=warn ip netns exec "$gwns" "$gw" run --config "$state/gateway.toml" 2> "$state/gateway.err" &
pids+=($!)
admin() { ip netns exec "$gwns" curl -s -o "$state/reply" -w '%{http_code} %{time_total}' -X "$1" -H 'content-type: application/json' ${3:+--data-binary "$3"} "http://127.0.0.1:15000$2"; }
for _ in $(seq 100); do
    if [ "$(admin GET /readyz | cut -d' ' -f1)" = 200 ] && grep -q ready "$state/serve.out"; then break; fi
    sleep 0.1
done
[ "$(admin GET /readyz | cut -d' ' -f1)" = 200 ] || { cat "$state/gateway.err" >&2; exit 1; }

# 256 rules: 254 that do not match the origin, then the two that do.
rules() { # $1: port offset, so each policy differs
    local out="" i
    for i in $(seq 0 253); do out+="{\"cidr\": \"10.$((i % 256)).0.0/16\", \"proto\": \"tcp\", \"port\": $((1000 + i + $1))},"; done
    printf '{"mode": "allowlist", "rules": [%s{"cidr": "203.0.113.0/24", "proto": "tcp", "port": 9000}, {"cidr": "203.0.113.0/24", "proto": "tcp", "port": 9001}]}' "$out"
}
policy=$(rules 0)

measure() { # $1: label; prints "label connects/s MiB/s"
    local c b
    ip netns exec "$vmns" "$load" connect --target 203.0.113.80:9001 --seconds "$secs" --concurrency 8 > "$state/connect.json"
    echo "$1 $(cat "$state/connect.json")" >&2
    c=$(sed -E 's/.*"per_s":([0-9.]+).*/\1/' "$state/connect.json")
    b=$(ip netns exec "$vmns" "$load" bulk --target 203.0.113.80:9000 --seconds "$secs" | sed -E 's/.*"mib_per_s":([0-9.]+).*/\1/')
    echo "$1 $c $b"
}
results=$state/results
: > "$results"
for r in $(seq "$rounds"); do
    for cond in none allowlist; do
        if [ "$cond" = allowlist ]; then
            code=$(admin PUT /v1/vms/bench "{\"addresses\": [\"100.64.4.2\"], \"egress\": $policy}" | cut -d' ' -f1)
            [ "$code" = 200 ] || { cat "$state/reply" >&2; exit 1; }
        else
            admin DELETE /v1/vms/bench >/dev/null
        fi
        measure "$cond" >> "$results"
    done
    echo "round $r done" >&2
done
admin PUT /v1/vms/bench "{\"addresses\": [\"100.64.4.2\"], \"egress\": $policy}" >/dev/null
applies=$state/applies
: > "$applies"
for i in $(seq 20); do
    out=$(admin PUT /v1/vms/bench/network/egress "$(rules "$i")")
    [ "${out%% *}" = 200 ] || { cat "$state/reply" >&2; exit 1; }
    echo "${out#* }" >> "$applies"
done

python3 - "$results" "$applies" "$rounds" "$secs" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
applies = sorted(float(x) * 1000 for x in open(sys.argv[2]))
rounds, secs = sys.argv[3], sys.argv[4]
by = {}
for label, c, b in rows:
    by.setdefault(label, []).append((float(c), float(b)))
none, allow = by["none"], by["allowlist"]
cr = [a[0] / n[0] for n, a in zip(none, allow)]
br = [a[1] / n[1] for n, a in zip(none, allow)]
med = st.median
print(f"### Machine egress: the kernel path ({rounds} interleaved rounds, {secs} s each)\n")
print("| figure | no policy (no table) | 256-rule allowlist | ratio (median of per-round ratios) |")
print("|---|---|---|---|")
print(f"| TCP connects/s (8 at a time) | {med(x[0] for x in none):.0f} | {med(x[0] for x in allow):.0f} | {med(cr):.3f}× (rounds {min(cr):.3f}–{max(cr):.3f}) |")
print(f"| bulk MiB/s (one connection) | {med(x[1] for x in none):.0f} | {med(x[1] for x in allow):.0f} | {med(br):.3f}× (rounds {min(br):.3f}–{max(br):.3f}) |")
p = lambda q: applies[min(len(applies) - 1, int(q * len(applies)))]
print(f"\nPolicy apply, 256 rules, through `PUT /v1/vms/{{id}}/network/egress` (validate, one `nft -f` transaction, fsync'd state), {len(applies)} applies: p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms.")
PY
