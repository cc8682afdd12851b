#!/usr/bin/env bash
# Machine egress at node scale: what the kernel path costs a VM when 1, 100
# or 500 VMs are registered, and how fast a policy applies at 500.
#
#   sudo benches/machine-egress.sh      # ROUNDS=3 SECONDS_PER=3 COUNTS="1 100 500"
#   PROFILE=debug LOAD_PROFILE=release  # a debug gateway (it only applies
#                                       # rules), a release load generator
#
# Three namespaces, all on 100.64.0.0/10 and 203.0.113.0/24 and nothing
# else: a VM stand-in (100.64.4.2), the gateway (forwarding only the VM's
# veth) and an origin (203.0.113.80) running `egress-l4load serve`. Every
# VM, the measured one and the others (100.65.x.y, no traffic), has a
# 256-rule allowlist; the measured VM's last two rules allow the origin
# and it is registered with its link (anti-spoofing on). Each round
# measures, interleaved, no table at all (the gateway stopped and its table
# deleted: the bare forwarding path) and each VM count, going up in odd
# rounds and down in even ones: TCP connects/s (8 at a time) and bulk MiB/s
# on one connection. Then, at the largest count, 20 policy applies of 256
# rules (each a different policy), p50/p99 ms, and the ruleset's size.
# Prints a Markdown section on stdout. Everything is removed on exit.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-3}
secs=${SECONDS_PER:-3}
counts=${COUNTS:-1 100 500}
profile=${PROFILE:-release}
target=${CARGO_TARGET_DIR:-$root/target}
load_profile=${LOAD_PROFILE:-$profile} # the load generator's own profile
flag() { if [ "$1" = release ]; then echo --release; fi; }
cargo build $(flag "$profile") --quiet -p egress-gateway --bins --manifest-path "$root/Cargo.toml"
cargo build $(flag "$load_profile") --quiet -p egress-benches --bin egress-l4load --manifest-path "$root/Cargo.toml"
gw=$target/$profile/egress-gateway
load=$target/$load_profile/egress-l4load
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
gwpid=
start_gateway() {
    RUST_LOG=warn ip netns exec "$gwns" "$gw" run --config "$state/gateway.toml" 2>> "$state/gateway.err" &
    gwpid=$!
    for _ in $(seq 600); do
        [ "$(admin GET /readyz | cut -d' ' -f1)" = 200 ] && return 0
        sleep 0.1
    done
    cat "$state/gateway.err" >&2; exit 1
}
stop_gateway() {
    kill "$gwpid"; wait "$gwpid" 2>/dev/null || true
}
admin() { ip netns exec "$gwns" curl -s -o "$state/reply" -w '%{http_code} %{time_total}' -X "$1" -H 'content-type: application/json' ${3:+--data-binary "$3"} "http://127.0.0.1:15000$2"; }
trap 'stop_gateway 2>/dev/null; cleanup' EXIT
for _ in $(seq 100); do grep -q ready "$state/serve.out" && break; sleep 0.1; done
start_gateway

# 256 rules: 254 that do not match the origin, then the two that do.
rules() { # $1: port offset, so each policy differs
    local out="" i
    for i in $(seq 0 253); do out+="{\"cidr\": \"10.$((i % 256)).0.0/16\", \"proto\": \"tcp\", \"port\": $((1000 + i + $1))},"; done
    printf '{"mode": "allowlist", "rules": [%s{"cidr": "203.0.113.0/24", "proto": "tcp", "port": 9000}, {"cidr": "203.0.113.0/24", "proto": "tcp", "port": 9001}]}' "$out"
}
policy=$(rules 0)
code=$(admin PUT /v1/vms/bench "{\"addresses\": [\"100.64.4.2\"], \"link\": \"vm1\", \"egress\": $policy}" | cut -d' ' -f1)
[ "$code" = 200 ] || { cat "$state/reply" >&2; exit 1; }
others=0 # VMs registered besides the measured one
set_count() { # $1: VMs in all
    local want=$(( $1 - 1 )) i
    while [ "$others" -lt "$want" ]; do
        i=$others
        code=$(admin PUT "/v1/vms/o$i" "{\"addresses\": [\"100.65.$((i / 250)).$((i % 250 + 1))\"], \"egress\": $(rules $((i % 7 + 1)))}" | cut -d' ' -f1)
        [ "$code" = 200 ] || { cat "$state/reply" >&2; exit 1; }
        others=$((others + 1))
    done
    while [ "$others" -gt "$want" ]; do
        others=$((others - 1))
        admin DELETE "/v1/vms/o$others" > /dev/null
    done
}

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
up=$counts
down=$(echo $counts | tr ' ' '\n' | sort -rn | tr '\n' ' ')
for r in $(seq "$rounds"); do
    # No table: the bare forwarding path of the same namespaces.
    stop_gateway
    ip netns exec "$gwns" nft delete table inet egress_machine
    measure none >> "$results"
    start_gateway
    if [ $((r % 2)) = 1 ]; then order=$up; else order=$down; fi
    for n in $order; do
        set_count "$n"
        measure "$n" >> "$results"
    done
    echo "round $r done" >&2
