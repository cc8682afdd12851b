#!/usr/bin/env bash
# Resident memory of the gateway holding N idle TLS connections, in the
# benches/peers topology: the gateway column, and Python clients in eb-cl
# (benches/idle-hold.py) opening N verified TLS connections to the origin
# through it and holding them.
#   MODE=splice (default): the column splices (a CIDR exemption); each flow
#     is a client socket and an upstream socket, bytes copied when they move.
#   MODE=intercept: the column terminates TLS; each client connection sends
#     one keep-alive request (GET /ok), then stays idle. The clients speak
#     HTTP/1.1, so the gateway sends their requests on HTTP/1.1 upstream
#     connections, whether or not the origin offers h2 (ORIGIN_H2=0: it does
#     not). A client connection keeps its upstream connection while busy and
#     gives it back to the gateway's pool after a quarter second without a byte (the
#     pool keeps at most 128 per sandbox and destination; the rest close), so
#     an idle client connection pins none; after a second without a byte the
#     client connection is parked (its HTTP/1.1 parser and buffers dropped
#     until its next bytes). RSS is read 3 s after the last connection opened.
#     POST=N makes that request `POST /post` with an N-byte body (the
#     origin answers it without a file; topo.sh). CLIENT_H2=1: the clients
#     speak HTTP/2 (one GET each); such connections are not parked.
# Root; benches/peers/setup.sh once.  Prints one JSON line.
#
#   benches/idle-rss.sh                  # splice, CONNS=9000
#   MODE=intercept benches/idle-rss.sh   # intercept, CONNS=50000 or as many as fit (below)
#
# Knobs: CONNS, HOLDERS (client processes, default max(2, ceil(CONNS/15000))),
# GW_BIN, GW_WORKERS (see gateway-column.sh), INSPECT (a shell command run
# while the connections are held, with the gateway's pid as $1; its output
# goes to stderr, e.g. INSPECT='grep -E "^(Rss|Anon)" /proc/$1/smaps_rollup').
# The environment reaches the gateway: MIMALLOC_ALLOW_THP=0 turns transparent
# huge pages off for its heap (mimalloc's option; the JSON line says whether
# THP was on and how much of the RSS was huge pages).
#
# Descriptors: the gateway holds two per connection (client and upstream) in
# both modes, so N is bounded by the gateway's hard RLIMIT_NOFILE (this
# workplace: 20,000, and without CAP_SYS_RESOURCE it cannot be raised): at
# most (limit - 256) / 2 connections.  Past 10,000 the one client address
# holds its share of gateway-column.sh's limits.max_connections (20,000: half
# for a lone source, docs/operations.md).  Past ~25,000 the namespaces'
# ephemeral port range (one client address, one origin address) is widened
# to 1024-65535 on both hops, which covers 60,000 per hop.  At 50,000 the
# origin matters too: nginx's workers are under the same descriptor limit,
# and its keepalive_timeout (120 s, topo.sh) closes idle upstream connections
# opened earlier than that (about 400 intercepted connections/s open here).
# The JSON line counts both sides' established sockets when RSS is read.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=benches/peers/lib.sh
. "$root/benches/peers/lib.sh"
eb_need_root
mode=${MODE:-splice}
case $mode in
    splice) path_arg=() ;;
    intercept) path_arg=(--request /ok)
        [ -z "${POST:-}" ] || path_arg=(--request /post --body "$POST")
        [ "${CLIENT_H2:-0}" = 0 ] || path_arg+=(--h2) ;;
    *) eb_die "MODE is splice or intercept" ;;
esac
hard=$(ulimit -Hn)
[ "$hard" = unlimited ] && hard=1048576
fit=$(((hard - 256) / 2))
gw_max=10000 # half of limits.max_connections in gateway-column.sh (20,000): one client address's share
[ "$fit" -gt "$gw_max" ] && fit=$gw_max
if [ -n "${CONNS:-}" ]; then
    n=$CONNS
    [ "$n" -le "$fit" ] || eb_die "$n connections need $((2 * n + 256)) descriptors in the gateway" \
        "(hard limit $hard) and one source's share of max_connections >= $n (gateway-column.sh: $gw_max): at most $fit here"
elif [ "$mode" = splice ]; then
    n=9000
else
    n=50000
    if [ "$n" -gt "$fit" ]; then
        eb_log "50,000 connections need $((2 * n + 256)) descriptors in the gateway; the hard limit is $hard: measuring $fit"
        n=$fit
    fi
