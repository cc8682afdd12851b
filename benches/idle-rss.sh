#!/usr/bin/env bash
# Resident memory of the gateway holding N idle spliced TLS connections
# (default 9,000), in the shared testbed. Root only; ../shared/testbed/setup.sh once.
#
#   benches/idle-rss.sh            # CONNS=9000 (see below)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
testbed=${TESTBED:-$root/../shared/testbed}
# Two descriptors per spliced flow: this workplace caps a process at 20,000
# (the hard limit cannot be raised here), so 9,000 is the most that fits.
n=${CONNS:-9000}
bin=$root/target/release/egress-gateway
[ -x "$bin" ] || cargo build --release -p egress-gateway --manifest-path "$root/Cargo.toml"
state=/tmp/peerbench/egress-gateway-idle
rm -rf "$state"; mkdir -p "$state"
"$bin" ca init --dir "$state/ca" >/dev/null
printf '{"addresses": ["100.64.0.1"], "policy": %s}\n' \
  '{"default": "deny", "allow": [{"cidr": "203.0.113.0/24"}], "tls_interception": "on", "tls_interception_exemptions": [{"cidr": "203.0.113.0/24"}]}' \
  > "$state/sandbox.json"
cd "$testbed"
. ./lib.sh
./testbed.sh up >/dev/null
trap './peer_gateway.sh stop >/dev/null 2>&1 || true; ./testbed.sh down >/dev/null 2>&1 || true' EXIT
export GATEWAY_CMD="$root/benches/gateway-column.sh $state $bin"
./peer_gateway.sh start 8443 8443 >/dev/null
./testbed.sh mode 8443 8443 >/dev/null
# The column's wrapper pushes the policy and waits on the gateway, its child.
wrapper=$(cat "$PB_RUN/peer-gateway.pid")
pid=$(pgrep -P "$wrapper" -x egress-gateway || true)
[ -n "$pid" ] || { echo "no egress-gateway under pid $wrapper" >&2; exit 1; }
rss() { awk '/VmRSS/ {print $2}' "/proc/$pid/status"; }
before=$(rss)
out=$(mktemp)
ip netns exec "$NS_SB" python3 "$root/benches/idle-hold.py" --ip "$ORIGIN_IP" --host "$ORIGIN_HOST" \
    --cafile "$PB_PKI/origin-ca.crt" --n "$n" --hold 20 > "$out" &
holder=$!
for _ in $(seq 1 600); do grep -q held "$out" && break; sleep 0.5; done
grep -q held "$out" || { echo "the client did not open $n connections" >&2; kill "$holder"; exit 1; }
sleep 3
after=$(rss)
kill "$holder" 2>/dev/null || true
wait "$holder" 2>/dev/null || true
printf '{"connections": %d, "rss_before_kib": %d, "rss_with_idle_kib": %d, "bytes_per_idle_connection": %d}\n' \
    "$n" "$before" "$after" $(( (after - before) * 1024 / n ))
