#!/usr/bin/env bash
# Side-by-side benchmark: this gateway against direct, mitmproxy and Squid
# (bump and splice), interleaved in one session.  Root; run setup.sh once.
#
#   benches/peers/run.sh                                   # intercept, all five columns
#   MODE=splice PEERS="direct squid-splice gateway" benches/peers/run.sh
#   ROUNDS=1 DUR=2 benches/peers/run.sh                    # a short smoke
#
# Environment (all optional):
#   MODE=intercept      the gateway column terminates TLS; splice: a CIDR exemption splices it
#   PEERS               columns, in order (default "direct mitmproxy squid-bump squid-splice gateway")
#   ROUNDS=5 DUR=4      interleaved rounds; seconds per throughput run
#   TESTS               default "ka newres newfull bulk h2 latka latnew"
#   KA_CONNS=4 NEW_CONNS=4 BULK_CONNS=2 H2_CONNS=8 H2_STREAMS=32
#   LAT_KA_N=300 LAT_KA_RATE=100 LAT_NEW_N=150 LAT_NEW_RATE=50
#   GW_BIN              gateway binary (default target/release/egress-gateway, built first
#                       unless GW_BUILD=0); GW_WORKERS=1, GW_FLOW_LOG=off (see ../gateway-column.sh)
#   GW_BASE_BIN         the binary of the gateway-base column (an A/B of two builds)
#   WARMUP=1            a short warm-up of every column before round 1
#   KEEP_UP=1           leave the namespaces and columns running afterwards (topo.sh down ends them)
#   OUT                 raw results (default /tmp/egress-peers/results/<UTC time>)
#   SUMMARY_TO          copy of the summary (default benches/results/peers-<mode>-<UTC time>.md;
#                       the chart goes beside it as .svg); "none" = no copy
#
# Each round runs every test on every column back to back, the column order
# rotated per round; switching columns swaps one nft rule (topo.sh mode), so
# every ratio compares runs taken seconds apart.  Before each run a verified
# request checks that the client sees the column's certificate issuer.
set -euo pipefail
# shellcheck source=benches/peers/lib.sh
. "$(dirname "$0")/lib.sh"
eb_need_root

MODE=${MODE:-intercept}
PEERS=${PEERS:-"direct mitmproxy squid-bump squid-splice gateway"}
ROUNDS=${ROUNDS:-5}
DUR=${DUR:-4}
TESTS=${TESTS:-"ka newres newfull bulk h2 latka latnew"}
KA_CONNS=${KA_CONNS:-4}
NEW_CONNS=${NEW_CONNS:-4}
BULK_CONNS=${BULK_CONNS:-2}
H2_CONNS=${H2_CONNS:-8}
H2_STREAMS=${H2_STREAMS:-32}
LAT_KA_N=${LAT_KA_N:-300}
LAT_KA_RATE=${LAT_KA_RATE:-100}
LAT_NEW_N=${LAT_NEW_N:-150}
LAT_NEW_RATE=${LAT_NEW_RATE:-50}
WARMUP=${WARMUP:-1}
KEEP_UP=${KEEP_UP:-0}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-$EB_STATE/results/$STAMP}
SUMMARY_TO=${SUMMARY_TO:-$EB_ROOT/benches/results/peers-$MODE-$STAMP.md}
export MODE
case $MODE in intercept|splice) ;; *) eb_die "MODE is intercept or splice" ;; esac
for p in $PEERS; do
    case $p in direct|mitmproxy|squid-bump|squid-splice|gateway|gateway-ro|gateway-log|gateway-kernel|gateway-2|gateway-pc|gateway-pc1|gateway-base|gateway-pipe|gateway-shadow) ;; *) eb_die "unknown column $p" ;; esac
done
for t in $TESTS; do
    case $t in ka|newres|newfull|bulk|h2|latka|latnew) ;; *) eb_die "unknown test $t" ;; esac
done
if ! { [ "$ROUNDS" -ge 1 ] && [ "$ROUNDS" -le 50 ] && [ "$DUR" -ge 1 ] && [ "$DUR" -le 60 ]; }; then
    eb_die "ROUNDS 1..50, DUR 1..60"
fi

mkdir -p "$EB_STATE" "$EB_BIN"
exec 9>"$EB_STATE/lock"
flock -n 9 || eb_die "another benches/peers run holds $EB_STATE/lock"

# ---------------------------------------------------------------- builds ----
if [[ " $PEERS " == *" gateway"* ]] && [ -z "${GW_BIN:-}" ] && [ "${GW_BUILD:-1}" = 1 ]; then
    eb_log "cargo build --release -p egress-gateway"
    cargo build --release -p egress-gateway --manifest-path "$EB_ROOT/Cargo.toml" 9>&-
