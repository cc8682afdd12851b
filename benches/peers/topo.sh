#!/usr/bin/env bash
# The namespace topology of benches/peers.
#
#   eb-cl (client)           eb-gw (column under test)          eb-or (origin)
#   cl0 100.64.17.1/30 ──── gwc0 100.64.17.2/30
#                           gwo0 100.64.17.5/30 ─────────────── or0 100.64.17.6/30
#                                                               lo  203.0.113.10/32
#   route 203.0.113.0/24    route 203.0.113.0/24 via .6         route 100.64.17.0/29 via .5
#     via .2
#
#   topo.sh up              namespaces, guards, test PKI, origin nginx (mode off);
#                           ORIGIN_H2=0: the origin's :443 speaks HTTP/1.1 only
#   topo.sh down            stop every process in the three namespaces (by pid), delete them
#   topo.sh mode direct     kernel forwarding, client → origin tcp 80/443 only
#   topo.sh mode PORT [HTTP_PORT]
#                           redirect client tcp 443 (and 80) to PORT (HTTP_PORT) in eb-gw,
#                           forwarding off
#   topo.sh mode off        neither: everything from the client stops at eb-gw
#   topo.sh counters        "<new client conns to :443 since the last mode switch> <SYNs at the origin's :443>"
#   topo.sh status          processes, listeners, guard counters, the gateway table
#
# Safety: the veths are created inside the namespaces (nothing in the host's);
# no default route anywhere; every namespace has an output guard (policy
# drop) letting out only loopback, 100.64.0.0/10 and 203.0.113.0/24; IPv6 is
# off; the forward chain of eb-gw has policy drop in every mode.
set -euo pipefail
# shellcheck source=benches/peers/lib.sh
. "$(dirname "$0")/lib.sh"

guard() {
    cat <<EOF
table inet ebguard {
    chain out {
        type filter hook output priority filter; policy drop;
        oifname "lo" accept
        ip daddr { 100.64.0.0/10, $ORIGIN_NET } accept
        counter comment "blocked egress"
    }
}
EOF
}

