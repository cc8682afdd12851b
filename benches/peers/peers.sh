#!/usr/bin/env bash
# The columns of benches/peers: start and stop them in eb-gw, and say where
# each listens and which certificate issuer the client must see through it.
#
#   peers.sh start COLUMN       mitmproxy | squid-bump | squid-splice | gateway | gateway-ro |
#                               gateway-log | gateway-kernel | gateway-2 | gateway-pc | gateway-pc1 | gateway-shadow |
#                               gateway-base | gateway-pipe (direct: nothing to start)
#   peers.sh stop COLUMN
#   peers.sh ports COLUMN       "direct" or "TLS_PORT HTTP_PORT" (arguments of topo.sh mode)
#   peers.sh issuer COLUMN      issuer CN the client sees through the column
#   peers.sh pid COLUMN         pid whose process tree is the column's CPU
#
# The gateway column: MODE=intercept (default) or splice, GW_BIN (default
# target/release/egress-gateway), and the knobs of ../gateway-column.sh
# (GW_WORKERS, GW_FLOW_LOG, ...).  Two variants run beside it as columns of
# their own, on their own ports: gateway-ro (the origin's name under a
# read_only per-request rule, judged on every request), gateway-log (the
# flow log on, to a file), gateway-kernel (splice.kernel = on, the
# experimental kernel splice: spliced flows moved by the kernel),
# gateway-pipe (splice.kernel = pipe: splice(2) through a pipe), gateway-2
# (two worker threads on one work-stealing runtime) and gateway-pc (two
# worker threads, one runtime and one set of SO_REUSEPORT listeners each:
# limits.thread_per_core; gateway-pc1 the same with one thread); gateway-base is the plain column run from another
# binary, GW_BASE_BIN (an A/B of two builds in one interleaved session), with tls.aes_gcm GW_BASE_AES_GCM (default:
# GW_AES_GCM, itself auto by default), so one binary can be its own base with another AEAD library.  MITM_EXTRA_ARGS is appended to mitmdump's
# command line; SQUID_ACCESS_LOG=1 turns Squid's access log on (off, like
# mitmdump -q and the gateway's flow log, by default).
set -euo pipefail
# shellcheck source=benches/peers/lib.sh
. "$(dirname "$0")/lib.sh"

MODE=${MODE:-intercept}
GW_BIN=${GW_BIN:-$EB_ROOT/target/release/egress-gateway}
SQUID_CERTGEN=${SQUID_CERTGEN:-/usr/lib/squid/security_file_certgen}

start_mitmproxy() {
    local conf=$EB_RUN/mitmproxy
    command -v mitmdump >/dev/null || eb_die "mitmdump missing: run benches/peers/setup.sh"
    eb_stop peer-mitmproxy
    rm -rf "$conf"
    mkdir -p "$conf"
    # mitmproxy reads its CA as key + certificate in one PEM from confdir.
    cat "$PROXY_CA_KEY" "$PROXY_CA_CRT" > "$conf/mitmproxy-ca.pem"
    cp "$PROXY_CA_CRT" "$conf/mitmproxy-ca-cert.pem"
    chmod 600 "$conf/mitmproxy-ca.pem"
    # Transparent: the original destination from SO_ORIGINAL_DST (the redirect
    # is in this namespace), so it resolves no name; the upstream certificate
    # is verified against the origin CA; -q: no per-flow log.
    # shellcheck disable=SC2086
    HOME=$conf eb_spawn peer-mitmproxy "$NS_GW" mitmdump --mode transparent \
        --listen-host 0.0.0.0 --listen-port "$MITM_PORT" \
        --set confdir="$conf" --set ssl_verify_upstream_trusted_ca="$ORIGIN_CA_CRT" \
        -q ${MITM_EXTRA_ARGS:-}
    eb_wait_listen "$NS_GW" "$MITM_PORT" 300 || { tail -20 "$EB_RUN/peer-mitmproxy.log" >&2; eb_die "mitmdump did not listen"; }
}

start_squid() {
    local kind=$1 port hport action dir
    case $kind in
        bump) port=$SQUID_BUMP_PORT hport=$SQUID_BUMP_HTTP_PORT action=bump ;;
        splice) port=$SQUID_SPLICE_PORT hport=$SQUID_SPLICE_HTTP_PORT action=splice ;;
    esac
    command -v squid >/dev/null || eb_die "squid missing: run benches/peers/setup.sh"
    dir=$EB_RUN/squid-$kind
    eb_stop "peer-squid-$kind"
    rm -rf "$dir"
    mkdir -p "$dir"
    "$SQUID_CERTGEN" -c -s "$dir/certs" -M 16MB >/dev/null
    local log="access_log none"
    [ "${SQUID_ACCESS_LOG:-0}" = 1 ] && log="access_log stdio:$dir/access.log"
    cat > "$dir/squid.conf" <<EOF
