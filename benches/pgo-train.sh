#!/usr/bin/env bash
# The training workload of the release build's profile (.ci/pgo.sh): an
# instrumented gateway (built with -Cprofile-generate) run through each path
# a worker's traffic takes, a fixed few seconds each, so that its counts
# say which code is hot. Code the workload never runs is laid out as cold
# in the optimised build: a path missing here is a path made slower there.
#
#   benches/pgo-train.sh GATEWAY_BINARY
#
# The counts go where LLVM_PROFILE_FILE says (set by .ci/pgo.sh); each
# gateway process writes its own when it exits (SIGTERM, as peers.sh stops
# it). Root; what benches/peers/topo.sh and the load need: nginx, wrk, h2load
# (nghttp2-client), gcc and libssl-dev (the TLS connection-rate client),
# python3, openssl, nftables, iproute2, curl.
#
# The paths, in the benches/peers topology (network namespaces; the origin
# is nginx at 203.0.113.10, nothing leaves them):
#   - intercepted: HTTPS keep-alive, HTTP/2 (streams over one connection,
#     and its shared upstream), 1 MiB bodies, new connections with a full
#     handshake and resumed ones, plain HTTP (port 80), a POST with a body;
#   - a name under a per-request rule (`read_only`): every request judged,
#     a write refused;
#   - spliced (a TLS exemption): keep-alive, bulk and new connections;
#   - refused at the ClientHello: a name the policy does not allow;
#   - DNS at the reserved resolver: A and AAAA queries for allowed names
#     (answered upstream and attributed) and denied ones, from a sandbox,
#     through the gateway's listener to benches/pgo-dns.py on loopback
#     inside the gateway's namespace.
set -euo pipefail
BIN=${1:?usage: pgo-train.sh GATEWAY_BINARY}
BIN=$(readlink -f "$BIN")
[ -x "$BIN" ] || { echo "pgo-train.sh: no binary at $BIN" >&2; exit 1; }
# shellcheck source=benches/peers/lib.sh
. "$(dirname "$0")/peers/lib.sh"
eb_need_root
for t in nginx wrk h2load gcc python3 openssl nft curl; do
    command -v "$t" >/dev/null || eb_die "$t is missing (benches/peers/setup.sh, or the packages named in this script's header)"
done
SECS=${PGO_SECS:-2}
mkdir -p "$EB_STATE" "$EB_BIN"
exec 9>"$EB_STATE/lock"
flock -n 9 || eb_die "another benches/peers run holds $EB_STATE/lock"
TLSCONN=$EB_BIN/tlsconn
gcc -O2 -Wall -pthread "$EB_DIR/tlsconn.c" -o "$TLSCONN" -lssl -lcrypto || eb_die "tlsconn.c does not build"
STARTED=0
COLS=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$STARTED" = 1 ]; then
        "$EB_DIR/topo.sh" mode off >/dev/null 2>&1 || true
        for c in $COLS; do "$EB_DIR/peers.sh" stop "$c" >/dev/null 2>&1 || true; done
        "$EB_DIR/topo.sh" down >/dev/null 2>&1 || true
    fi
    exit "$rc"
}
trap cleanup EXIT
eb_topology_fresh
export GW_BIN=$BIN
URL=https://$ORIGIN_HOST
client() { eb_in "$NS_CL" timeout $((SECS + 20)) "$@"; }
tls() { client "$TLSCONN" --duration "$SECS" --ip "$ORIGIN_IP" --cafile "$BUNDLE" "$@"; }

# The columns start before any load: the origin connections of a load take
# ports of the gateway's namespace, the port a column started after it
# would listen on among them. gateway-base is the same binary, spliced.
export GW_BASE_BIN=$BIN
MODE=intercept "$EB_DIR/peers.sh" start gateway
MODE=intercept "$EB_DIR/peers.sh" start gateway-ro
MODE=splice "$EB_DIR/peers.sh" start gateway-base
COLS="gateway gateway-ro gateway-base"
BUNDLE=$EB_RUN/pgo-trust.pem
cat "$ORIGIN_CA_CRT" "$EB_RUN/gateway/ca/ca.crt" "$EB_RUN/gateway-ro/ca/ca.crt" "$EB_RUN/gateway-base/ca/ca.crt" > "$BUNDLE"
head -c 4096 /dev/zero | tr '\0' x > "$EB_RUN/pgo-body"

