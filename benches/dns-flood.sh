#!/usr/bin/env bash
# A DNS query flood from 1,000 sandboxes through the gateway's listener, and
# the gateway's memory before, during and after it, beside the bounds the
# docs state (issue 26: "a 1,000-sandbox query flood stays within its memory
# bound").
#
#   unshare -n sh -c 'ip link set lo up && benches/dns-flood.sh'   # loopback only (root)
#   SANDBOXES=1000 COUNT=1000000 CONC=256 FLOODS=2 benches/dns-flood.sh
#   SKIP_BUILD=1 benches/dns-flood.sh        # the release binaries as they are
#
# The upstream is `egress-dnsload serve --spread` on 127.0.0.1:26353: every
# name gets its own address in 10.0.0.0/8, so every answer the gateway lets
# through attributes a new address (the attribution cache's worst case). The
# release gateway answers for 8.8.8.8 on 127.0.0.1:26053 with the default
# budgets (500 queries a second and 1,000 new names a minute per sandbox).
# SANDBOXES sandboxes are registered at 127.1.0.1, 127.1.0.2, … (any 127/8
# address is local on Linux: no root needed, but run it in `unshare -n` to be
# sure nothing leaves), each with the resolver and *.bench.test allowed.
# Each flood is one generator sending COUNT queries, every one for a new
# name, CONC (256) outstanding, each worker asking from its share of the
# sandboxes' addresses in turn, so every sandbox floods at once; FLOODS
# floods back to back. RSS is read from
# /proc (VmRSS, and VmHWM: the peak) after registration, after each flood,
# and sampled every 0.5 s during it. Prints a Markdown section on stdout.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
sandboxes=${SANDBOXES:-1000}
count=${COUNT:-1000000}
conc=${CONC:-256}
floods=${FLOODS:-2}
up_addr=127.0.0.1:26353
dns_addr=127.0.0.1:26053
admin=127.0.0.1:26000
# shellcheck source=benches/dns-bench-lib.sh
source "$root/benches/dns-bench-lib.sh"
dns_bench_setup dns-flood

"$load" serve --listen "$up_addr" --spread > "$state/upstream.out" &
pids+=($!)

