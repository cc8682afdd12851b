#!/usr/bin/env python3
"""Generates sample-flows.jsonl: a few thousand realistic flows of one sandbox
(package registries, git, an API, a TURN relay, a blocked site, cloud metadata,
a deb mirror over plain HTTP, a stray address) in the gateway's flow-log format,
with the verdicts sample-policy.json gives them. Deterministic (seeded).

    python3 benches/replay/make-sample.py > benches/replay/sample-flows.jsonl
"""
import json
import random

rng = random.Random(20261130)

# name, address, port, verdict, reason, weight, (min, max) bytes down, attributed
KINDS = [
    ("registry.npm.example.test", "203.0.113.40", 443, "intercept", "not_exempt", 30, (800, 40_000), True),
    ("files.pypi.example.test", "203.0.113.41", 443, "intercept", "not_exempt", 15, (2_000, 60_000), True),
    ("crates.example.test", "203.0.113.42", 443, "intercept", "not_exempt", 10, (1_000, 30_000), True),
    ("api.example.test", "203.0.113.10", 443, "intercept", "not_exempt", 20, (200, 8_000), True),
    ("git.example.test", "203.0.113.43", 443, "splice", "exempt", 10, (5_000, 80_000), True),
    ("turn.example.test", "203.0.113.30", 443, "splice", "exempt", 3, (0, 0), True),
    ("blocked.example.test", "203.0.113.44", 443, "deny", "tenant_deny", 4, (0, 0), True),
    ("deb.example.test", "198.51.100.21", 80, "allow", "allow_attributed_name", 4, (1_000, 50_000), True),
    (None, "169.254.169.254", 80, "deny", "platform_deny", 2, (0, 0), False),
    ("unknown.example.test", "203.0.113.99", 443, "deny", "no_dns_seen", 2, (0, 0), False),
]
COUNT = 3000

weights = [k[5] for k in KINDS]
t = 0.0
for i in range(COUNT):
    name, ip, port, verdict, reason, _, (lo, hi), attributed = rng.choices(KINDS, weights)[0]
    t += rng.expovariate(5.0)
    tls = port == 443
    down = rng.randint(lo, hi) if hi else 0
    flow = {
        "ts": "2026-11-29T%02d:%02d:%06.3fZ" % (10 + int(t) // 3600, int(t) % 3600 // 60, t % 60),
        "sandbox": "sb1",
        "src": "100.64.1.2:%d" % rng.randint(32768, 60999),
        "dst": "%s:%d" % (ip, port),
        "sni": name if tls else None,
        "host": name if not tls else (name if verdict == "intercept" else None),
        "attributed": [name] if attributed else [],
        "verdict": verdict,
        "reason": reason,
        "detail": "",
        "bytes_up": rng.randint(300, 2_000) if verdict != "deny" else 0,
        "bytes_down": down,
        "duration_ms": rng.randint(2, 900),
        "offset_s": round(t, 3),
    }
    print(json.dumps(flow, separators=(",", ":")))
