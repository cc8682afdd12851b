#!/usr/bin/env bash
# Side-by-side benchmark of this gateway against direct, mitmproxy and Squid
# in the shared testbed (../shared/testbed), in one interleaved session.
#
#   benches/sidebyside.sh                 # intercept mode, all columns
#   MODE=splice benches/sidebyside.sh     # the gateway splices (CIDR exemption)
#   PEERS="direct gateway squid-bump" ROUNDS=3 benches/sidebyside.sh
#
# After the testbed's comparison it runs benches/dns-load.sh (DNS through the
# gateway vs the upstream directly, loopback) and, in splice mode,
# benches/idle-rss.sh (RSS holding 9,000 idle spliced connections), and
# appends both to the summary (EXTRAS=0 skips them).
#
# Root only; run ../shared/testbed/setup.sh once first.  The gateway is the
# release build with one worker thread (GW_WORKERS=N for more); its sandbox
# (the testbed client, 100.64.0.1) is pushed over the control API once the
# gateway is ready: allow 203.0.113.0/24 with TLS interception on, plus
# (MODE=splice) a CIDR exemption for the same range.  Results land in
# /tmp/peerbench/results/<time>/ (the testbed's), and the summary is copied
# to benches/results/<mode>-<time>.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
testbed=${TESTBED:-$root/../shared/testbed}
mode=${MODE:-intercept}
bin=$root/target/release/egress-gateway
[ -x "$bin" ] || cargo build --release -p egress-gateway --manifest-path "$root/Cargo.toml"
state=/tmp/peerbench/egress-gateway-$mode
rm -rf "$state"
mkdir -p "$state"
"$bin" ca init --dir "$state/ca" >/dev/null
case $mode in
    intercept) policy='{"default": "deny", "allow": [{"cidr": "203.0.113.0/24"}], "tls_interception": "on"}' ;;
    splice) policy='{"default": "deny", "allow": [{"cidr": "203.0.113.0/24"}], "tls_interception": "on", "tls_interception_exemptions": [{"cidr": "203.0.113.0/24"}]}' ;;
    *) echo "MODE must be intercept or splice" >&2; exit 2 ;;
esac
# The testbed client's sandbox, as the controller pushes it (gateway-column.sh
# PUTs it over the control API once the gateway is ready).
printf '{"addresses": ["100.64.0.1"], "policy": %s}\n' "$policy" > "$state/sandbox.json"
export GATEWAY_CMD="$root/benches/gateway-column.sh $state $bin"
export GATEWAY_CA_CERT=$state/ca/ca.crt
if [ "$mode" = splice ]; then export GATEWAY_EXPECT_ISSUER="PeerBench Test Origin CA"; fi
export PEERS=${PEERS:-"direct mitmproxy squid-bump squid-splice gateway"}
cd "$testbed"
# run.sh reads the test PKI before it brings the testbed up when a gateway CA
# is added to the client bundle: bring it up first (and down at the end).
if [ ! -s "${PB_STATE:-/tmp/peerbench}/pki/client-bundle.pem" ]; then
    ./testbed.sh up
    trap './testbed.sh down' EXIT
fi
out=$(mktemp)
./run.sh | tee "$out"
echo "Gateway column: limits.worker_threads = ${GW_WORKERS:-1} (GW_WORKERS)." | tee -a "$out"
if [ "$(echo "$PEERS" | wc -w)" -gt 2 ]; then
    printf '\nThe gateway against each peer (same session; throughput and CPU as gateway ÷ peer, latency as gateway − peer):\n\n' | tee -a "$out"
    python3 "$root/benches/vs-peers.py" "$out" | tee -a "$out"
fi
# DNS through the gateway's listener and memory with idle spliced flows, in
# the same session (EXTRAS=0 skips them; each also runs on its own).
if [ "${EXTRAS:-1}" = 1 ]; then
    echo | tee -a "$out"
    "$root/benches/dns-load.sh" | tee -a "$out"
    if [ "$mode" = splice ]; then
        rss=$("$root/benches/idle-rss.sh" | tail -1)
        python3 - "$rss" <<'EOF2' | tee -a "$out"
import json, sys
r = json.loads(sys.argv[1])
print(f"\n### Memory: {r['connections']:,} idle spliced TLS connections\n")
print(f"RSS {r['rss_before_kib'] / 1024:.1f} MiB before, {r['rss_with_idle_kib'] / 1024:.1f} MiB holding them: "
      f"{r['bytes_per_idle_connection'] / 1024:.1f} KiB per idle connection.")
EOF2
    fi
fi
mkdir -p "$root/benches/results"
cp "$out" "$root/benches/results/$mode-$(date -u +%Y%m%dT%H%M%SZ).md"
