#!/usr/bin/env bash
# Side-by-side benchmark of this gateway against direct, mitmproxy and Squid,
# in one interleaved session, with this repository's harness (benches/peers;
# its README has the topology and what each figure means).
#
#   benches/sidebyside.sh                                          # intercept mode, all five columns
#   MODE=splice PEERS="direct squid-splice gateway" benches/sidebyside.sh   # the gateway splices
#   PEERS="direct gateway squid-bump" ROUNDS=3 benches/sidebyside.sh
#
# It runs benches/peers/run.sh (every knob of it applies: ROUNDS, DUR, TESTS,
# GW_WORKERS, GW_BIN, ...), then appends to the summary it copied to
# benches/results/peers-<mode>-<time>.md: the gateway against each peer
# (benches/vs-peers.py, when there is a peer besides direct), DNS through
# the gateway (benches/dns-load.sh) and, in splice mode, the gateway's
# memory holding 9,000 idle spliced connections (benches/idle-rss.sh).
# EXTRAS=0 skips the last two.  Root; benches/peers/setup.sh once.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mode=${MODE:-intercept}
peers=${PEERS:-"direct mitmproxy squid-bump squid-splice gateway"}
summary=${SUMMARY_TO:-$root/benches/results/peers-$mode-$(date -u +%Y%m%dT%H%M%SZ).md}
[ "$summary" != none ] || { echo "sidebyside.sh appends to the summary: SUMMARY_TO cannot be none" >&2; exit 2; }
MODE=$mode PEERS=$peers SUMMARY_TO=$summary "$root/benches/peers/run.sh"
others=$(echo "$peers" | tr ' ' '\n' | grep -cvxE 'direct|gateway|' || true)
if [[ " $peers " == *" gateway "* ]] && [ "$others" -gt 0 ]; then
    printf '\nThe gateway against each peer (same session; throughput and CPU as gateway ÷ peer, latency as gateway − peer):\n\n' | tee -a "$summary"
    python3 "$root/benches/vs-peers.py" "$summary" | tee -a "$summary"
fi
if [ "${EXTRAS:-1}" = 1 ]; then
    echo | tee -a "$summary"
    "$root/benches/dns-load.sh" | tee -a "$summary"
    if [ "$mode" = splice ]; then
        rss=$("$root/benches/idle-rss.sh" | tail -1)
        python3 - "$rss" <<'EOF' | tee -a "$summary"
import json, sys
r = json.loads(sys.argv[1])
print(f"\n### Memory: {r['connections']:,} idle spliced TLS connections\n")
print(f"RSS {r['rss_before_kib'] / 1024:.1f} MiB before, {r['rss_with_idle_kib'] / 1024:.1f} MiB holding them: "
      f"{r['bytes_per_idle_connection'] / 1024:.1f} KiB per idle connection.")
EOF
    fi
fi
echo "summary: $summary" >&2
