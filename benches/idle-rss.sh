#!/usr/bin/env bash
# Resident memory of the gateway holding N idle spliced TLS connections
# (default 9,000), in the benches/peers topology: the gateway column in
# splice mode, a Python client in eb-cl (benches/idle-hold.py) opening N
# verified TLS connections to the origin through it and holding them.
# Root; benches/peers/setup.sh once.  Prints one JSON line.
#
#   benches/idle-rss.sh            # CONNS=9000 (see below); GW_BIN, GW_WORKERS apply
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=benches/peers/lib.sh
. "$root/benches/peers/lib.sh"
eb_need_root
# Two descriptors per spliced flow: this workplace caps a process at 20,000
# (the hard limit cannot be raised here), so 9,000 is the most that fits.
n=${CONNS:-9000}
bin=${GW_BIN:-$root/target/release/egress-gateway}
[ -x "$bin" ] || cargo build --release -p egress-gateway --manifest-path "$root/Cargo.toml"
mkdir -p "$EB_STATE"
exec 9>"$EB_STATE/lock"
flock -n 9 || eb_die "a benches/peers run holds $EB_STATE/lock"
topo=$root/benches/peers/topo.sh
holder=
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$holder" ]; then kill "$holder" 2>/dev/null || true; fi
    "$root/benches/peers/peers.sh" stop gateway >/dev/null 2>&1 || true
    "$topo" down >/dev/null 2>&1 || true
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
eb_ns_exists "$NS_GW" && "$topo" down
"$topo" up
MODE=splice GW_BIN=$bin "$root/benches/peers/peers.sh" start gateway
# shellcheck disable=SC2046
"$topo" mode $("$root/benches/peers/peers.sh" ports gateway)
pid=$(cat "$EB_RUN/gateway/gateway.pid")
rss() { awk '/^VmRSS:/ {print $2}' "/proc/$pid/status"; }
before=$(rss)
out=$EB_RUN/idle-hold.out
: > "$out"
eb_in "$NS_CL" "$EB_PYTHON" "$root/benches/idle-hold.py" --ip "$ORIGIN_IP" --host "$ORIGIN_HOST" \
    --cafile "$ORIGIN_CA_CRT" --n "$n" --hold 20 > "$out" 2>&1 9>&- &
holder=$!
for _ in $(seq 600); do
    grep -q held "$out" && break
    [ -d "/proc/$holder" ] || break
    sleep 0.5
done
grep -q held "$out" || eb_die "the client did not open $n connections: $(tail -3 "$out")"
sleep 3
after=$(rss)
kill "$holder" 2>/dev/null || true
wait "$holder" 2>/dev/null || true
holder=
printf '{"connections": %d, "rss_before_kib": %d, "rss_with_idle_kib": %d, "bytes_per_idle_connection": %d}\n' \
    "$n" "$before" "$after" $(((after - before) * 1024 / n))