# The client's traffic to one column; stop() ends it, which writes its counts.
column() {
    # shellcheck disable=SC2046
    "$EB_DIR/topo.sh" mode $("$EB_DIR/peers.sh" ports "$1")
    eb_log "training: $1"
}
# Each column's counts are checked as it stops: peers.sh kills a column that
# has not stopped 5 s after SIGTERM, and a killed process writes nothing.
stop() {
    local pid
    pid=$(cat "$EB_RUN/$1/gateway.pid")
    "$EB_DIR/topo.sh" mode off >/dev/null
    "$EB_DIR/peers.sh" stop "$1"
    if [ -n "${LLVM_PROFILE_FILE:-}" ] && [ ! -s "${LLVM_PROFILE_FILE//%p/$pid}" ]; then
        eb_die "$1 (pid $pid) wrote no counts to ${LLVM_PROFILE_FILE//%p/$pid}: killed before it stopped?"
    fi
}

# The training's sandbox denies one name, refused at its ClientHello below
# (the columns' policy allows the origin's whole range by address).
sed 's/"default": "deny", /"default": "deny", "deny": [{"domain": "refused.test"}], /' \
    "$EB_RUN/gateway/sandbox.json" > "$EB_RUN/pgo-sandbox.json"
grep -q refused.test "$EB_RUN/pgo-sandbox.json" || eb_die "the training's policy lost its deny"
eb_in "$NS_GW" curl -sf --max-time 5 -X PUT --data-binary @"$EB_RUN/pgo-sandbox.json" \
    "http://127.0.0.1:$GW_ADMIN_PORT/v1/sandboxes/eb-client" >/dev/null || eb_die "the training's policy push failed"

column gateway
client wrk -t1 -c4 -d"${SECS}s" --timeout 5s "$URL/1k" >/dev/null
client h2load -t1 -c8 -m32 -D"$SECS" "$URL/1k" >/dev/null
client h2load -t1 -c2 -m4 -D"$SECS" "$URL/1m" >/dev/null
client wrk -t1 -c2 -d"${SECS}s" --timeout 10s "$URL/1m" >/dev/null
client wrk -t1 -c2 -d"${SECS}s" --timeout 5s "http://$ORIGIN_HOST/1k" >/dev/null
client h2load -t1 -c2 -m8 -n 2000 -d "$EB_RUN/pgo-body" "$URL/post" >/dev/null
tls --conns 4 --host "$ORIGIN_HOST" --path /1k >/dev/null
tls --conns 4 --host "$ORIGIN_HOST" --path /1k --resume >/dev/null
# Refused at the ClientHello: every handshake fails, as it must, and the
# gateway counts them as the tenant's deny.
tls --conns 2 --host refused.test --path /1k >/dev/null 2>&1 || true
eb_in "$NS_GW" curl -sf --max-time 5 "http://127.0.0.1:$GW_ADMIN_PORT/metrics" |
    grep -Eq '^egress_flows_total\{verdict="deny",reason="tenant_deny"\} [1-9]' ||
    eb_die "no flow to refused.test was denied: the refused path was not trained"
stop gateway

column gateway-ro
client wrk -t1 -c4 -d"${SECS}s" --timeout 5s "$URL/1k" >/dev/null
client h2load -t1 -c4 -m16 -D"$SECS" "$URL/1k" >/dev/null
# Writes are refused (403) under read_only.
client h2load -t1 -c2 -m8 -n 2000 -d "$EB_RUN/pgo-body" "$URL/post" >/dev/null
stop gateway-ro

column gateway-base
client wrk -t1 -c4 -d"${SECS}s" --timeout 5s "$URL/1k" >/dev/null
client wrk -t1 -c2 -d"${SECS}s" --timeout 10s "$URL/1m" >/dev/null
tls --conns 4 --host "$ORIGIN_HOST" --path /1k >/dev/null
stop gateway-base

eb_log "training: DNS"
eb_in "$NS_GW" python3 "$(dirname "$0")/pgo-dns.py" --gateway "$BIN" --state "$EB_RUN/pgo-dns" --seconds "$SECS"
eb_log "training done"
