#!/usr/bin/env python3
"""Writes the committed seed corpora, fuzz/corpus/<target>/, from scratch.

Run from the repository root: `python3 fuzz/make_seeds.py`. Deterministic:
rerunning rewrites the same files. Seeds are small and each shows the
target one shape of valid (or nearly valid) input: the documents of
docs/policy.md and docs/machine-egress.md, the captured ClientHellos of
gateway/src/peek/captured/, hand-encoded DNS answers (with compression
pointers, as upstreams send them), request heads, admin bodies.
"""
import json
import os
import shutil
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# === peek_segments ===

def hello(sni=None, alpn=(), padding=0, early=False, ech=False):
    """A ClientHello like gateway/src/peek/fixture.rs builds (`ech`: with an
    outer encrypted_client_hello extension, as `fixture::ech_outer`)."""
    exts = []
    if sni is not None:
        name = sni.encode() if isinstance(sni, str) else sni
        entry = b"\x00" + struct.pack(">H", len(name)) + name
        exts.append((0x0000, struct.pack(">H", len(entry)) + entry))
    if alpn:
        lst = b"".join(bytes([len(p)]) + p.encode() for p in alpn)
        exts.append((0x0010, struct.pack(">H", len(lst)) + lst))
    if early:
        exts.append((0x002A, b""))
    if padding:
        exts.append((0x0015, b"\x00" * padding))
    if ech:
        enc, payload = bytes(range(32)), bytes((i * 7) % 256 for i in range(180))
        exts.append((0xFE0D, b"\x00\x00\x01\x00\x01\x17" + struct.pack(">H", len(enc)) + enc
                     + struct.pack(">H", len(payload)) + payload))
    block = b"".join(struct.pack(">HH", t, len(d)) + d for t, d in exts)
    body = b"\x03\x03" + b"\x07" * 32 + b"\x20" + b"\x09" * 32
    body += b"\x00\x02\x13\x01\x01\x00" + struct.pack(">H", len(block)) + block
    return b"\x01" + struct.pack(">I", len(body))[1:] + body


def records(hs, fragment):
    out = b""
    for i in range(0, len(hs), fragment):
        c = hs[i:i + fragment]
        out += b"\x16\x03\x01" + struct.pack(">H", len(c)) + c
    return out


def peek_input(data, cuts=(), max_bound=16384):
    """[max - 512: u16 LE][n: u8][n x cut: u16 LE][data]."""
    head = struct.pack("<H", max_bound - 512) + bytes([len(cuts)])
    head += b"".join(struct.pack("<H", c) for c in cuts)
    return head + data


def peek_seeds():
    captured = os.path.join(ROOT, "gateway", "src", "peek", "captured")
    for f in sorted(os.listdir(captured)):
        with open(os.path.join(captured, f), "rb") as fh:
            data = fh.read()
        write("peek_segments", "captured-" + f, peek_input(data))
        if f == "curl.bin":
            # Cut mid-header, mid-extension, with stalls.
            write("peek_segments", "captured-curl-cut.bin",
                  peek_input(data, (3, 0x8000 | 2, 40, 0x8000 | 100)))
    write("peek_segments", "hello-pq-records.bin",
          peek_input(records(hello("pq.example.test", ["h2"], 1800, True), 100), (7, 513)))
    write("peek_segments", "hello-no-sni.bin", peek_input(records(hello(), 16384)))
    write("peek_segments", "hello-ech.bin",
          peek_input(records(hello("public.example.test", ["h2"], ech=True), 120), (9, 0x8000 | 200)))
    write("peek_segments", "hello-ip-sni.bin",
          peek_input(records(hello("198.51.100.1"), 16384)))
    write("peek_segments", "hello-nul-sni.bin",
          peek_input(records(hello(b"a.test\x00.evil.test"), 16384)))
    write("peek_segments", "hello-too-large.bin",
          peek_input(records(hello("big.example.test", [], 1200), 300), max_bound=1024))
    heads = {
        "http-get.bin": "GET /x HTTP/1.1\r\nHost: api.example.test\r\n\r\n",
        "http-absolute.bin": "GET http://api.example.test:8080/x HTTP/1.1\r\nHost: api.example.test:8080\r\n\r\n",
        "http-connect.bin": "CONNECT api.example.test:443 HTTP/1.1\r\nHost: api.example.test:443\r\n\r\n",
        "http-two-hosts.bin": "GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
        "http-disagree.bin": "GET http://allowed.test/ HTTP/1.1\r\nHost: denied.test\r\n\r\n",
        "http-10-no-host.bin": "GET / HTTP/1.0\r\n\r\n",
        "http-11-no-host.bin": "GET / HTTP/1.1\r\nUser-Agent: x\r\n\r\n",
        "opaque-ssh.bin": "SSH-2.0-OpenSSH_9.2\r\n",
        "opaque-ssh-comments.bin": "SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13.5\r\n\x00\x00\x05\xdc",
        "opaque-ssh-bare-lf.bin": "SSH-2.0-OpenSSH_9.2\n",
    }
    for name, head in heads.items():
        write("peek_segments", name, peek_input(head.encode(), (5, 0x8000 | 9)))
    # The SSLv2-compatible hello testssl.sh probes with: unreadable.
    write("peek_segments", "opaque-sslv2.bin",
          peek_input(bytes([0x80, 0x2E, 0x01, 0x00, 0x02, 0x00, 0x15, 0x00, 0x00, 0x00, 0x10]), (1,)))


