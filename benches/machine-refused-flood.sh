#!/usr/bin/env bash
# Machine egress observation under a flood of refused packets: what the
# NFLOG events cost against the sampled observed sets.
#
#   sudo benches/machine-refused-flood.sh   # ROUNDS=3 SECONDS_PER=3 PROFILE=debug
#
# Two namespaces on 100.64.0.0/10 and nothing else: a VM stand-in
# (100.64.4.2) and the gateway, which routes 203.0.113.0/24 on-link to a
# veth whose peer has no address (nothing answers). The VM is registered with an allowlist that
# does not allow 203.0.113.99, and a one-process UDP sender (python3)
# floods 203.0.113.99:9 for SECONDS_PER seconds. The forward path runs in
# the sender's own softirq, so its packets/s falls when the kernel's
# per-packet work grows. Three configurations, interleaved in each round:
#   sampled   observe = "sampled" (the set update and the counter)
#   events    observe = "events", log_rate 1000 (the default: the flood is
#             mostly over the rate and counted as lost)
#   every     observe = "events", log_rate 100000 (every packet logged)
# For each: the sender's packets/s, the gateway's CPU seconds during the
# flood, and what the record counted against what was sent. Prints a
# Markdown section on stdout; everything is removed on exit.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-3}
secs=${SECONDS_PER:-3}
profile=${PROFILE:-debug}
target=${CARGO_TARGET_DIR:-$root/target}
flag() { if [ "$1" = release ]; then echo --release; fi; }
cargo build $(flag "$profile") --quiet -p egress-gateway --bins --manifest-path "$root/Cargo.toml"
gw=$target/$profile/egress-gateway
tag=$$
vmns=mrf-vm-$tag gwns=mrf-gw-$tag
state=$(mktemp -d /tmp/egress-refused-flood.XXXXXX)
gwpid=
cleanup() {
    [ -n "$gwpid" ] && kill "$gwpid" 2>/dev/null && wait "$gwpid" 2>/dev/null || true
    for ns in $vmns $gwns; do ip netns del "$ns" 2>/dev/null || true; done
    rm -rf "$state"
}
trap cleanup EXIT

for ns in $vmns $gwns; do
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1
done
ip -n "$gwns" link add vm1 type veth peer name eth0 netns "$vmns"
ip -n "$gwns" addr add 100.64.4.1/30 dev vm1
ip -n "$vmns" addr add 100.64.4.2/30 dev eth0
ip -n "$gwns" link add dum0 type veth peer name dum1
for l in "$gwns vm1" "$gwns dum0" "$gwns dum1" "$vmns eth0"; do set -- $l; ip -n "$1" link set "$2" up; done
ip -n "$vmns" route add default via 100.64.4.1
ip -n "$gwns" route add 203.0.113.0/24 dev dum0
ip netns exec "$gwns" sysctl -qw net.ipv4.ip_forward=1

admin() { ip netns exec "$gwns" curl -s -o "$state/reply" -w '%{http_code}' -X "$1" -H 'content-type: application/json' ${3:+--data-binary "$3"} "http://127.0.0.1:15000$2"; }
start_gateway() { # $1: the [machine_egress] lines
    rm -rf "$state/gw"
    cat > "$state/gateway.toml" <<TOML
state_dir = "$state/gw"
[listen]
transparent = "127.0.0.1:0"
dns = "127.0.0.1:0"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:15000"
[log]
flow_log = "off"
[machine_egress]
$1
TOML
    RUST_LOG=warn ip netns exec "$gwns" "$gw" run --config "$state/gateway.toml" 2>> "$state/gateway.err" &
    gwpid=$!
    for _ in $(seq 600); do
        [ "$(admin GET /readyz)" = 200 ] && break
        sleep 0.1
    done
    code=$(admin PUT /v1/vms/vm1 '{"addresses": ["100.64.4.2"], "egress": {"mode": "allowlist", "rules": [{"cidr": "198.51.100.0/24", "proto": "tcp", "port": 443}]}}')
    [ "$code" = 200 ] || { cat "$state/reply" "$state/gateway.err" >&2; exit 1; }
}
stop_gateway() { kill "$gwpid"; wait "$gwpid" 2>/dev/null || true; gwpid=; }
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; } # clock ticks, user + system

flood() { # prints packets sent
    ip netns exec "$vmns" python3 - "$secs" <<'PY'
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
end, n, b = time.monotonic() + float(sys.argv[1]), 0, b"x" * 32
while True:
    for _ in range(1000):
        s.sendto(b, ("203.0.113.99", 9))
    n += 1000
    if time.monotonic() >= end:
        break
print(n)
PY
}

measure() { # $1: label, $2: config lines
    start_gateway "$2"
    # The gateway's process is the child of `ip netns exec`, which execs it.
    local before after sent counted lost
    before=$(cpu "$gwpid")
    sent=$(flood)
    sleep 1.5 # events in flight, and the counters' next round (1 s)
    after=$(cpu "$gwpid")
    admin GET /v1/vms/vm1/network/egress/observed > /dev/null
    counted=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(e["count"] for e in d["observed"]), d.get("lost", 0))' "$state/reply")
    echo "$1 $sent $((after - before)) $counted"
    stop_gateway
}
results=$state/results
: > "$results"
for r in $(seq "$rounds"); do
    measure sampled $'observe = "sampled"\nobserve_interval = "1s"' >> "$results"
    measure events $'observe = "events"\nobserve_interval = "1s"' >> "$results"
    measure every $'observe = "events"\nlog_rate = 100000\nobserve_interval = "1s"' >> "$results"
    echo "round $r done" >&2
done
cat "$results" >&2

python3 - "$results" "$rounds" "$secs" "$(getconf CLK_TCK)" <<'PY'
import sys, statistics as st
rows = [l.split() for l in open(sys.argv[1])]
rounds, secs, tck = sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
by = {}
for label, sent, ticks, counted, lost in rows:
    by.setdefault(label, []).append((int(sent) / secs, int(ticks) / tck, int(sent), int(counted), int(lost)))
med = st.median
print(f"### Refused-packet flood ({rounds} interleaved rounds, {secs:.0f} s each, one UDP sender)\n")
print("| observe | sender packets/s | ratio to sampled | gateway CPU s per flood | recorded / sent | lost (rate) |")
print("|---|---|---|---|---|---|")
base = by["sampled"]
for label in ["sampled", "events", "every"]:
    rs = by[label]
    ratio = [a[0] / b[0] for a, b in zip(rs, base)]
    rec = [a[3] / a[2] for a in rs]
    print(f"| {label} | {med(x[0] for x in rs):.0f} ({min(x[0] for x in rs):.0f}–{max(x[0] for x in rs):.0f}) "
          f"| {med(ratio):.3f}× ({min(ratio):.3f}–{max(ratio):.3f}) "
          f"| {med(x[1] for x in rs):.2f} ({min(x[1] for x in rs):.2f}–{max(x[1] for x in rs):.2f}) "
          f"| {med(rec):.4f} ({min(rec):.4f}–{max(rec):.4f}) | {med(x[4] for x in rs):.0f} |")
PY
