#!/usr/bin/env python3
"""think.py: C verified TLS connections to HOST:443 at IP, K rounds of one GET /1k
on each, T seconds apart (the client of benches/think-ab.sh). Standard library only.
Every loop bounded: K rounds, 10 s socket timeouts."""
import argparse, socket, ssl, sys, time
ap = argparse.ArgumentParser()
ap.add_argument("--ip", required=True); ap.add_argument("--host", required=True)
ap.add_argument("--cafile", required=True)
ap.add_argument("--c", type=int, default=200); ap.add_argument("--k", type=int, default=10)
ap.add_argument("--t", type=float, default=0.7)
a = ap.parse_args()
ctx = ssl.create_default_context(cafile=a.cafile); ctx.set_alpn_protocols(["http/1.1"])
req = f"GET /1k HTTP/1.1\r\nHost: {a.host}\r\n\r\n".encode()
def read_response(s):
    buf = b""
    while b"\r\n\r\n" not in buf:
        c = s.recv(16384)
        if not c: raise OSError("closed")
        buf += c
    head, body = buf.split(b"\r\n\r\n", 1)
    n = [int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")][0]
    while len(body) < n:
        c = s.recv(16384)
        if not c: raise OSError("closed in body")
        body += c
conns = []
for i in range(a.c):
    s = socket.create_connection((a.ip, 443), timeout=10)
    conns.append(ctx.wrap_socket(s, server_hostname=a.host))
print("open", flush=True)
t0 = time.time()
for k in range(a.k):
    for s in conns:
        s.sendall(req); read_response(s)
    time.sleep(a.t)
print(f"done {a.c*a.k} requests in {time.time()-t0:.1f}s", flush=True)