fi
TLSCONN=$EB_BIN/tlsconn
if [ ! -x "$TLSCONN" ] || [ "$EB_DIR/tlsconn.c" -nt "$TLSCONN" ]; then
    gcc -O2 -Wall -pthread "$EB_DIR/tlsconn.c" -o "$TLSCONN" -lssl -lcrypto || eb_die "tlsconn.c does not build (setup.sh installs gcc and libssl-dev)"
fi

# ------------------------------------------------------------- lifecycle ----
STARTED=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$STARTED" = 1 ] && [ "$KEEP_UP" != 1 ]; then
        "$EB_DIR/topo.sh" mode off >/dev/null 2>&1 || true
        for p in $PEERS; do "$EB_DIR/peers.sh" stop "$p" >/dev/null 2>&1 || true; done
        "$EB_DIR/topo.sh" down || true
    fi
    exit "$rc"
}
trap cleanup EXIT
eb_topology_fresh
for p in $PEERS; do
    eb_log "starting $p"
    "$EB_DIR/peers.sh" start "$p"
done

mkdir -p "$OUT/raw"
# The client trusts the origin CA and every interception CA.
BUNDLE=$OUT/trust.pem
cat "$ORIGIN_CA_CRT" "$PROXY_CA_CRT" > "$BUNDLE"
for p in $PEERS; do
    case $p in gateway*) cat "$EB_RUN/$p/ca/ca.crt" >> "$BUNDLE" ;; esac
done

{
    echo "date_utc: $(date -u +%FT%TZ)"
    echo "host: $(uname -srm), $(nproc) cpus, $(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo) GiB"
    echo "cpu: $(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)"
    echo "mode: $MODE"
    echo "peers: $PEERS"
    echo "rounds: $ROUNDS"
    echo "dur: $DUR"
    echo "tests: $TESTS"
    echo "ka_conns: $KA_CONNS"
    echo "new_conns: $NEW_CONNS"
    echo "bulk_conns: $BULK_CONNS"
    echo "h2_conns: $H2_CONNS"
    echo "h2_streams: $H2_STREAMS"
    echo "latka: n=$LAT_KA_N rate=$LAT_KA_RATE/s"
    echo "latnew: n=$LAT_NEW_N rate=$LAT_NEW_RATE/s"
    echo "key_alg: $EB_KEY_ALG"
    echo "gw_workers: ${GW_WORKERS:-1}"
    echo "gw_flow_log: ${GW_FLOW_LOG:-off}"
    [[ " $PEERS " == *" gateway"* ]] && echo "gw_bin: ${GW_BIN:-$EB_ROOT/target/release/egress-gateway} ($(git -C "$EB_ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$EB_ROOT" diff --quiet HEAD -- 2>/dev/null || echo ', work tree modified'))"
    [[ " $PEERS " == *" gateway-base "* ]] && echo "gw_base_bin: ${GW_BASE_BIN:-}"
    echo "versions: $(openssl version | awk '{print "OpenSSL " $2}'), $(nginx -v 2>&1 | sed 's/.*: //'), $(wrk -v 2>&1 | head -1 | awk '{print "wrk " $2}'), $(h2load --version 2>&1 | head -1 | sed 's/.*nghttp2\//h2load /'), $(squid -v | head -1 | sed 's/.*Version /Squid /'), mitmproxy $(mitmdump --version 2>/dev/null | awk '/Mitmproxy/ {print $2}')"
    echo "loadavg_before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "procstat_before: $(grep '^cpu ' /proc/stat)"
} > "$OUT/env.txt"
printf 'round\ttest\tpeer\trc\tcl_conns\torigin_syns\tcpu_s\twall_s\traw\n' > "$OUT/runs.tsv"

# ------------------------------------------------------------------ runs ----
URL=https://$ORIGIN_HOST
client() { eb_in "$NS_CL" "$@"; }
probe() { client timeout $((LAT_KA_N / LAT_KA_RATE + LAT_NEW_N / LAT_NEW_RATE + 40)) "$EB_PYTHON" "$EB_DIR/probe.py" "$@" --ip "$ORIGIN_IP" --host "$ORIGIN_HOST" --cafile "$BUNDLE"; }

switch_to() {
    local peer=$1 expect out
    # shellcheck disable=SC2046
    "$EB_DIR/topo.sh" mode $("$EB_DIR/peers.sh" ports "$peer")
    expect=$("$EB_DIR/peers.sh" issuer "$peer")
    out=$(probe check --expect-issuer "$expect") || eb_die "$peer: the client does not see issuer '$expect': $out"
}

