#!/usr/bin/env python3
"""The DNS part of the release build's training workload (benches/pgo-train.sh).

Runs the gateway given (an instrumented build) with its DNS listener on
loopback, an upstream of its own (a few lines of stdlib DNS: every A query
answered with an address in 203.0.113.0/24, every other type with no
answer), and sends it, from the sandbox 127.0.0.2, A and AAAA queries for
allowed names (forwarded, answered, attributed) and denied ones (refused by
the gateway) for a few seconds; then stops the gateway with SIGTERM, so
that it writes its counts, and waits for it. Loopback only: run it in a
network namespace of its own (pgo-train.sh runs it in the topology's).

    pgo-dns.py --gateway BIN --state DIR [--seconds 2]
"""

import argparse
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request

SANDBOX = "127.0.0.2"
UPSTREAM = ("127.0.0.1", 25353)
LISTEN_PORT = 25053
ADMIN_PORT = 25000


def question_end(msg):
    """Offset just past the first question (name, type, class), or None."""
    at = 12
    while at < len(msg):
        n = msg[at]
        if n == 0:
            return at + 5 if at + 5 <= len(msg) else None
        if n & 0xC0:
            return None
        at += 1 + n
    return None


def answer(msg):
    """The upstream's reply to one query: A gets one address, else none."""
    end = question_end(msg)
    if len(msg) < 12 or end is None:
        return None
    qtype = struct.unpack("!H", msg[end - 4:end - 2])[0]
    last = sum(msg[12:end]) % 250 + 1
    records = b""
    if qtype == 1:
        records = struct.pack("!HHHIH", 0xC00C, 1, 1, 60, 4) + bytes([203, 0, 113, last])
    flags = 0x8180 | (msg[2] & 0x01) << 8
    header = msg[:2] + struct.pack("!HHHHH", flags, 1, 1 if records else 0, 0, 0)
    return header + msg[12:end] + records


def upstream(sock, stop):
    sock.settimeout(0.2)
    while not stop.is_set():
        try:
            msg, peer = sock.recvfrom(4096)
        except socket.timeout:
            continue
        reply = answer(msg)
        if reply:
            sock.sendto(reply, peer)
    sock.close()


def query(qid, name, qtype):
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, 1)


def load(seconds):
    """Queries in windows of 16 until the time is up. Counts the allowed
    names' queries sent, and those answered NOERROR (from the upstream, not
    a SERVFAIL of the gateway's own)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((SANDBOX, 0))
    sock.settimeout(0.5)
    deadline = time.monotonic() + seconds
    sent = allowed = answered = 0
    while time.monotonic() < deadline:
        for _ in range(16):
            i = sent
            sent += 1
            name = "n%d.bench.test" % (i % 5000) if i % 8 else "x%d.denied.test" % (i % 50)
            allowed += 1 if i % 8 else 0
            qtype = 28 if i % 5 == 0 else 1
            sock.sendto(query(i & 0xFFFF, name, qtype), ("127.0.0.1", LISTEN_PORT))
        try:
            for _ in range(16):
                reply = sock.recv(4096)
                if len(reply) >= 4 and reply[3] & 0x0F == 0 and b"denied" not in reply:
                    answered += 1
        except socket.timeout:
            pass
    sock.close()
    return allowed, answered


def config(state):
    os.makedirs(state, exist_ok=True)
    policy = {"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.bench.test"}]}
    with open(os.path.join(state, "snapshot.json"), "w") as f:
        json.dump({"version": 1, "sandboxes": [{"id": "pgo", "addresses": [SANDBOX], "policy": policy}]}, f)
    path = os.path.join(state, "gateway.toml")
    with open(path, "w") as f:
        f.write(f"""state_dir = "{state}"
[listen]
transparent = "127.0.0.1:0"
dns = "127.0.0.1:{LISTEN_PORT}"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:{ADMIN_PORT}"
[dns]
upstreams = ["{UPSTREAM[0]}:{UPSTREAM[1]}"]
# Budgets on, out of the load's reach: the training's queries are a
# sandbox's ordinary ones, charged and admitted, not a flood refused.
budget_qps = 1000000
budget_new_names_per_minute = 1000000
[limits]
max_connections = 1000
[log]
flow_log = "off"
""")
    return path


def ready(gw):
    for _ in range(100):
        if gw.poll() is not None:
            return False
        try:
            # No proxy, whatever the environment says: this is loopback.
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(f"http://127.0.0.1:{ADMIN_PORT}/readyz", timeout=1):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--state", required=True)
    ap.add_argument("--seconds", type=float, default=2.0)
    a = ap.parse_args()
    stop = threading.Event()
    # Bound before the gateway starts: a port taken fails the run here.
    up_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    up_sock.bind(UPSTREAM)
    up = threading.Thread(target=upstream, args=(up_sock, stop), daemon=True)
    up.start()
    path = config(a.state)
    err = open(os.path.join(a.state, "gateway.err"), "w")
    gw = subprocess.Popen([a.gateway, "run", "--config", path], stderr=err, env=dict(os.environ, RUST_LOG="warn"))
    try:
        if not ready(gw):
            sys.exit("pgo-dns.py: the gateway did not become ready (%s)" % os.path.join(a.state, "gateway.err"))
        allowed, answered = load(a.seconds)
        print("pgo-dns.py: %d queries for allowed names, %d answered NOERROR" % (allowed, answered))
        if answered < allowed // 2:
            sys.exit("pgo-dns.py: fewer than half of the allowed names' queries were answered")
    finally:
        gw.send_signal(signal.SIGTERM)
        try:
            code = gw.wait(timeout=30)
        except subprocess.TimeoutExpired:
            gw.kill()
            sys.exit("pgo-dns.py: the gateway did not stop within 30 s: its counts are lost")
        stop.set()
    if code != 0:
        sys.exit("pgo-dns.py: the gateway exited %d (%s)" % (code, os.path.join(a.state, "gateway.err")))


if __name__ == "__main__":
    main()
