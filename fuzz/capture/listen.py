#!/usr/bin/env python3
"""Accepts one connection on 127.0.0.1, records the client's first flight up
to the end of the TLS record that completes its ClientHello, and closes.

    listen.py OUT.bin PORT_FILE

Binds an ephemeral port and writes it to PORT_FILE, so a client can be
started against it; see capture.sh.
"""
import socket
import sys


def capture(sock):
    conn, _ = sock.accept()
    conn.settimeout(10)
    buf = b""

    def need(n):
        nonlocal buf
        while len(buf) < n:
            chunk = conn.recv(65536)
            if not chunk:
                raise EOFError(f"closed after {len(buf)} bytes")
            buf += chunk

    off, handshake = 0, b""
    while True:
        need(off + 5)
        if buf[off] != 0x16:
            raise ValueError(f"not a handshake record at {off}: {buf[off:off + 5].hex()}")
        length = int.from_bytes(buf[off + 3:off + 5], "big")
        need(off + 5 + length)
        handshake += buf[off + 5:off + 5 + length]
        off += 5 + length
        if len(handshake) >= 4 and len(handshake) >= 4 + int.from_bytes(handshake[1:4], "big"):
            break
    conn.close()
    return buf[:off]


def main():
    out, port_file = sys.argv[1], sys.argv[2]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    with open(port_file, "w") as f:
        f.write(str(s.getsockname()[1]))
    data = capture(s)
    with open(out, "wb") as f:
        f.write(data)
    print(out, len(data))


if __name__ == "__main__":
    main()
