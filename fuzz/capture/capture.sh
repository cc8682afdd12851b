#!/usr/bin/env bash
# Captures the ClientHellos of the TLS clients installed here into
# gateway/src/peek/captured/<client>.bin (run from the repository root, as
# root: it re-runs itself inside a throwaway network namespace that has only
# loopback, so a client that phones home — a browser — reaches nothing).
# Loopback only: every client connects to 127.0.0.1 and is told the name
# captured.example.test without resolving it (curl --resolve, -servername,
# server_hostname, SNIHostName); never point one at a name it would resolve.
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${CAPTURE_NS:-}" ]; then
  ns=capture-$$
  ip netns add "$ns" && ip -n "$ns" link set lo up || exit 1
  trap 'ip netns del "$ns"' EXIT
  CAPTURE_NS=$ns ip netns exec "$ns" bash "$0" "$@"
  exit $?
fi
out=${CAPTURE_OUT:-gateway/src/peek/captured}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
here=fuzz/capture

# capture NAME COMMAND...: COMMAND with PORT replaced by the listener's port.
capture() {
  local name=$1; shift
  local pf="$tmp/$name.port"
  python3 "$here/listen.py" "$out/$name.bin" "$pf" &
  local lp=$!
  while [ ! -s "$pf" ]; do sleep 0.05; done
  local port; port=$(cat "$pf")
  local cmd="${*//PORT/$port}"
  timeout 60 bash -c "$cmd" </dev/null >/dev/null 2>&1
  wait "$lp" || echo "!! $name: no ClientHello captured"
}

name=captured.example.test
if command -v curl >/dev/null; then
  capture curl "curl -sS https://$name:PORT/ --resolve $name:PORT:127.0.0.1 -k"
  capture curl-tls12 "curl -sS --tls-max 1.2 --http1.1 https://$name:PORT/ --resolve $name:PORT:127.0.0.1 -k"
fi
if command -v openssl >/dev/null; then
  capture openssl "openssl s_client -connect 127.0.0.1:PORT -servername $name"
  capture openssl-tls12 "openssl s_client -tls1_2 -connect 127.0.0.1:PORT -servername $name"
  # A hello over three records: 512-byte fragments and a long ALPN list.
  alpn=$(python3 -c "print(','.join('proto-%02d-padding-padding-padding' % i for i in range(30)))")
  capture openssl-frag "openssl s_client -connect 127.0.0.1:PORT -servername $name -max_send_frag 512 -alpn $alpn"
fi
capture python "python3 $here/python_client.py PORT $name"
if command -v node >/dev/null; then
  capture node "node $here/node_client.js PORT $name"
fi
if command -v java >/dev/null; then
  capture java "java $here/JavaClient.java PORT $name"
fi
if command -v go >/dev/null; then
  capture go "GOCACHE=$tmp/gocache GOPATH=$tmp/gopath GOFLAGS=-mod=mod GOPROXY=off go run $here/go_client.go PORT $name"
fi
if [ -x /usr/bin/chromium ]; then
  # The name maps to loopback inside Chromium: no lookup; the namespace has
  # no route anywhere else.
  capture chromium "chromium --headless=new --no-sandbox --disable-gpu --no-first-run --user-data-dir=$tmp/chromium --host-resolver-rules='MAP $name 127.0.0.1' https://$name:PORT/"
fi
ls -l "$out"
