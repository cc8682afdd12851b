#!/usr/bin/env python3
"""Latency probe and interception check of benches/peers (standard library only).

    probe.py check --expect-issuer CN      one request; the issuer the client saw must be CN
    probe.py ka  --n 300 --rate 100        keep-alive: N requests paced on one connection
    probe.py new --n 150 --rate 50         new connections: N paced TCP + full TLS handshake + 1 request

Every request is HTTP/1.1 GET of --path over TLS (ALPN http/1.1), the
certificate verified against --cafile for --host, sent to --ip (no name is
resolved).  keep-alive: time from writing the request to the last byte of
the response.  new: from connect() to the last byte of the response; the
context keeps no session and asks for no ticket, so every handshake is a
full one (the JSON says how many were resumed: it must be 0).

Output: one JSON line.  Bounded: N requests, each socket operation by
--timeout, the whole probe by N / rate + 20 s.
"""
import argparse
import json
import math
import socket
import ssl
import sys
import time


def nearest_rank(sorted_ms, p):
    if not sorted_ms:
        return None
    return round(sorted_ms[max(0, math.ceil(p / 100 * len(sorted_ms)) - 1)], 3)


class Client:
    def __init__(self, args, ctx):
        sock = socket.create_connection((args.ip, args.port), timeout=args.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tls = ctx.wrap_socket(sock, server_hostname=args.host)
        self.host = args.host
        self.pending = b""

    def issuer(self):
        for rdn in (self.tls.getpeercert() or {}).get("issuer", ()):
            for key, value in rdn:
                if key == "commonName":
                    return value
        return ""

    def _more(self):
        data = self.tls.recv(1 << 18)
        if not data:
            raise EOFError("closed before the response ended")
        self.pending += data

    def get(self, path, close=False):
        """Sends one request, reads the whole response; returns (status, body bytes, server keeps it open)."""
        head = "GET %s HTTP/1.1\r\nHost: %s\r\nUser-Agent: eb-probe\r\n%s\r\n" % (
            path, self.host, "Connection: close\r\n" if close else "")
        self.tls.sendall(head.encode())
        while b"\r\n\r\n" not in self.pending:
            self._more()
        raw, self.pending = self.pending.split(b"\r\n\r\n", 1)
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip().lower()
        if "chunked" in fields.get("transfer-encoding", ""):
            size = 0
            while True:
                while b"\r\n" not in self.pending:
                    self._more()
                line, self.pending = self.pending.split(b"\r\n", 1)
                chunk = int(line.split(b";")[0], 16)
                while len(self.pending) < chunk + 2:
                    self._more()
                self.pending = self.pending[chunk + 2:]
                size += chunk
                if chunk == 0:
                    break
        else:
            size = int(fields.get("content-length", "0"))
            while len(self.pending) < size:
                self._more()
            self.pending = self.pending[size:]
        return status, size, fields.get("connection") != "close"

    def close(self):
        try:
            self.tls.close()
        except OSError:
            pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["check", "ka", "new"])
    ap.add_argument("--ip", default="203.0.113.10")
    ap.add_argument("--port", type=int, default=443)
    ap.add_argument("--host", default="origin.test")
    ap.add_argument("--path", default="/1k")
    ap.add_argument("--cafile", required=True)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--expect-issuer")
    args = ap.parse_args()

    ctx = ssl.create_default_context(cafile=args.cafile)
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.options |= ssl.OP_NO_TICKET  # and no session is ever passed to wrap_socket: full handshakes
    out = {"mode": args.mode, "path": args.path}

    if args.mode == "check":
        try:
            c = Client(args, ctx)
            status, size, _ = c.get(args.path, close=True)
            out.update(status=status, bytes=size, issuer=c.issuer(), tls=c.tls.version(),
                       alpn=c.tls.selected_alpn_protocol())
            c.close()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            out["error"] = "%s: %s" % (type(e).__name__, e)
            print(json.dumps(out))
            return 1
        print(json.dumps(out))
        ok = status == 200 and (args.expect_issuer is None or out["issuer"] == args.expect_issuer)
        return 0 if ok else 1

    n = max(1, args.n)
    interval = 1.0 / args.rate
    give_up = time.monotonic() + n * interval + 20.0
    samples, errors, reconnects, resumed, issuer = [], 0, 0, 0, None
    keep = None
    if args.mode == "ka":
        keep = Client(args, ctx)
        issuer = keep.issuer()
        for _ in range(5):  # warm the connection (and the column's upstream)
            keep.get(args.path)
    start = time.perf_counter()
    for i in range(n):
        if time.monotonic() > give_up or errors > max(5, n // 10):
            break
        wait = start + i * interval - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        try:
            t0 = time.perf_counter()
            if args.mode == "ka":
                status, _, open_ = keep.get(args.path)
                dt = time.perf_counter() - t0
                if not open_:
                    keep.close()
                    keep = Client(args, ctx)
                    reconnects += 1
            else:
                c = Client(args, ctx)
                status, _, _ = c.get(args.path, close=True)
                dt = time.perf_counter() - t0
                resumed += bool(c.tls.session_reused)
                if issuer is None:
                    issuer = c.issuer()
                c.close()
        except Exception:  # noqa: BLE001 - counted
            errors += 1
            if args.mode == "ka":
                try:
                    keep.close()
                    keep = Client(args, ctx)
                    reconnects += 1
                except Exception:  # noqa: BLE001
                    pass
            continue
        if status == 200:
            samples.append(dt * 1000.0)
        else:
            errors += 1
    elapsed = time.perf_counter() - start
    if keep is not None:
        keep.close()
    samples.sort()
    out.update(n=len(samples), errors=errors, reconnects=reconnects, resumed=resumed, issuer=issuer,
               rate=args.rate, elapsed_s=round(elapsed, 3),
               p50_ms=nearest_rank(samples, 50), p90_ms=nearest_rank(samples, 90),
               p99_ms=nearest_rank(samples, 99), max_ms=nearest_rank(samples, 100))
    print(json.dumps(out))
    if args.expect_issuer is not None and issuer != args.expect_issuer:
        return 1
    return 0 if samples else 1


if __name__ == "__main__":
    sys.exit(main())