# === dns_answer ===

def qname(name):
    out = b""
    for label in name.rstrip(".").split("."):
        if label:
            out += bytes([len(label)]) + label.encode()
    return out + b"\x00"


class Msg:
    """A DNS response with name compression (pointers to earlier names)."""

    def __init__(self, question, qtype=1):
        self.buf = bytearray(struct.pack(">HHHHHH", 0x1234, 0x8180, 1, 0, 0, 0))
        self.names = {}
        self.buf += self.name(question) + struct.pack(">HH", qtype, 1)
        self.answers = 0

    def name(self, name):
        name = name.rstrip(".")
        if not name:
            return b"\x00"
        if name in self.names:
            return struct.pack(">H", 0xC000 | self.names[name])
        label, _, rest = name.partition(".")
        here = len(self.buf)
        encoded = bytes([len(label)]) + label.encode()
        if here < 0x3FFF:
            self.names[name] = here
        # The suffix is encoded (or pointed to) right after this label.
        self.buf += encoded
        tail = self.name(rest)
        del self.buf[here:]
        return encoded + tail

    def rr(self, owner, rtype, ttl, rdata_fn):
        self.buf += self.name(owner)
        self.buf += struct.pack(">HHI", rtype, 1, ttl)
        at = len(self.buf)
        self.buf += b"\x00\x00"
        rdata = rdata_fn()
        self.buf += rdata
        self.buf[at:at + 2] = struct.pack(">H", len(rdata))
        self.answers += 1
        return self

    def a(self, owner, ttl, ip):
        return self.rr(owner, 1, ttl, lambda: bytes(int(o) for o in ip.split(".")))

    def aaaa(self, owner, ttl, ip):
        import ipaddress
        return self.rr(owner, 28, ttl, lambda: ipaddress.IPv6Address(ip).packed)

    def cname(self, owner, ttl, target):
        return self.rr(owner, 5, ttl, lambda: self.name(target))

    def bytes(self):
        out = bytearray(self.buf)
        out[6:8] = struct.pack(">H", self.answers)
        return bytes(out)


def frames(*msgs):
    """[mode 0 = raw] then [sandbox][len: u16 BE][message] per message."""
    out = b"\x00"
    for sandbox, m in msgs:
        out += bytes([sandbox]) + struct.pack(">H", len(m)) + m
    return out


