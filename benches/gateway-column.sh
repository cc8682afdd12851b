#!/usr/bin/env bash
# Runs this gateway as the `gateway` column of benches/peers (see
# benches/peers/README.md).  benches/peers/peers.sh starts it inside the
# column namespace (eb-gw) with EB_LISTEN_PORT (where the redirect sends the
# client's :443 and :80) and EB_UPSTREAM_CA (the test origins' CA) exported.
#   $1 = state directory prepared by peers.sh: ca/ (the interception CA) and
#        sandbox.json (the client's sandbox as the controller would push it)
#   $2 = the gateway binary
# The gateway starts with no sandboxes; once it is ready the sandbox is
# pushed over the control API, then $1/ready is written.  The gateway's pid
# is in $1/gateway.pid.  Knobs: GW_WORKERS (limits.worker_threads, default 1:
# one event loop, as Squid and mitmproxy run), GW_FLOW_LOG (off, the default;
# "file" = $1/flows.jsonl; or any value log.flow_log takes), GW_ADMIN_PORT
# (15000), GW_MAX_HEAD (limits.max_request_head), GW_KERNEL_SPLICE
# (splice.kernel: off, the default, on, or pipe), GW_PER_CORE (limits.thread_per_core:
# false, the default, or true), GW_AES_GCM (tls.aes_gcm: auto, the default,
# aws-lc-rs or ring).
set -euo pipefail
state=$1
bin=$2
flow_log=${GW_FLOW_LOG:-off}
[ "$flow_log" = file ] && flow_log=$state/flows.jsonl
cat > "$state/gateway.toml" <<EOF
state_dir = "$state"
[listen]
transparent = "0.0.0.0:${EB_LISTEN_PORT:?}"
dns = "127.0.0.1:0"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:${GW_ADMIN_PORT:-15000}"
[dns]
# No upstream: the harness sends no DNS through the gateway, and none may leave.
upstreams = []
[tls]
extra_upstream_roots = ["${EB_UPSTREAM_CA:?}"]
aes_gcm = "${GW_AES_GCM:-auto}"
[limits]
max_connections = 20000
worker_threads = ${GW_WORKERS:-1}
$([ "${GW_PER_CORE:-false}" = true ] && echo "thread_per_core = true")
max_request_head = ${GW_MAX_HEAD:-65536}
[log]
flow_log = "$flow_log"
[splice]
kernel = "${GW_KERNEL_SPLICE:-off}"
EOF
export RUST_LOG=${RUST_LOG:-warn}
# Two descriptors per spliced flow: room for benches/idle-rss.sh.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
admin=http://127.0.0.1:${GW_ADMIN_PORT:-15000}
rm -f "$state/ready"
"$bin" run --config "$state/gateway.toml" &
gw=$!
echo "$gw" > "$state/gateway.pid"
trap 'kill -TERM "$gw" 2>/dev/null || true; wait "$gw" || true; exit 0' TERM INT
for _ in $(seq 100); do
    curl -sf --max-time 1 "$admin/readyz" >/dev/null 2>&1 && break
    sleep 0.1
done
if ! curl -sf --max-time 5 -X PUT --data-binary @"$state/sandbox.json" "$admin/v1/sandboxes/eb-client" >/dev/null; then
    echo "gateway-column: the policy push failed" >&2
    kill -TERM "$gw"
    exit 1
fi
# GW_SHADOW: a file with {"policy": ..}, set as the sandbox's shadow.
if [ -n "${GW_SHADOW:-}" ] &&
    ! curl -sf --max-time 5 -X PUT --data-binary @"$GW_SHADOW" "$admin/v1/sandboxes/eb-client/shadow" >/dev/null; then
    echo "gateway-column: the shadow put failed" >&2
    kill -TERM "$gw"
    exit 1
fi
touch "$state/ready"
wait "$gw"
