#!/usr/bin/env python3
"""Opens N TLS connections (full handshake, verified) to HOST:443 at IP and holds
them idle: the client side of benches/idle-rss.sh. Prints `held N` when all are
open, then sleeps HOLD seconds. Standard library only."""
import argparse
import resource
import socket
import ssl
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--ip", required=True)
ap.add_argument("--host", required=True)
ap.add_argument("--cafile", required=True)
ap.add_argument("--n", type=int, default=10000)
ap.add_argument("--hold", type=float, default=15)
a = ap.parse_args()
resource.setrlimit(resource.RLIMIT_NOFILE, (a.n + 1024, a.n + 1024))
ctx = ssl.create_default_context(cafile=a.cafile)
held = []
deadline = time.time() + 300
for i in range(a.n):
    if time.time() > deadline:
        sys.exit(f"only {len(held)} connections in 300 s")
    try:
        s = socket.create_connection((a.ip, 443), timeout=10)
        held.append(ctx.wrap_socket(s, server_hostname=a.host))
    except OSError as e:
        sys.exit(f"connection {len(held) + 1} failed: {e}")
print(f"held {len(held)}", flush=True)
time.sleep(a.hold)