def dns_seeds():
    simple = Msg("api.example.test").a("api.example.test", 300, "203.0.113.7") \
        .aaaa("api.example.test", 200, "2001:db8::7").bytes()
    write("dns_answer", "a-aaaa.bin", frames((0, simple)))
    chain = Msg("www.shop.test").cname("www.shop.test", 120, "shop.cdn.test") \
        .cname("shop.cdn.test", 60, "edge.cdn.test") \
        .a("edge.cdn.test", 600, "198.51.100.9").bytes()
    write("dns_answer", "cname-chain.bin", frames((1, chain)))
    unordered = Msg("www.shop.test").a("edge.cdn.test", 600, "198.51.100.9") \
        .cname("shop.cdn.test", 60, "edge.cdn.test") \
        .cname("WWW.Shop.Test", 120, "shop.cdn.test").bytes()
    write("dns_answer", "cname-out-of-order-case.bin", frames((1, unordered)))
    offchain = Msg("api.example.test").a("api.example.test", 300, "203.0.113.7") \
        .a("evil.test", 300, "203.0.113.7").cname("other.test", 300, "api.example.test").bytes()
    write("dns_answer", "off-chain-owner.bin", frames((2, offchain)))
    loop = Msg("a.loop.test").cname("a.loop.test", 30, "b.loop.test") \
        .cname("b.loop.test", 30, "a.loop.test").a("b.loop.test", 30, "192.0.2.1").bytes()
    write("dns_answer", "cname-loop.bin", frames((0, loop)))
    long = Msg("l0.long.test")
    for i in range(20):
        long.cname(f"l{i}.long.test", 100 + i, f"l{i + 1}.long.test")
    for i in range(21):
        long.a(f"l{i}.long.test", 100, f"192.0.2.{i + 1}")
    write("dns_answer", "cname-chain-too-long.bin", frames((3, long.bytes())))
    absurd = Msg("ttl.test").a("ttl.test", 0, "192.0.2.10").a("ttl.test", 0xFFFFFFFF, "192.0.2.11") \
        .a("ttl.test", 0x80000000, "192.0.2.12").bytes()
    write("dns_answer", "absurd-ttls.bin", frames((0, absurd)))
    many = Msg("many.test")
    for i in range(80):
        many.a("many.test", 60, f"10.0.{i // 256}.{i % 256}")
    write("dns_answer", "many-answers.bin", frames((0, many.bytes())))
    svc = Msg("_svc.example.test").cname("_svc.example.test", 60, "host.example.test") \
        .a("host.example.test", 60, "192.0.2.20").bytes()
    write("dns_answer", "non-hostname-question.bin", frames((0, svc)))
    # Six sandboxes: the fifth and sixth find the cache full of sandboxes.
    write("dns_answer", "six-sandboxes.bin",
          frames(*[(i, simple) for i in range(6)], (0, chain)))
    # Built mode: bit 7 set, the rest read by `arbitrary`.
    write("dns_answer", "built-empty.bin", b"\x80")
    write("dns_answer", "built-bytes.bin", b"\x80" + bytes(range(0, 256, 3)))


# === svcb_rewrite ===

def svcb_rdata(priority, target, params):
    """SVCB/HTTPS RDATA: params is [(key, value bytes)], written in the order given."""
    out = struct.pack(">H", priority) + qname(target)
    for key, value in params:
        out += struct.pack(">HH", key, len(value)) + value
    return out


ALPN = (1, b"\x02h2\x08http/1.1")
PORT = (3, struct.pack(">H", 8443))
V4HINT = (4, bytes([192, 0, 2, 1, 192, 0, 2, 2]))
ECH = (5, b"\x00\x08\xfe\x0d\x00\x04ech!")
V6HINT = (6, bytes(15) + b"\x01")
UNKNOWN = (65000, b"opaque")


def svcb_message(sections, rtype=65):
    """A response to `www.example.test` type `rtype`; sections is [(section 0-2, rtype, rdata)]."""
    header = struct.pack(">HHHHHH", 0x1234, 0x8180, 1,
                         *[sum(1 for s, _, _ in sections if s == i) for i in range(3)])
    out = header + qname("www.example.test") + struct.pack(">HH", rtype, 1)
    for i in range(3):
        for section, t, rdata in sections:
            if section == i:
                out += b"\xc0\x0c" + struct.pack(">HHIH", t, 1, 300, len(rdata)) + rdata
    return out


