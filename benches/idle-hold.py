#!/usr/bin/env python3
"""Opens N TLS connections (full handshake, verified) to HOST:443 at IP and holds
them idle: the client side of benches/idle-rss.sh. With --request PATH each
connection first sends one HTTP/1.1 keep-alive request and reads the whole
response (so an intercepting gateway holds its upstream connection too);
with --body N too, that request is a POST with an N-byte body; with --h2 the
connection speaks HTTP/2 (ALPN h2) and the request is one GET on stream 1,
its frames and HPACK written by hand (static-table names, no Huffman).
Prints `held N` when all are open, then sleeps HOLD seconds. Standard
library only."""
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
ap.add_argument("--request", metavar="PATH", help="send one GET PATH per connection")
ap.add_argument("--body", type=int, metavar="N", help="make that request a POST of N bytes")
ap.add_argument("--h2", action="store_true", help="HTTP/2: one GET on stream 1")
ap.add_argument("--open-deadline", type=float, default=300, help="seconds to open all")
a = ap.parse_args()

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = a.n + 1024
if hard != resource.RLIM_INFINITY and want > hard:
    sys.exit(f"{a.n} connections need {want} descriptors; the hard limit is {hard}")
resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
ctx = ssl.create_default_context(cafile=a.cafile)
ctx.set_alpn_protocols(["h2"] if a.h2 else ["http/1.1"])
request = None
if a.request:
    request = f"GET {a.request} HTTP/1.1\r\nHost: {a.host}\r\nUser-Agent: idle-hold\r\n\r\n".encode()
    if a.body is not None:
        request = (
            f"POST {a.request} HTTP/1.1\r\nHost: {a.host}\r\nUser-Agent: idle-hold\r\n"
            f"Content-Type: application/json\r\nContent-Length: {a.body}\r\n\r\n"
        ).encode() + b"x" * a.body


def read_response(s):
    """Reads one response (Content-Length or chunked) and checks it is a 200."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(16384)
        if not chunk:
            raise OSError("closed before the response head")
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    if not lines[0].split(" ")[1:2] == ["200"]:
        raise OSError(f"response {lines[0]!r}")
    fields = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    if "content-length" in fields:
        left = int(fields["content-length"]) - len(body)
        while left > 0:
            chunk = s.recv(min(left, 16384))
            if not chunk:
                raise OSError("closed inside the body")
            left -= len(chunk)
    elif fields.get("transfer-encoding", "").lower() == "chunked":
        while not body.endswith(b"0\r\n\r\n"):
            chunk = s.recv(16384)
            if not chunk:
                raise OSError("closed inside the body")
            body += chunk
    else:
        raise OSError("a response without a length on a keep-alive connection")


def frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def h2_get(s, path):
    """One GET on stream 1; reads frames until the stream ends, and checks a 200."""
    def literal(index, value):  # literal without indexing, static-table name
        return bytes([index, len(value)]) + value.encode()
    block = b"\x82\x87" + literal(4, path) + literal(1, a.host)  # GET, https, :path, :authority
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0) + frame(1, 0x5, 1, block))
    buf = b""
    status_seen = False
    while True:
        while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
            chunk = s.recv(16384)
            if not chunk:
                raise OSError("closed before the response ended")
            buf += chunk
        n = int.from_bytes(buf[:3], "big")
        kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
        payload, buf = buf[9:9 + n], buf[9 + n:]
        if kind == 4 and not flags & 1:
            s.sendall(frame(4, 1, 0))  # SETTINGS: acknowledged
        elif kind == 7:
            raise OSError("GOAWAY")
        elif stream == 1 and kind == 3:
            raise OSError("stream reset")
        elif stream == 1 and kind == 1:
            if payload[:1] != b"\x88":  # :status 200, static index 8
                raise OSError(f"response head {payload[:8]!r}")
            status_seen = True
        if stream == 1 and kind in (0, 1) and flags & 1:
            if not status_seen:
                raise OSError("no status")
            return


held = []
deadline = time.time() + a.open_deadline
for i in range(a.n):
    if time.time() > deadline:
        sys.exit(f"only {len(held)} connections in {a.open_deadline:.0f} s")
    try:
        s = socket.create_connection((a.ip, 443), timeout=10)
        t = ctx.wrap_socket(s, server_hostname=a.host)
        if a.h2:
            h2_get(t, a.request or "/")
        elif request:
            t.sendall(request)
            read_response(t)
        held.append(t)
    except OSError as e:
        sys.exit(f"connection {len(held) + 1} failed: {e}")
print(f"held {len(held)}", flush=True)
time.sleep(a.hold)