fi
holders=${HOLDERS:-$(((n + 14999) / 15000))}
[ "$holders" -ge 2 ] || holders=2
per=$(((n + holders - 1) / holders))
bin=${GW_BIN:-$root/target/release/egress-gateway}
[ -x "$bin" ] || cargo build --release -p egress-gateway --manifest-path "$root/Cargo.toml"
mkdir -p "$EB_STATE"
exec 9>"$EB_STATE/lock"
flock -n 9 || eb_die "a benches/peers run holds $EB_STATE/lock"
topo=$root/benches/peers/topo.sh
pids=()
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    "$root/benches/peers/peers.sh" stop gateway >/dev/null 2>&1 || true
    "$topo" down >/dev/null 2>&1 || true
    exit "$rc"
}
trap cleanup EXIT
eb_topology_fresh
if [ "$n" -gt 25000 ]; then
    for ns in "$NS_CL" "$NS_GW"; do
        ip netns exec "$ns" sysctl -qw net.ipv4.ip_local_port_range="1024 65535"
        ip netns exec "$ns" sysctl -qw net.ipv4.ip_local_reserved_ports="8000-8999,15000-15010"
    done
fi
MODE=$mode GW_BIN=$bin "$root/benches/peers/peers.sh" start gateway
# shellcheck disable=SC2046
"$topo" mode $("$root/benches/peers/peers.sh" ports gateway)
pid=$(cat "$EB_RUN/gateway/gateway.pid")
status() { awk -v k="$1:" '$1 == k {print $2}' "/proc/$pid/status"; }
cafile=$ORIGIN_CA_CRT
[ "$mode" = intercept ] && cafile=$EB_RUN/gateway/ca/ca.crt
before=$(status VmRSS)
started=$(date +%s%N)
left=$n
for i in $(seq "$holders"); do
    k=$per
    [ "$k" -le "$left" ] || k=$left
    left=$((left - k))
    [ "$k" -gt 0 ] || continue
    out=$EB_RUN/idle-hold.$i.out
    : > "$out"
    # eb_in's command line, not the function: `ip netns exec` and sh exec
    # into Python, so $! is the holder itself (a backgrounded function would
    # be a subshell, and killing it would leave the holder running).
    ip netns exec "$NS_CL" sh -c "$EB_NAMES_THEN_EXEC" sh "$HOSTS_FILE" "$RESOLV_FILE" \
        "$EB_PYTHON" "$root/benches/idle-hold.py" --ip "$ORIGIN_IP" --host "$ORIGIN_HOST" \
        --cafile "$cafile" --n "$k" --hold 900 "${path_arg[@]}" > "$out" 2>&1 9>&- &
    pids+=($!)
done
outs=("$EB_RUN"/idle-hold.*.out)
for _ in $(seq 1300); do
    ready=0
    for o in "${outs[@]}"; do grep -q '^held' "$o" && ready=$((ready + 1)); done
    [ "$ready" = "${#pids[@]}" ] && break
    alive=0
    for p in "${pids[@]}"; do [ -d "/proc/$p" ] && alive=$((alive + 1)); done
    [ "$alive" = "${#pids[@]}" ] || break
    sleep 0.25
done
[ "$ready" = "${#pids[@]}" ] || eb_die "the clients did not open $n connections: $(tail -qn2 "${outs[@]}")"
opened_ms=$((($(date +%s%N) - started) / 1000000))
sleep 3
after=$(status VmRSS)
hwm=$(status VmHWM)
thp=$(status THP_enabled)
huge=$(awk '$1 == "AnonHugePages:" {print $2}' "/proc/$pid/smaps_rollup" 2>/dev/null || echo 0)
count() { ip netns exec "$NS_GW" ss -Htn state established "$1" | wc -l; }
client_side=$(count "( sport = :$GATEWAY_PORT )")
upstream_side=$(count "( dport = :443 )")
if [ -n "${INSPECT:-}" ]; then bash -c "$INSPECT" inspect "$pid" >&2 || true; fi
for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
pids=()
sleep 5
closed=$(status VmRSS)
left_open=$(count "( sport = :$GATEWAY_PORT )")
printf '{"mode": "%s", "connections": %d, "open_seconds": %d.%03d, "gateway_client_sockets": %d, "gateway_upstream_sockets": %d, "rss_before_kib": %d, "rss_with_idle_kib": %d, "vmhwm_kib": %d, "rss_after_close_kib": %d, "client_sockets_after_close": %d, "thp_enabled": %d, "anon_huge_pages_kib": %d, "bytes_per_idle_connection": %d}\n' \
    "$mode" "$n" $((opened_ms / 1000)) $((opened_ms % 1000)) "$client_side" "$upstream_side" "$before" "$after" "$hwm" "$closed" "$left_open" \
    "${thp:-1}" "${huge:-0}" $(((after - before) * 1024 / n))