def svcb_seeds():
    raw = lambda name, m: write("svcb_rewrite", name, b"\x00" + m)
    raw("https-ech.bin", svcb_message([(0, 65, svcb_rdata(1, ".", [ALPN, V4HINT, ECH, V6HINT]))]))
    raw("https-no-ech.bin", svcb_message([(0, 65, svcb_rdata(1, ".", [ALPN, PORT, V4HINT, UNKNOWN]))]))
    raw("mandatory-alpn-ech.bin", svcb_message([(0, 65, svcb_rdata(
        1, ".", [(0, struct.pack(">HH", 1, 5)), ALPN, ECH, UNKNOWN]))]))
    raw("mandatory-ech-only.bin", svcb_message([(0, 65, svcb_rdata(
        1, ".", [(0, struct.pack(">H", 5)), ECH]))]))
    raw("svcb-alias.bin", svcb_message([(0, 64, svcb_rdata(0, "svc.example.test", []))], rtype=64))
    raw("two-records-one-ech.bin", svcb_message([
        (0, 65, svcb_rdata(1, "a.example.test", [ALPN, ECH])),
        (0, 65, svcb_rdata(2, "b.example.test", [ALPN, PORT])),
        (0, 1, bytes([203, 0, 113, 7]))]))
    raw("every-section.bin", svcb_message([
        (0, 65, svcb_rdata(1, ".", [ECH])),
        (1, 64, svcb_rdata(3, "svc.example.test", [PORT, ECH])),
        (2, 65, svcb_rdata(1, ".", [ALPN, ECH, V6HINT]))]))
    opt = b"\x00" + struct.pack(">HHIH", 41, 1232, 0, 0)
    edns = svcb_message([(0, 65, svcb_rdata(1, ".", [ALPN, ECH]))])
    edns = edns[:10] + struct.pack(">H", 1) + edns[12:] + opt
    raw("https-ech-edns.bin", edns)
    raw("keys-out-of-order.bin", svcb_message([(0, 65, svcb_rdata(1, ".", [ECH, ALPN]))]))
    # Built mode: bit 7 set, the rest read by `arbitrary`.
    write("svcb_rewrite", "built-bytes.bin", b"\x80" + bytes(range(1, 200, 7)))


# === policy_documents ===

POLICY = {
    "default": "deny",
    "allow": [{"domain": "api.example.test"}, {"ip": "8.8.8.8"}, {"ip": "1.1.1.1"}],
    "deny": [{"cidr": "203.0.113.0/28"}],
    "tls_interception": "on",
    "tls_interception_exemptions": [{"wildcard_domain": "*.relay.example.test"}],
}
PROFILES = """{
  "audit":  {"default": true, "allow": [{"domain": "audit.example.test"}]},
  "sensor": {"allow": [{"domain": "sensor.example.test"}, {"cidr": "192.0.2.0/24"}],
             "tls_interception_exemptions": [{"domain": "sensor.example.test"}]}
}"""
EXEMPTIONS = '[{"domain": "relay.example.test"}, {"wildcard_domain": "*.relay.example.test"}]'
MACHINE = """{"mode": "allowlist",
 "rules": [{"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151, "note": "Veyron API"},
           {"cidr": "91.189.88.0/21", "proto": "tcp", "port": 80},
           {"cidr": "0.0.0.0/0", "proto": "udp", "port": 53}]}"""
MACHINE_NESTED = json.dumps({"mode": "audit", "rules": [
    {"cidr": "10.0.0.0/8"}, {"cidr": "10.1.0.0/16", "proto": "tcp"},
    {"cidr": "10.1.2.0/24", "proto": "tcp", "port": 443}, {"cidr": "10.1.2.3", "proto": "udp"},
    {"cidr": "10.1.2.0/24", "proto": "tcp", "port": 443}]})