# benches/peers: Squid $kind (intercepting; peek at the ClientHello, then $action)
workers 1
cache_effective_user proxy
visible_hostname eb-squid-$kind
pid_filename $dir/squid.pid
cache_log $dir/cache.log
$log
logfile_rotate 0
coredump_dir $dir
netdb_filename none
pinger_enable off
shutdown_lifetime 1 seconds
cache deny all
cache_mem 8 MB
# Names stay inside: the harness's hosts file (it also answers Squid's
# per-connection lookup of the client address), and a resolver on loopback
# where nothing listens.
hosts_file $HOSTS_FILE
dns_nameservers 127.0.0.1
acl clients src 100.64.0.0/10
http_access allow clients
http_access deny all
# Squid insists on a forward port; loopback only.
http_port 127.0.0.1:$((port + 1000))
http_port $hport intercept
https_port $port intercept ssl-bump tls-cert=$PROXY_CA_CRT tls-key=$PROXY_CA_KEY generate-host-certificates=on dynamic_cert_mem_cache_size=16MB
sslcrtd_program $SQUID_CERTGEN -s $dir/certs -M 16MB
sslcrtd_children 8 startup=2 idle=1
tls_outgoing_options cafile=$ORIGIN_CA_CRT
acl step1 at_step SslBump1
ssl_bump peek step1
ssl_bump $action all
EOF
    chown -R proxy:proxy "$dir"
    squid -k parse -f "$dir/squid.conf" >"$dir/parse.log" 2>&1 || { cat "$dir/parse.log" >&2; eb_die "squid.conf ($kind) does not parse"; }
    eb_spawn "peer-squid-$kind" "$NS_GW" squid -N -f "$dir/squid.conf" -n "ebsquid$kind"
    eb_wait_listen "$NS_GW" "$port" || { tail -20 "$dir/cache.log" >&2; eb_die "squid ($kind) did not listen"; }
}

# The gateway columns: port, admin port, and what differs.
gw_port() {
    case $1 in
        gateway) echo "$GATEWAY_PORT" ;;
        gateway-ro) echo $((GATEWAY_PORT + 1)) ;;
        gateway-log) echo $((GATEWAY_PORT + 2)) ;;
        gateway-kernel) echo $((GATEWAY_PORT + 3)) ;;
        gateway-2) echo $((GATEWAY_PORT + 4)) ;;
        gateway-pc) echo $((GATEWAY_PORT + 5)) ;;
        gateway-base) echo $((GATEWAY_PORT + 6)) ;;
        gateway-pipe) echo $((GATEWAY_PORT + 7)) ;;
        gateway-shadow) echo $((GATEWAY_PORT + 8)) ;;
        gateway-pc1) echo $((GATEWAY_PORT + 9)) ;;
    esac
}