done
largest=$(echo $counts | tr ' ' '\n' | sort -n | tail -1)
set_count "$largest"
applies=$state/applies
: > "$applies"
for i in $(seq 20); do
    out=$(admin PUT /v1/vms/bench/network/egress "$(rules "$i")")
    [ "${out%% *}" = 200 ] || { cat "$state/reply" >&2; exit 1; }
    echo "${out#* }" >> "$applies"
done
ruleset_bytes=$(ip netns exec "$gwns" nft list table inet egress_machine | wc -c)
slab_with=$(awk '/^Slab:/ {print $2}' /proc/meminfo)
stop_gateway
ip netns exec "$gwns" nft delete table inet egress_machine
sleep 1
slab_without=$(awk '/^Slab:/ {print $2}' /proc/meminfo)
echo "$largest $ruleset_bytes $slab_with $slab_without" > "$state/memory"
start_gateway

python3 - "$results" "$applies" "$rounds" "$secs" "$state/memory" "$counts" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
applies = sorted(float(x) * 1000 for x in open(sys.argv[2]))
rounds, secs = sys.argv[3], sys.argv[4]
largest, text_bytes, slab_with, slab_without = open(sys.argv[5]).read().split()
counts = sys.argv[6].split()
by = {}
for label, c, b in rows:
    by.setdefault(label, []).append((float(c), float(b)))
med = st.median
none = by["none"]
print(f"### Machine egress at node scale ({rounds} interleaved rounds, {secs} s each)\n")
print("Ratios are per round against that round's no-table run (median, then the rounds' range).\n")
print("| VMs registered | TCP connects/s (8 at a time) | ratio to no table | bulk MiB/s | ratio to no table |")
print("|---|---|---|---|---|")
print(f"| no table | {med(x[0] for x in none):.0f} | 1 | {med(x[1] for x in none):.0f} | 1 |")
for n in counts:
    rs = by[n]
    cr = [a[0] / z[0] for z, a in zip(none, rs)]
    br = [a[1] / z[1] for z, a in zip(none, rs)]
    print(f"| {n} | {med(x[0] for x in rs):.0f} | {med(cr):.3f}× ({min(cr):.3f}–{max(cr):.3f}) | {med(x[1] for x in rs):.0f} | {med(br):.3f}× ({min(br):.3f}–{max(br):.3f}) |")
first, last = counts[0], counts[-1]
cr = [b[0] / a[0] for a, b in zip(by[first], by[last])]
br = [b[1] / a[1] for a, b in zip(by[first], by[last])]
print(f"\n{last} VMs against {first}, per round: connects {med(cr):.3f}× ({min(cr):.3f}–{max(cr):.3f}), bulk {med(br):.3f}× ({min(br):.3f}–{max(br):.3f}).")
p = lambda q: applies[min(len(applies) - 1, int(q * len(applies)))]
print(f"\nPolicy apply at {largest} VMs, 256 rules, through `PUT /v1/vms/{{id}}/network/egress` (validate, one `nft -f` transaction, fsync'd state), {len(applies)} applies: p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms.")
print(f"\nRuleset at {largest} VMs: `nft list table` is {int(text_bytes) / 1e6:.1f} MB of text; the kernel's slab shrank by {(int(slab_with) - int(slab_without)) / 1024:.0f} MiB when the table was deleted (the whole machine's slab, so noisy).")
PY
