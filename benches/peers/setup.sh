#!/usr/bin/env bash
# Installs what benches/peers needs from Debian 12 (root; idempotent: only
# missing packages are installed, and running it again does nothing else).
#
#   benches/peers/setup.sh
#
# squid-openssl (SslBump), nginx (the origin), wrk, mitmproxy (Debian's, for
# mitmdump; no pip, no venv), nghttp2-client (h2load), openssl, python3,
# gcc + libssl-dev (the TLS connection-rate client, tlsconn.c, is compiled by
# run.sh), conntrack, iproute2, nftables, curl (the gateway's control API).
# The packages' services are not left running: where systemd runs, the units
# the packages enable are stopped and disabled again.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "setup.sh: run as root" >&2; exit 1; }
pkgs=(squid-openssl nginx wrk mitmproxy nghttp2-client openssl python3 gcc libc6-dev libssl-dev
      conntrack iproute2 nftables curl procps util-linux coreutils)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup.sh: installing ${missing[*]}" >&2
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi
if [ -d /run/systemd/system ]; then
    systemctl disable --now squid nginx >/dev/null 2>&1 || true
fi
for t in squid mitmdump h2load wrk nginx openssl gcc conntrack nft; do
    command -v "$t" >/dev/null || { echo "setup.sh: $t still missing" >&2; exit 1; }
done
echo "setup.sh: ready ($(squid -v | head -1); mitmdump $(mitmdump --version 2>/dev/null | awk '/Mitmproxy/ {print $2}'); $(h2load --version 2>&1 | head -1))"
