#!/usr/bin/env bash
# Runs this gateway as the testbed's `gateway` column (see sidebyside.sh).
# Called by ../shared/testbed/peer_gateway.sh inside pb-gw, with PB_LISTEN_PORT
# and PB_UPSTREAM_CA exported.  $1 = state directory prepared by sidebyside.sh
# (the CA, and sandbox.json: the testbed client's sandbox as the controller
# would push it), $2 = the gateway binary.  The gateway starts with no
# sandboxes; the policy is pushed over the control API once it is ready.
set -euo pipefail
state=$1
bin=$2
cat > "$state/gateway.toml" <<EOF2
state_dir = "$state"
[listen]
transparent = "0.0.0.0:${PB_LISTEN_PORT:?}"
dns = "127.0.0.1:0"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:${GW_ADMIN_PORT:-15000}"
[tls]
extra_upstream_roots = ["${PB_UPSTREAM_CA:?}"]
[limits]
max_connections = 20000
# One event loop, as Squid and mitmproxy run (see benches/RESULTS.md).
worker_threads = ${GW_WORKERS:-1}
max_request_head = ${GW_MAX_HEAD:-65536}
[log]
flow_log = "off"
EOF2
export RUST_LOG=${RUST_LOG:-warn}
# Two descriptors per spliced flow: room for the idle-connection measurement.
ulimit -n 65536 2>/dev/null || true
admin=http://127.0.0.1:${GW_ADMIN_PORT:-15000}
"$bin" run --config "$state/gateway.toml" &
gw=$!
trap 'kill -TERM "$gw" 2>/dev/null || true; wait "$gw"; exit' TERM INT
for _ in $(seq 100); do
    curl -sf "$admin/readyz" >/dev/null 2>&1 && break
    sleep 0.1
done
curl -sf -X PUT --data-binary @"$state/sandbox.json" "$admin/v1/sandboxes/pb-client" >/dev/null \
    || { echo "gateway-column: the policy push failed" >&2; kill -TERM "$gw"; exit 1; }
wait "$gw"
