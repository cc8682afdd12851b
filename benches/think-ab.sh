#!/usr/bin/env bash
# Gateway CPU per request for clients that pause between requests: C verified
# TLS connections (benches/think.py), K rounds of one `GET /1k` on each, T
# seconds apart, against the `gateway` and `gateway-base` columns of the
# benches/peers topology, alternating which goes first. Prints one line per
# column and round: "<round> <column> <ms per 1k requests>" (the CPU of the
# column's process tree, handshakes included).
#
# Root; the topology kept up by a run of the two columns first:
#   MODE=intercept PEERS="gateway gateway-base" TESTS=ka ROUNDS=1 KEEP_UP=1 \
#       GW_BIN=… GW_BASE_BIN=… benches/peers/run.sh
#   R=6 C=200 K=8 T=1.6 benches/think-ab.sh
#   benches/peers/topo.sh down
# Every run is bounded: K rounds, 10 s socket timeouts, 120 s per run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/benches/peers"
# shellcheck source=benches/peers/lib.sh
. ./lib.sh
eb_need_root
R=${R:-6}; C=${C:-200}; K=${K:-8}; T=${T:-1.6}
tick=$(getconf CLK_TCK)
cpu_ms() { echo $(($(eb_tree_ticks "$1") * 1000 / tick)); }
for ((i = 1; i <= R; i++)); do
    order="gateway gateway-base"
    ((i % 2 == 0)) && order="gateway-base gateway"
    for col in $order; do
        # shellcheck disable=SC2046 # the port and the HTTP port, two words
        ./topo.sh mode $(./peers.sh ports "$col") >/dev/null
        pid=$(./peers.sh pid "$col")
        c0=$(cpu_ms "$pid")
        eb_in eb-cl timeout 120 "$EB_PYTHON" "$root/benches/think.py" --ip "$ORIGIN_IP" \
            --host "$ORIGIN_HOST" --cafile "$EB_RUN/$col/ca/ca.crt" --c "$C" --k "$K" --t "$T" >/dev/null
        c1=$(cpu_ms "$pid")
        awk -v i="$i" -v col="$col" -v a="$c0" -v b="$c1" -v n=$((C * K)) \
            'BEGIN {printf "%d %s %.2f\n", i, col, (b - a) / n * 1000}'
    done
done