def policy_seeds():
    docs = [
        (0, "policy-full.json", json.dumps(POLICY)),
        (0, "policy-empty.json", "{}"),
        (0, "policy-mapped.json",
         '{"default": "allow", "allow": [{"ip": "::ffff:8.8.8.8"}, {"cidr": "::ffff:0:0/104"}],'
         ' "deny": [{"domain": "API.Example.test."}, {"ip": "64:ff9b::c000:201"}]}'),
        (0, "policy-duplicate-key.json", '{"default": "deny", "default": "allow"}'),
        (0, "policy-host-bits.json", '{"allow": [{"cidr": "10.0.0.1/8"}]}'),
        (0, "policy-dns.json",
         '{"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.cdn.test"}],'
         ' "dns": {"resolve": "policy", "query_types": ["A", "TYPE28", "HTTPS", "TYPE65000"],'
         ' "budget": {"qps": 20, "new_names_per_minute": 300}}}'),
        (0, "policy-dns-any.json", '{"dns": {"query_types": ["ANY"], "budget": {"qps": 0}}}'),
        (0, "policy-streams.json",
         '{"allow": [{"cidr": "203.0.113.0/24", "streams": ["ssh"]}, {"domain": "git.example.test", "streams": []}],'
         ' "deny": [{"ip": "203.0.113.9"}]}'),
        (0, "policy-streams-on-deny.json", '{"deny": [{"ip": "203.0.113.9", "streams": ["ssh"]}]}'),
        (1, "profiles.json", PROFILES),
        (1, "profiles-empty.json", "{}"),
        (1, "profiles-bad-name.json", '{"Bad_Name": {"allow": [{"ip": "192.0.2.1"}]}}'),
        (2, "exemptions.json", EXEMPTIONS),
        (2, "exemptions-ip.json", '[{"ip": "203.0.113.7"}]'),
        (3, "select-add-remove.txt", "+research -base"),
        (3, "select-gpu.txt", "+gpu-2"),
        (3, "select-conflict.txt", "+research -research"),
        (3, "select-unknown.txt", "+nope"),
        (3, "select-double-space.txt", "+research  -base"),
        (133, "select-unfederated.txt", "+research"),  # 133 % 5 == 3, bit 7: unfederated
        (4, "machine-allowlist.json", MACHINE),
        (4, "machine-nested.json", MACHINE_NESTED),
        (4, "machine-loopback.json", "{}"),
        (4, "machine-open-with-rules.json", '{"mode": "open", "rules": [{"cidr": "10.0.0.0/8"}]}'),
    ]
    for sel, name, text in docs:
        write("policy_documents", name, bytes([sel]) + text.encode())


# === destinations ===

def destination_seeds():
    values = [
        "203.0.113.7", "::ffff:8.8.8.8", "64:ff9b::808:808", "::ffff:0:0/104",
        "::ffff:10.0.0.0/104", "64:ff9b::/96", "2001:db8::/32", "10.0.0.1/8", "0.0.0.0/0",
        "API.Example.Test.", "api.example.test", "*.relay.example.test", "*.*.test",
        "xn--bcher-kva.example.test", "a_b.test", "10.0.0.1", "1.2.3", "a." * 126 + "a",
        "-a.test", "*.", "[::1]", "fe80::1%eth0",
    ]
    for i, v in enumerate(values):
        write("destinations", f"value-{i:02}.txt", v)


# === admin_bodies ===

def admin_seeds():
    sandbox = {"id": "sb-1", "addresses": ["10.200.0.2", "fd00::2"], "policy": POLICY}
    bodies = [
        (0, "put-sandbox.json", json.dumps({"addresses": ["10.200.0.2"], "policy": POLICY})),
        (0, "put-sandbox-mapped-dup.json",
         '{"addresses": ["10.200.0.2", "::ffff:10.200.0.2"], "policy": {}}'),
        (0, "put-sandbox-unknown-field.json", '{"addresses": [], "policy": {}, "extra": 1}'),
        (1, "resync.json", json.dumps({"sandboxes": [sandbox,
                                                     {"id": "sb-2", "addresses": ["10.200.0.3"],
                                                      "policy": {}}]})),
        (1, "resync-dup-id.json", json.dumps({"sandboxes": [sandbox, sandbox]})),
        (2, "resync.ndjson", json.dumps(sandbox) + "\n\n" +
         json.dumps({"id": "sb-2", "addresses": [], "policy": {}})),
        (3, "explain.json", json.dumps({"sandbox": "sb-1", "dst": "198.51.100.7:443", "tls": True,
                                        "sni": "API.example.test.", "host": "api.example.test"})),
        (3, "explain-ip-sni.json", '{"sandbox": "sb-1", "dst": "[2001:db8::1]:80", "sni": "198.51.100.1"}'),
        (3, "explain-ech.json",
         '{"sandbox": "sb-1", "dst": "198.51.100.7:443", "tls": true, "ech": true, "sni": "api.example.test"}'),
        (3, "explain-stream.json", '{"sandbox": "sb-1", "dst": "198.51.100.7:22", "stream": "ssh"}'),
        (4, "machine-egress.json", MACHINE),
        (5, "vm-registration.json", json.dumps({"addresses": ["100.64.0.2"],
                                                "egress": json.loads(MACHINE)})),
        (5, "vm-registration-default.json", '{"addresses": ["100.64.0.2", "fd00::5"], "egress": null}'),
    ]
    for route, name, text in bodies:
        write("admin_bodies", name, bytes([route]) + text.encode())


# === http_head (arbitrary-structured: raw bytes are read by `arbitrary`) ===