start_gateway() {
    local col=$1 state=$EB_RUN/$1 policy flow_log=${GW_FLOW_LOG:-off} kernel=${GW_KERNEL_SPLICE:-off}
    local workers=${GW_WORKERS:-1} per_core=${GW_PER_CORE:-false} shadow=
    local bin=$GW_BIN aes_gcm=${GW_AES_GCM:-auto}
    [ "$col" = gateway-base ] && bin=${GW_BASE_BIN:?gateway-base runs GW_BASE_BIN, another gateway binary}
    [ "$col" = gateway-base ] && aes_gcm=${GW_BASE_AES_GCM:-$aes_gcm}
    [ -x "$bin" ] || eb_die "no gateway binary at $bin (cargo build --release -p egress-gateway)"
    eb_stop "peer-$col"
    rm -rf "$state"
    mkdir -p "$state"
    # An instrumented binary (benches/pgo-train.sh) counts the column, not this.
    env -u LLVM_PROFILE_FILE "$bin" ca init --dir "$state/ca" >/dev/null
    case $MODE in
        intercept) policy='{"default": "deny", "allow": [{"cidr": "203.0.113.0/24"}], "tls_interception": "on"}' ;;
        splice) policy='{"default": "deny", "allow": [{"cidr": "203.0.113.0/24"}], "tls_interception": "on", "tls_interception_exemptions": [{"cidr": "203.0.113.0/24"}]}' ;;
        *) eb_die "MODE is intercept or splice" ;;
    esac
    case $col in
        # The origin's name is read-only: its requests are intercepted (an
        # exemption would not splice them) and each is judged.
        gateway-ro) policy=${policy/'"allow": ['/'"allow": [{"domain": "'"$ORIGIN_HOST"'", "http": "read_only"}, '} ;;
        gateway-log) flow_log=file ;;
        # The kernel splice (experimental): spliced flows moved by the kernel.
        gateway-kernel) kernel=on ;;
        # splice(2) through a pipe per direction.
        gateway-pipe) kernel=pipe ;;
        # One thread or two: shared by a work-stealing runtime, or one per core.
        gateway-2) workers=2 ;;
        gateway-pc) workers=2 per_core=true ;;
        # One thread with a runtime of its own (limits.thread_per_core), against
        # the plain column's one worker of the work-stealing runtime.
        gateway-pc1) workers=1 per_core=true ;;
        # The same policy, with a shadow beside it: every flow and request
        # judged again under a candidate whose origin name is read-only.
        gateway-shadow) shadow=$state/shadow.json ;;
    esac
    if [ -n "$shadow" ]; then
        printf '{"policy": %s}\n' "${policy/'"allow": ['/'"allow": [{"domain": "'"$ORIGIN_HOST"'", "http": "read_only"}, '}" > "$shadow"
    fi
    # The client's sandbox, as the controller pushes it.
    printf '{"addresses": ["%s"], "policy": %s}\n' "$CL_IP" "$policy" > "$state/sandbox.json"
    local port admin
    port=$(gw_port "$col")
    admin=$((GW_ADMIN_PORT + port - GATEWAY_PORT))
    EB_LISTEN_PORT=$port EB_UPSTREAM_CA=$ORIGIN_CA_CRT GW_ADMIN_PORT=$admin GW_FLOW_LOG=$flow_log GW_KERNEL_SPLICE=$kernel \
        GW_WORKERS=$workers GW_PER_CORE=$per_core GW_SHADOW=$shadow GW_AES_GCM=$aes_gcm \
        eb_spawn "peer-$col" "$NS_GW" "$EB_ROOT/benches/gateway-column.sh" "$state" "$bin"
    for _ in $(seq 200); do
        [ -e "$state/ready" ] && break
        [ -d "/proc/$(eb_pid_of "peer-$col")" ] || break
        sleep 0.1
    done
    [ -e "$state/ready" ] || { tail -20 "$EB_RUN/peer-$col.log" >&2; eb_die "$col did not become ready"; }
    eb_wait_listen "$NS_GW" "$port" || eb_die "$col does not listen on $port"
}

ports() {
    case $1 in
        direct) echo direct ;;
        mitmproxy) echo "$MITM_PORT $MITM_PORT" ;;
        squid-bump) echo "$SQUID_BUMP_PORT $SQUID_BUMP_HTTP_PORT" ;;
        squid-splice) echo "$SQUID_SPLICE_PORT $SQUID_SPLICE_HTTP_PORT" ;;
        gateway|gateway-ro|gateway-log|gateway-kernel|gateway-2|gateway-pc|gateway-pc1|gateway-base|gateway-pipe|gateway-shadow) echo "$(gw_port "$1") $(gw_port "$1")" ;;
        *) eb_die "unknown column $1" ;;
    esac
}

issuer() {
    case $1 in
        direct|squid-splice) echo "$ORIGIN_CA_CN" ;;
        mitmproxy|squid-bump) echo "$PROXY_CA_CN" ;;
        gateway-ro)
            # Never spliced: its requests are judged.
            openssl x509 -in "$EB_RUN/$1/ca/ca.crt" -noout -subject -nameopt multiline \
                | awk -F' = ' '/commonName/ {print $2; exit}' ;;
        gateway|gateway-log|gateway-kernel|gateway-2|gateway-pc|gateway-pc1|gateway-base|gateway-pipe|gateway-shadow)
            if [ "$MODE" = splice ]; then echo "$ORIGIN_CA_CN"; else
                openssl x509 -in "$EB_RUN/$1/ca/ca.crt" -noout -subject -nameopt multiline \
                    | awk -F' = ' '/commonName/ {print $2; exit}'
            fi ;;
        *) eb_die "unknown column $1" ;;
    esac
}

case ${1:-}:${2:-} in
    start:direct|stop:direct) ;;
    start:mitmproxy) start_mitmproxy ;;
    start:squid-bump) start_squid bump ;;
    start:squid-splice) start_squid splice ;;
    start:gateway|start:gateway-ro|start:gateway-log|start:gateway-kernel|start:gateway-2|start:gateway-pc|start:gateway-pc1|start:gateway-base|start:gateway-pipe|start:gateway-shadow) start_gateway "$2" ;;
    stop:mitmproxy|stop:squid-bump|stop:squid-splice|stop:gateway*) eb_stop "peer-$2" ;;
    ports:?*) ports "$2" ;;
    issuer:?*) issuer "$2" ;;
    pid:direct) ;;
    pid:?*) eb_pid_of "peer-$2" ;;
    *) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