make_pki() {
    mkdir -p "$EB_PKI"
    [ -s "$ORIGIN_CRT" ] && [ -s "$PROXY_CA_KEY" ] && return 0
    eb_log "test PKI ($EB_KEY_ALG) in $EB_PKI"
    local key
    case $EB_KEY_ALG in
        rsa) key=(-newkey rsa:2048) ;;
        ec) key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1) ;;
        *) eb_die "EB_KEY_ALG is rsa or ec" ;;
    esac
    local ca_ext=(-addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign")
    (
        cd "$EB_PKI"
        openssl req -x509 "${key[@]}" -nodes -days 825 -keyout origin-ca.key -out origin-ca.crt \
            -subj "/O=egress-peers/CN=$ORIGIN_CA_CN" "${ca_ext[@]}" 2>/dev/null
        openssl req -x509 "${key[@]}" -nodes -days 825 -keyout proxy-ca.key -out proxy-ca.crt \
            -subj "/O=egress-peers/CN=$PROXY_CA_CN" "${ca_ext[@]}" 2>/dev/null
        printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
            "extendedKeyUsage=serverAuth" "subjectAltName=DNS:$ORIGIN_HOST,IP:$ORIGIN_IP" > origin.ext
        openssl req "${key[@]}" -nodes -keyout origin.key -out origin.csr -subj "/O=egress-peers/CN=$ORIGIN_HOST" 2>/dev/null
        openssl x509 -req -in origin.csr -CA origin-ca.crt -CAkey origin-ca.key -CAcreateserial \
            -days 365 -extfile origin.ext -out origin.crt 2>/dev/null
        openssl verify -CAfile origin-ca.crt origin.crt >/dev/null
        chmod 644 ./*.crt
        chmod 640 ./*.key
        # Squid drops to the proxy user and reads the interception CA key.
        if getent group proxy >/dev/null; then chgrp proxy proxy-ca.key; fi
    )
}

make_www() {
    mkdir -p "$EB_WWW"
    if [ ! -s "$EB_WWW/1m" ]; then
        head -c 1024 /dev/urandom > "$EB_WWW/1k"
        head -c 1048576 /dev/urandom > "$EB_WWW/1m"
        echo ok > "$EB_WWW/ok"
    fi
    chmod 755 "$EB_STATE" "$EB_WWW" "$EB_PKI"
    chmod 644 "$EB_WWW"/*
}

# Names for every client and peer: the origin, and the link addresses (Squid
# looks up the client's address for every connection; answered here, it
# sends no DNS at all).  resolv.conf points at loopback, where nothing
# answers: no name ever leaves the namespaces.
make_names() {
    mkdir -p "$EB_RUN"
    chmod 755 "$EB_RUN"
    printf '%s\n' "127.0.0.1 localhost" "$ORIGIN_IP $ORIGIN_HOST" "$CL_IP cl.eb.test" \
        "$GW_CL_IP gwc.eb.test" "$GW_OR_IP gwo.eb.test" "$OR_IP or.eb.test" > "$HOSTS_FILE"
    printf '%s\n' "nameserver 127.0.0.1" "options timeout:1 attempts:1" > "$RESOLV_FILE"
    chmod 644 "$HOSTS_FILE" "$RESOLV_FILE"
}

start_origin() {
    local d=$EB_RUN/nginx h2=" http2"
    [ "${ORIGIN_H2:-1}" = 0 ] && h2=""
    mkdir -p "$d"
    cat > "$d/nginx.conf" <<EOF
worker_processes ${EB_ORIGIN_WORKERS:-auto};
daemon off;
master_process on;
pid $d/nginx.pid;
error_log $d/error.log warn;
events { worker_connections 16384; }
http {
    access_log off;
    types { }
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_requests 100000000;
    keepalive_timeout 120s;
    http2_max_concurrent_streams 256;
    client_body_temp_path $d/body;
    proxy_temp_path $d/proxy;
    fastcgi_temp_path $d/fastcgi;
    uwsgi_temp_path $d/uwsgi;
    scgi_temp_path $d/scgi;
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache shared:eb:16m;
    ssl_session_tickets on;
    server {
        listen $ORIGIN_IP:443 ssl$h2 reuseport backlog=4096;
        listen $ORIGIN_IP:80 reuseport backlog=4096;
        server_name $ORIGIN_HOST;
        ssl_certificate $ORIGIN_CRT;
        ssl_certificate_key $ORIGIN_KEY;
        root $EB_WWW;
        location / { }
        location = /post { return 200 "ok\n"; }
    }
}
EOF
    eb_spawn origin-nginx "$NS_OR" nginx -e "$d/error.log" -c "$d/nginx.conf"
    eb_wait_listen "$NS_OR" 443 || { cat "$EB_RUN/origin-nginx.log" "$d/error.log" >&2 || true; eb_die "nginx did not start"; }
}

gw_table() {
    ip netns exec "$NS_GW" nft -f - <<EOF
table ip ebgw {
    chain prerouting {
        type nat hook prerouting priority dstnat; policy accept;
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
    }
}
EOF
}

mode() {
    local m=${1:?mode direct|off|PORT [HTTP_PORT]} hp=${2:-${1:-}} rules
    local count="add rule ip ebgw prerouting iifname \"gwc0\" tcp dport 443 ct state new counter comment \"cl443\""
    case $m in
        direct)
            rules="$count
add rule ip ebgw forward iifname \"gwc0\" oifname \"gwo0\" ip saddr $CL_IP ip daddr $ORIGIN_NET tcp dport { 80, 443 } accept
add rule ip ebgw forward iifname \"gwo0\" oifname \"gwc0\" ip saddr $ORIGIN_NET ip daddr $CL_IP ct state established accept" ;;
        off) rules=$count ;;
        *[!0-9]*|"") eb_die "mode: direct, off or PORT [HTTP_PORT]" ;;
        *)
            rules="$count
add rule ip ebgw prerouting iifname \"gwc0\" ip daddr $ORIGIN_NET tcp dport 443 redirect to :$m
add rule ip ebgw prerouting iifname \"gwc0\" ip daddr $ORIGIN_NET tcp dport 80 redirect to :$hp" ;;
    esac
    # Off first, so no packet is forwarded while the rules change.
    ip netns exec "$NS_GW" sysctl -qw net.ipv4.ip_forward=0
    ip netns exec "$NS_GW" nft -f - <<EOF
flush chain ip ebgw prerouting
flush chain ip ebgw forward
$rules
EOF
    # A new SYN reusing the 4-tuple of a connection still tracked from the
    # previous mode would keep that mode's NAT decision (and stall for a
    # SYN retransmit): forget every tracked connection at each switch.
    ip netns exec "$NS_GW" conntrack -F >/dev/null 2>&1 || true
    [ "$m" = direct ] && ip netns exec "$NS_GW" sysctl -qw net.ipv4.ip_forward=1
    echo "$m" > "$EB_RUN/mode"
}

counter_of() { # NS FAMILY TABLE CHAIN COMMENT
    ip netns exec "$1" nft list chain "$2" "$3" "$4" 2>/dev/null \
        | awk -v c="\"$5\"" '$0 ~ c { for (i = 1; i < NF; i++) if ($i == "packets") { print $(i + 1); exit } }'
}

counters() {
    local a b
    a=$(counter_of "$NS_GW" ip ebgw prerouting cl443)
    b=$(counter_of "$NS_OR" inet eborigin in syn443)
    echo "${a:-0} ${b:-0}"
}

up() {
    eb_need_root
    if eb_ns_exists "$NS_GW"; then eb_log "topology already up"; return 0; fi
    mkdir -p "$EB_STATE" "$EB_RUN"
    make_pki
    make_www
    make_names
    local ns
    for ns in "$NS_CL" "$NS_GW" "$NS_OR"; do
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 \
            net.ipv4.ip_forward=0 net.ipv4.ip_local_port_range="1024 65000" net.ipv4.tcp_tw_reuse=1 \
            net.core.somaxconn=4096
        guard | ip netns exec "$ns" nft -f -
    done
    ip link add cl0 netns "$NS_CL" type veth peer name gwc0 netns "$NS_GW"
    ip link add gwo0 netns "$NS_GW" type veth peer name or0 netns "$NS_OR"
    ip -n "$NS_CL" addr add "$CL_IP/30" dev cl0
    ip -n "$NS_GW" addr add "$GW_CL_IP/30" dev gwc0
    ip -n "$NS_GW" addr add "$GW_OR_IP/30" dev gwo0
    ip -n "$NS_OR" addr add "$OR_IP/30" dev or0
    ip -n "$NS_OR" addr add "$ORIGIN_IP/32" dev lo
    ip -n "$NS_CL" link set cl0 up
    ip -n "$NS_GW" link set gwc0 up
    ip -n "$NS_GW" link set gwo0 up
    ip -n "$NS_OR" link set or0 up
    ip -n "$NS_CL" route add "$ORIGIN_NET" via "$GW_CL_IP"
    ip -n "$NS_GW" route add "$ORIGIN_NET" via "$OR_IP"
    ip -n "$NS_OR" route add "$LINK_NET" via "$GW_OR_IP"
    # SYNs arriving at the origin's :443: upstream connections opened.
    ip netns exec "$NS_OR" nft -f - <<EOF
table inet eborigin {
    chain in {
        type filter hook input priority filter; policy accept;
        tcp dport 443 tcp flags & (syn | ack) == syn counter comment "syn443"
    }
}
EOF
    gw_table
    mode off
    start_origin
    eb_log "topology up: $NS_CL → $NS_GW → $NS_OR ($ORIGIN_HOST = $ORIGIN_IP)"
}

down() {
    eb_need_root
    local ns pid any=0
    for ns in "$NS_CL" "$NS_GW" "$NS_OR"; do
        eb_ns_exists "$ns" || continue
        any=1
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -TERM "$pid" 2>/dev/null || true; done
    done
    [ "$any" = 1 ] || return 0
    for _ in $(seq 30); do
        local left=0
        for ns in "$NS_CL" "$NS_GW" "$NS_OR"; do
            eb_ns_exists "$ns" && [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] && left=1
        done
        [ "$left" = 0 ] && break
        sleep 0.1
    done
    for ns in "$NS_CL" "$NS_GW" "$NS_OR"; do
        eb_ns_exists "$ns" || continue
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    done
    sleep 0.2
    for ns in "$NS_CL" "$NS_GW" "$NS_OR"; do
        eb_ns_exists "$ns" && ip netns del "$ns"
    done
    rm -f "$EB_RUN"/*.pid "$EB_RUN/mode"
    eb_log "topology down"
}

status() {
    local ns
    for ns in "$NS_CL" "$NS_GW" "$NS_OR"; do
        eb_ns_exists "$ns" || { echo "$ns: absent"; continue; }
        echo "== $ns: pids $(ip netns pids "$ns" | xargs)"
        ip netns exec "$ns" ss -Hltn | awk '{print "   listens " $4}'
        echo "   blocked egress packets: $(counter_of "$ns" inet ebguard out "blocked egress")"
    done
    eb_ns_exists "$NS_GW" && { echo "mode: $(cat "$EB_RUN/mode" 2>/dev/null)"; ip netns exec "$NS_GW" nft list table ip ebgw; }
    return 0
}

case ${1:-} in
    up) up ;;
    down) down ;;
    mode) shift; mode "$@" ;;
    counters) counters ;;
    status) status ;;
    *) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