def http_head_seeds():
    # `arbitrary` reads enum tags as u32 LE and strings as length-prefixed
    # slices; these few byte strings just give it varied starting points.
    for i, b in enumerate([b"", b"\x00" * 16, b"\x01\x00\x00\x00" * 8,
                           b"\x02\x00\x00\x00\x01" + b"api.example.test" * 2,
                           bytes(range(64)), b"\xff" * 32]):
        write("http_head", f"start-{i}.bin", b)


# === request_rules, credentials (arbitrary-structured, like http_head) ===
# `arbitrary` 1.x: a bool is one byte (low bit), a u8 one byte, a u16/u32/u64
# little-endian, an enum tag a u32 scaled onto the variants, an Option a
# bool then the value, a Vec each element after a `true` byte and a `false`
# byte after the last (the input's last field takes the rest, unprefixed).

def tag(index, count):
    """The smallest u32 tag `arbitrary` reads as variant `index` of `count`."""
    return struct.pack("<I", -(-(index << 32) // count))


def seq(items):
    return b"".join(b"\x01" + i for i in items) + b"\x00"


def rule(deny, dest, http=None, audit=False):
    """An `Entry`: http is None, "read_only" or (method mask, [[segment]])."""
    b = bytes([deny, dest])
    if http is None:
        b += b"\x00"
    elif http == "read_only":
        b += b"\x01" + tag(0, 2)
    else:
        mask, paths = http
        b += b"\x01" + tag(1, 2) + bytes([mask]) + seq([seq([bytes([s]) for s in p]) for p in paths])
    return b + bytes([audit])


def request_rules_seeds():
    # Pools of request_rules.rs: DESTS api.test, x.test, *.x.test, *.test;
    # NAMES api.test, x.test, a.x.test, b.a.x.test, other.test; METHODS GET,
    # POST, DELETE, get, Delete, PUT, HEAD; pattern segments a, b, admin,
    # ADMIN, *; request segments a, b, admin, ADMIN, Admin, c~d, *, ., "", a.b.
    def request(names, method, segments, query, encode, upper):
        second = b"\x00" if names[1] is None else bytes([1, names[1]])
        return (bytes([names[0]]) + second + bytes([method]) + seq([bytes([s]) for s in segments])
                + bytes([query]) + struct.pack("<QQ", encode, upper))
    deny_admin = rule(1, 0, (0b110, [[2]]))
    seeds = {
        "deny-admin-any-case.bin": seq([deny_admin, rule(0, 0, (0b001, [[0, 1]]))])
        + request((0, 2), 4, [3, 0], 1, 0x5555, 0xF0F0),
        "wildcard-read-only-audit.bin": seq([rule(1, 2, "read_only", True), rule(0, 3), deny_admin])
        + request((2, None), 0, [0, 6, 1], 0, 0, 0),
        "dot-segment.bin": seq([rule(1, 1, (0, [[4, 2]])), rule(1, 1, (0b100, []))])
        + request((1, 4), 2, [0, 7, 2], 0, 2**64 - 1, 0),
    }
    for name, data in seeds.items():
        write("request_rules", name, data)
    for i, b in enumerate([b"", b"\x01" * 48, bytes(range(64))]):
        write("request_rules", f"start-{i}.bin", b)


def credentials_seeds():
    # Pools of credentials.rs: NAMES api.x.test, b.x.test, other.test,
    # x.test; HEADERS authorization, x-api-key, cookie, x-note, Accept; TEXT
    # "Bearer ", "key=", " ", ",", "%", "%25", "5F", "/", "?k="; placeholders
    # alpha, bravo, charlie.
    def text(i):
        return tag(0, 3) + bytes([i])

    def placeholder(which, escape=0, twice=False, lower=False):
        return tag(2, 3) + bytes([which]) + struct.pack("<I", escape) + bytes([twice, lower])

    def header(pool, pieces):
        return tag(0, 2) + bytes([pool]) + seq(pieces)
    seeds = {
        "alpha-in-authorization.bin": tag(0, 2) + b"\x00" + seq([text(7)])
        + seq([header(0, [text(0), placeholder(0)])]) + struct.pack("<H", 4096),
        "bravo-in-cookie-too-large.bin": tag(0, 2) + b"\x01" + seq([text(7)])
        + seq([header(2, [text(1), placeholder(1)]), header(3, [placeholder(1)])]) + struct.pack("<H", 40),
        "escaped-charlie-unverified.bin": tag(1, 2) + b"\x0f" + seq([text(7), text(8), placeholder(2, 0x55, True)])
        + seq([header(1, [placeholder(2, 0x3, False, True)])]) + struct.pack("<H", 65535),
    }
    for name, data in seeds.items():
        write("credentials", name, data)
    for i, b in enumerate([b"", b"\x01" * 48, bytes(range(64))]):
        write("credentials", f"start-{i}.bin", b)

# === machine_policy ===

def machine_seeds():
    docs = {
        "allowlist.json": MACHINE,
        "nested.json": MACHINE_NESTED,
        "loopback.json": "{}",
        "open.json": '{"mode": "open"}',
        "rules-no-mode.json": '{"rules": [{"cidr": "192.0.2.1", "proto": "udp"}]}',
        "five-entries.json": json.dumps({"mode": "allowlist", "rules": [
            {"cidr": "10.0.0.0/8", "proto": "tcp", "port": p} for p in (1, 2, 3, 4)] + [
            {"cidr": "10.1.0.0/16", "proto": "udp"}]}),
        "ipv6.json": '{"mode": "allowlist", "rules": [{"cidr": "::ffff:10.0.0.0/104"}]}',
        "port-without-proto.json": '{"mode": "allowlist", "rules": [{"cidr": "10.0.0.0/8", "port": 80}]}',
        "repeated-key.json": '{"mode": "open", "mode": "loopback"}',
    }
    for name, text in docs.items():
        write("machine_policy", name, text)


# === nflog_messages ===

def nflog_seeds():
    """Datagrams of the NFLOG group as the kernel sends them (host byte
    order for netlink headers, little-endian here)."""
    def nla(kind, value):
        b = struct.pack("<HH", 4 + len(value), kind) + value
        return b + b"\0" * (-len(b) % 4)

    def packet(attrs):
        body = b"".join(attrs)
        return struct.pack("<IHHII", 20 + len(body), 4 << 8, 0, 0, 0) + bytes([2, 0, 0, 7]) + body

    tcp4 = bytes([0x45, 0, 0, 60, 0, 1, 0x40, 0, 64, 6, 0, 0, 100, 64, 0, 2, 203, 0, 113, 11,
                  0xc0, 0x01, 0, 80, 0, 0, 0, 1])
    udp6 = (bytes([0x60, 0, 0, 0, 0, 16, 0, 64]) + bytes(15) + b"\x02"
            + bytes([0x20, 0x01, 0x0d, 0xb8]) + bytes(11) + b"\x53"
            + bytes([17, 0, 0, 0, 0, 0, 0, 0]) + bytes([0x30, 0x39, 0, 53, 0, 8, 0, 0]))
    ts = struct.pack(">QQ", 1_700_000_000, 250_000)
    refused = packet([nla(10, b"egm r vm-1.a\0"), nla(3, ts), nla(12 | 0x4000, struct.pack(">I", 41)),
                      nla(9, tcp4)])
    audit6 = packet([nla(10, b"egm w q\0"), nla(9, udp6)])
    ack = struct.pack("<IHHIIi", 36, 2, 0, 1, 0, -16) + bytes(16)
    write("nflog_messages", "refused-ipv4.bin", refused)
    write("nflog_messages", "would-refuse-ipv6.bin", audit6)
    write("nflog_messages", "batch-with-ack.bin", refused + ack + audit6)
    write("nflog_messages", "cut.bin", refused[:30])


def main():
    for target in ["peek_segments", "dns_answer", "policy_documents", "destinations",
                   "admin_bodies", "http_head", "machine_policy", "svcb_rewrite",
                   "nflog_messages", "request_rules", "credentials"]:
        shutil.rmtree(os.path.join(CORPUS, target), ignore_errors=True)
    peek_seeds()
    dns_seeds()
    policy_seeds()
    destination_seeds()
    admin_seeds()
    http_head_seeds()
    machine_seeds()
    svcb_seeds()
    nflog_seeds()
    request_rules_seeds()
    credentials_seeds()
    for target in sorted(os.listdir(CORPUS)):
        print(target, len(os.listdir(os.path.join(CORPUS, target))), file=sys.stderr)


if __name__ == "__main__":
    main()