python3 - "$sandboxes" > "$state/snapshot.json" <<'EOF'
import json, sys
n = int(sys.argv[1])
policy = {"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"wildcard_domain": "*.bench.test"}]}
boxes = [{"id": f"flood-{i}", "addresses": [f"127.1.{(i + 1) >> 8}.{(i + 1) & 255}"], "policy": policy}
         for i in range(n)]
print(json.dumps({"version": 1, "sandboxes": boxes}))
EOF
cat > "$state/gateway.toml" <<EOF
state_dir = "$state"
[listen]
transparent = "127.0.0.1:0"
dns = "$dns_addr"
dns_alt = "127.0.0.1:0"
admin = "$admin"
[dns]
upstreams = ["$up_addr"]
[log]
flow_log = "off"
EOF
RUST_LOG=warn "$gw" run --config "$state/gateway.toml" 2> "$state/gateway.err" &
gw_pid=$!
pids+=($gw_pid)
for _ in $(seq 100); do
    curl -sf "http://$admin/readyz" >/dev/null 2>&1 && break
    sleep 0.1
done
curl -sf "http://$admin/readyz" >/dev/null || { cat "$state/gateway.err" >&2; exit 1; }

kib() { awk -v k="$1" '$1 == k":" {print $2}' "/proc/$gw_pid/status"; }
metric() { curl -sf "http://$admin/metrics" | awk -v s="$1" '$1 == s {print $2}'; }
snapshot() {
    printf '{"at": "%s", "rss_kib": %s, "hwm_kib": %s, "attributed": %s, "answered": %s, "dns_budget": %s, "overloaded": %s}\n' \
        "$1" "$(kib VmRSS)" "$(kib VmHWM)" \
        "$(metric 'egress_dns_events_total{outcome="attributed"}')" \
        "$(metric 'egress_dns_events_total{outcome="answered"}')" \
        "$(metric 'egress_dns_events_total{outcome="dns_budget"}')" \
        "$(metric 'egress_dns_events_total{outcome="overloaded"}')" >> "$state/rows.jsonl"
}

# Every sandbox is known and answers (a query each; bounded: 10 s).
timeout 30 "$load" query --target "$dns_addr" --source 127.1.0.1 --sources "$sandboxes" \
    --count "$sandboxes" --concurrency 100 --timeout-ms 2000 --deadline-s 10 --prefix warm- > "$state/warm.json"
snapshot registered
for f in $(seq "$floods"); do
    started=$(date +%s.%N)
    ( while kill -0 "$gw_pid" 2>/dev/null; do kib VmRSS >> "$state/samples-$f"; sleep 0.5; done ) &
    sampler=$!
    timeout 300 "$load" query --target "$dns_addr" --source 127.1.0.1 --sources "$sandboxes" \
        --count "$count" --concurrency "$conc" --timeout-ms 2000 --deadline-s 120 --prefix "f$f-" > "$state/flood-$f.json"
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    snapshot "flood $f"
    python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$started" "$(date +%s.%N)" > "$state/secs-$f"
done

python3 - "$state" "$sandboxes" "$count" "$conc" "$floods" <<'EOF'
import json, os, sys
state, n, count, conc, floods = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rows = [json.loads(l) for l in open(f"{state}/rows.jsonl")]
warm = json.load(open(f"{state}/warm.json"))
mib = lambda k: f"{k / 1024:.1f} MiB"
print(f"### DNS: a flood from {n:,} sandboxes ({floods} floods of {count:,} queries, {conc} outstanding, each for a new name)\n")
print(f"Warm-up: one query from each sandbox, {warm['answered']} of {n} answered, {warm['refused']} refused, {warm['failed']} failed.\n")
print("| after | VmRSS | VmHWM (peak) | gateway: answered (total) | attributed (total) | REFUSED dns_budget (total) | overloaded | generator: NOERROR / REFUSED / failed | queries/s | s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for i, r in enumerate(rows):
    g = q = s = "—"
    if i:
        fl = json.load(open(f"{state}/flood-{i}.json"))
        g = f"{fl['answered']:,} / {fl['refused']:,} / {fl['failed']:,}"
        q = f"{(fl['answered'] + fl['refused'] + fl['failed']) / fl['secs']:,.0f}"
        s = open(f"{state}/secs-{i}").read().strip()
    print(f"| {r['at']} | {mib(r['rss_kib'])} | {mib(r['hwm_kib'])} | {r['answered']:,} | {r['attributed']:,} | {r['dns_budget']:,} | {r['overloaded']:,} | {g} | {q} | {s} |")
sampled = [int(x) for f in range(1, floods + 1) for x in open(f"{state}/samples-{f}").read().split()]
print(f"\nVmRSS sampled every 0.5 s during the floods: at most {mib(max(sampled or [0]))} ({len(sampled)} samples).")
base, last = rows[0], rows[-1]
grown = (last["hwm_kib"] - base["rss_kib"]) * 1024
attributed = last["attributed"] - base["attributed"]
print()
print(f"- Growth, peak over registered: {mib(grown / 1024)} for {attributed:,} attributed answers "
      f"and {n:,} sandboxes' budgets: {grown / max(attributed, 1):.0f} B per attributed answer all included.")
print(f"- Budget table as the docs state it (about 2.2 KiB a sandbox): {n * 2.2 / 1024:.1f} MiB for {n:,}.")
print(f"- New names the default budget lets a sandbox send: 1,000 at once, then 1,000 a minute: "
      f"at most {n * 1000:,} answers in the first minute over {n:,} sandboxes.")
EOF
[ -z "${KEEP:-}" ] || cp "$state/rows.jsonl" "$KEEP"