run_one() {
    local test=$1 peer=$2 round=$3 raw rc=0 pid c0 o0 c1 o1 k0 k1 t0 t1 cpu=""
    raw=$OUT/raw/r$round-$test-$peer.out
    switch_to "$peer"
    pid=$("$EB_DIR/peers.sh" pid "$peer")
    read -r c0 o0 < <("$EB_DIR/topo.sh" counters)
    k0=$(eb_tree_ticks "$pid")
    t0=$(date +%s.%N)
    case $test in
        ka) client timeout $((DUR + 20)) wrk -t1 -c"$KA_CONNS" -d"${DUR}s" --timeout 5s "$URL/1k" ;;
        newres) client timeout $((DUR + 20)) "$TLSCONN" --resume --conns "$NEW_CONNS" --duration "$DUR" \
                    --ip "$ORIGIN_IP" --host "$ORIGIN_HOST" --path /1k --cafile "$BUNDLE" ;;
        newfull) client timeout $((DUR + 20)) "$TLSCONN" --conns "$NEW_CONNS" --duration "$DUR" \
                    --ip "$ORIGIN_IP" --host "$ORIGIN_HOST" --path /1k --cafile "$BUNDLE" ;;
        bulk) client timeout $((DUR + 20)) wrk -t1 -c"$BULK_CONNS" -d"${DUR}s" --timeout 10s "$URL/1m" ;;
        h2) client timeout $((DUR + 20)) h2load -t1 -c"$H2_CONNS" -m"$H2_STREAMS" -D"$DUR" "$URL/1k" ;;
        latka) probe ka --path /1k --n "$LAT_KA_N" --rate "$LAT_KA_RATE" ;;
        latnew) probe new --path /1k --n "$LAT_NEW_N" --rate "$LAT_NEW_RATE" ;;
    esac >"$raw" 2>&1 || rc=$?
    t1=$(date +%s.%N)
    k1=$(eb_tree_ticks "$pid")
    read -r c1 o1 < <("$EB_DIR/topo.sh" counters)
    [ -n "$pid" ] && cpu=$(awk -v a="$k0" -v b="$k1" -v hz="$EB_CLK_TCK" 'BEGIN {printf "%.3f", (b - a) / hz}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$round" "$test" "$peer" "$rc" "$((c1 - c0))" "$((o1 - o0))" \
        "$cpu" "$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f", b - a}')" "raw/$(basename "$raw")" >> "$OUT/runs.tsv"
    [ "$rc" = 0 ] || eb_log "  $test/$peer round $round exited $rc (see $raw)"
}

read -r -a COLS <<< "$PEERS"
if [ "$WARMUP" = 1 ]; then
    eb_log "warm-up"
    for p in "${COLS[@]}"; do
        switch_to "$p"
        client timeout 20 wrk -t1 -c2 -d1s "$URL/1k" >/dev/null 2>&1 || true
        client timeout 20 "$TLSCONN" --resume --conns 2 --duration 1 --ip "$ORIGIN_IP" --host "$ORIGIN_HOST" --cafile "$BUNDLE" >/dev/null 2>&1 || true
    done
fi
for ((r = 1; r <= ROUNDS; r++)); do
    for t in $TESTS; do
        order=()
        for ((i = 0; i < ${#COLS[@]}; i++)); do order+=("${COLS[$(((i + r - 1) % ${#COLS[@]}))]}"); done
        eb_log "round $r/$ROUNDS $t: ${order[*]}"
        for p in "${order[@]}"; do run_one "$t" "$p" "$r"; done
    done
done
{
    echo "loadavg_after: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "procstat_after: $(grep '^cpu ' /proc/stat)"
    for ns in "$NS_CL" "$NS_GW" "$NS_OR"; do
        echo "blocked_egress_$ns: $(ip netns exec "$ns" nft list chain inet ebguard out | awk '/blocked egress/ {for (i = 1; i < NF; i++) if ($i == "packets") print $(i + 1)}')"
    done
    # shellcheck disable=SC2016
    echo "gw_udp_out: $(ip netns exec "$NS_GW" awk '/^Udp:/ && ++n == 2 {print $5}' /proc/net/snmp)"
} >> "$OUT/env.txt"

# --------------------------------------------------------------- summary ----
"$EB_PYTHON" "$EB_DIR/summarize.py" "$OUT" > "$OUT/summary.md"
"$EB_PYTHON" "$EB_DIR/chart.py" "$OUT/summary.md" > "$OUT/ratios.svg"
cat "$OUT/summary.md"
if [ "$SUMMARY_TO" != none ]; then
    mkdir -p "$(dirname "$SUMMARY_TO")"
    cp "$OUT/summary.md" "$SUMMARY_TO"
    cp "$OUT/ratios.svg" "${SUMMARY_TO%.md}.svg"
    eb_log "summary: $SUMMARY_TO (chart ${SUMMARY_TO%.md}.svg)"
fi
eb_log "raw results: $OUT"
