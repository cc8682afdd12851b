#!/usr/bin/env bash
# Machine egress at node scale: what the kernel path costs a VM when 1, 100
# or 500 VMs are registered, against no table at all, and how fast a policy
# applies at 500.
#
#   sudo benches/machine-egress.sh   # ROUNDS=12 SECONDS_PER=2 COUNTS="1 100 500" JOBS=4
#   sudo BUILD=0 GW_BIN=.../egress-gateway LOAD_BIN=.../egress-l4load benches/machine-egress.sh
#                                    # binaries already built: no cargo build
#   PROFILE=debug LOAD_PROFILE=release  # a debug gateway (it only applies
#                                       # rules), a release load generator
#
# Every variant has a path of its own, built once and kept for the whole
# run: three namespaces, all on 100.64.0.0/10 and 203.0.113.0/24 and
# nothing else: a VM stand-in (100.64.4.2), a gateway namespace forwarding
# only the VM's veth, and an origin (203.0.113.80) running `egress-l4load
# serve`. The `none` path runs no gateway: its forwarding has no machine
# egress table at all. Each count in COUNTS has a path running its own
# egress-gateway with that many VMs, registered once at setup (the others
# JOBS requests at a time, progress on stderr): the measured VM, registered
# with its link (anti-spoofing on), and count-1 others (100.65.x.y, no
# traffic). Every VM has a 256-rule allowlist; the measured VM's last two
# rules allow the origin. Before the rounds, each count's path is checked:
# its table holds that many VM chains, and a connection to a port outside
# the allowlist is refused and counted.
#
# Then ROUNDS short rounds. Each measures every variant once, in an order
# that changes per round (the list rotated every second round, reversed in
# even rounds): TCP connects/s (CONCURRENCY, 8, at a time, the server closes first), then
# bulk MiB/s on one connection, SECONDS_PER seconds each. Every ratio is
# taken within a round: each count against that round's `none`, and each
# count against that round's smallest count; the report gives the median,
# the interquartile range and the range of the per-round ratios, and says
# which interquartile ranges are wider than 3 points. Each run also reads
# the machine's busy CPU (/proc/stat) around it: CPU per 1k connects and per
# GiB, and their cost ratios. PIN=<cpu> runs every origin server and every
# load run on that one CPU (taskset): the connect and bulk paths, kernel
# forwarding included (a veth delivers in its sender's context), then share
# one core and keep it busy, so a rate is CPU-bound and idle gaps and the
# other core's noise do not move it; unset, they run where the scheduler
# puts them. Then PERF_ROUNDS (3) interleaved connect runs
# per variant under `perf record -a` give netfilter's share of the busy CPU,
# which idle gaps do not move (PERF_ROUNDS=0 skips it; PERF_KEEP=<dir> keeps
# each run's report there, perf-<variant>-<round>.txt). After the rounds, on
# the largest count's gateway: 20 policy applies of 256 rules (each a
# different policy), p50/p99 ms; the ruleset's size as text and the slab
# the kernel frees when the table is deleted; each gateway's RSS.
#
# Prints a Markdown section on stdout and progress on stderr. Every process
# it starts is stopped by PID and every namespace and the temp dir removed
# on exit, on failure and on Ctrl-C too.
set -euo pipefail
shopt -s inherit_errexit
root=$(cd "$(dirname "$0")/.." && pwd)
rounds=${ROUNDS:-12}
secs=${SECONDS_PER:-2}
counts=${COUNTS:-1 100 500}
jobs=${JOBS:-4}
conc=${CONCURRENCY:-8}
pin=${PIN:-}
build=${BUILD:-1}
profile=${PROFILE:-release}
load_profile=${LOAD_PROFILE:-$profile} # the load generator's own profile
target=${CARGO_TARGET_DIR:-$root/target}

die() {
    echo "machine-egress.sh: $*" >&2
    exit 1
}
posint() { # $1: name, $2: value
    [[ $2 =~ ^[1-9][0-9]{0,5}$ ]] || die "$1 must be a positive integer, got '$2'"
}
posint ROUNDS "$rounds"
posint SECONDS_PER "$secs"
posint JOBS "$jobs"
posint CONCURRENCY "$conc"
[ -z "$pin" ] || [[ $pin =~ ^[0-9]{1,3}$ && $pin -lt $(nproc) ]] || die "PIN must be a CPU number below $(nproc), got '$pin'"
# The load's command prefix: taskset onto PIN's CPU, or nothing.
pinned=()
[ -z "$pin" ] || pinned=(taskset -c "$pin")
read -r -a counts_arr <<< "$counts"
[ "${#counts_arr[@]}" -gt 0 ] || die "COUNTS is empty"
for n in "${counts_arr[@]}"; do
    posint "COUNTS entry" "$n"
    [ "$n" -le 60000 ] || die "COUNTS entry must be at most 60000 (the others' addresses), got '$n'"
done
read -r -a counts_arr <<< "$(printf '%s\n' "${counts_arr[@]}" | sort -n | uniq | tr '\n' ' ')"
largest=${counts_arr[${#counts_arr[@]} - 1]}
variants=(none "${counts_arr[@]}")
[ "$(id -u)" = 0 ] || die "needs root (network namespaces, nftables)"

flag() { if [ "$1" = release ]; then echo --release; fi; }
case $build in
    0) ;;
    1)
        read -r -a gw_flags <<< "$(flag "$profile")"
        read -r -a load_flags <<< "$(flag "$load_profile")"
        cargo build "${gw_flags[@]}" --quiet -p egress-gateway --bins --manifest-path "$root/Cargo.toml"
        cargo build "${load_flags[@]}" --quiet -p egress-benches --bin egress-l4load --manifest-path "$root/Cargo.toml"
        ;;
    *) die "BUILD must be 0 or 1, got '$build'" ;;
esac
gw=${GW_BIN:-$target/$profile/egress-gateway}
load=${LOAD_BIN:-$target/$load_profile/egress-l4load}
[ -x "$gw" ] || die "GW_BIN: no executable at '$gw'"
[ -x "$load" ] || die "LOAD_BIN: no executable at '$load'"

tag=$$
state=$(mktemp -d /tmp/egress-machine-bench.XXXXXX)
pids=()    # every background process this script starts
made_ns=() # every namespace this script made
declare -A gwpid=()
alive() { # $1: pid; a zombie is not alive
    local s
    s=$(ps -o stat= -p "$1" 2> /dev/null) || return 1
    [[ $s != Z* ]]
}
stop_pid() { # $1: pid; TERM, at most 10 s, then KILL
    local _
    kill "$1" 2> /dev/null || true
    for _ in $(seq 100); do
        alive "$1" || break
        sleep 0.1
    done
    kill -KILL "$1" 2> /dev/null || true
    wait "$1" 2> /dev/null || true
}
cleanup() {
    set +e
    trap '' INT TERM # a second Ctrl-C does not cut the cleanup short
    local p ns
    for p in "${pids[@]}"; do kill "$p" 2> /dev/null; done
    for p in "${pids[@]}"; do stop_pid "$p"; done
    for ns in "${made_ns[@]}"; do ip netns del "$ns"; done
    rm -rf "$state"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ns_of() { echo "meb-$tag-$1-$2"; } # $1: variant, $2: vm, gw or or
make_path() { # $1: variant. The VM, the gateway namespace, the origin and its server.
    local vmns gwns orns ns l _
    vmns=$(ns_of "$1" vm) gwns=$(ns_of "$1" gw) orns=$(ns_of "$1" or)
    for ns in $vmns $gwns $orns; do
        ip netns add "$ns"
        made_ns+=("$ns")
        ip -n "$ns" link set lo up
        ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1
    done
    ip -n "$gwns" link add vm1 type veth peer name eth0 netns "$vmns"
    ip -n "$gwns" link add or1 type veth peer name eth0 netns "$orns"
    ip -n "$gwns" addr add 100.64.4.1/30 dev vm1
    ip -n "$gwns" addr add 100.64.5.1/30 dev or1
    ip -n "$vmns" addr add 100.64.4.2/30 dev eth0
    ip -n "$orns" addr add 100.64.5.2/30 dev eth0
    ip -n "$orns" addr add 203.0.113.80/32 dev lo
    for l in "$gwns vm1" "$gwns or1" "$vmns eth0" "$orns eth0"; do
        read -r ns ifname <<< "$l"
        ip -n "$ns" link set "$ifname" up
    done
    ip -n "$vmns" route add default via 100.64.4.1
    ip -n "$gwns" route add 203.0.113.0/24 via 100.64.5.2
    ip -n "$orns" route add 100.64.0.0/10 via 100.64.5.1
    ip netns exec "$gwns" sysctl -qw net.ipv4.ip_forward=1
    # Only the VM's traffic and replies to it are forwarded.
    ip netns exec "$gwns" nft -f - <<'NFT'
table inet bench_forward {
    chain forward {
        type filter hook forward priority 0; policy drop;
        iifname "vm1" oifname "or1" accept
        iifname "or1" oifname "vm1" ct state established,related accept
    }
}
NFT
    mkdir -p "$state/$1"
    ip netns exec "$orns" "${pinned[@]}" "$load" serve --listen 203.0.113.80:9000 --close-at 203.0.113.80:9001 > "$state/$1/serve.out" 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do
        grep -q ready "$state/$1/serve.out" && return 0
        alive "${pids[-1]}" || break
        sleep 0.1
    done
    cat "$state/$1/serve.out" >&2
    die "the origin server of the $1 path did not become ready"
}

gateways_alive() { # a gateway that exited (a crash, a Ctrl-C) ends the run
    local n
    for n in "${!gwpid[@]}"; do
        alive "${gwpid[$n]}" || die "the gateway of the $n-VM path exited: $(tail -c 2000 "$state/$n/gateway.err")"
    done
}
admin_to() { # $1: reply file, $2: count, $3: method, $4: path, [$5: body]
    ip netns exec "$(ns_of "$2" gw)" curl -s --max-time 30 -o "$1" -w '%{http_code} %{time_total}' \
        -X "$3" -H 'content-type: application/json' ${5:+--data-binary "$5"} "http://127.0.0.1:15000$4"
}
admin() { admin_to "$state/$1/reply" "$@"; } # $1: count, then as admin_to
start_gateway() { # $1: count
    cat > "$state/$1/gateway.toml" <<TOML
state_dir = "$state/$1/gw"
[listen]
transparent = "127.0.0.1:0"
dns = "127.0.0.1:0"
dns_alt = "127.0.0.1:0"
admin = "127.0.0.1:15000"
[log]
flow_log = "off"
TOML
    RUST_LOG=warn ip netns exec "$(ns_of "$1" gw)" "$gw" run --config "$state/$1/gateway.toml" 2>> "$state/$1/gateway.err" &
    gwpid[$1]=$!
    pids+=($!)
}
wait_ready() { # $1: count
    local _
    for _ in $(seq 600); do
        [ "$(admin "$1" GET /readyz | cut -d' ' -f1)" = 200 ] && return 0
        alive "${gwpid[$1]}" || break
        sleep 0.1
    done
    cat "$state/$1/gateway.err" >&2
    die "the gateway of the $1-VM path did not become ready"
}

# 256 rules: 254 that do not match the origin, then the two that do.
rules() { # $1: port offset, so each policy differs
    local out="" i
    for i in $(seq 0 253); do out+="{\"cidr\": \"10.$((i % 256)).0.0/16\", \"proto\": \"tcp\", \"port\": $((1000 + i + $1))},"; done
    printf '{"mode": "allowlist", "rules": [%s{"cidr": "203.0.113.0/24", "proto": "tcp", "port": 9000}, {"cidr": "203.0.113.0/24", "proto": "tcp", "port": 9001}]}' "$out"
}
policies=()
for i in $(seq 0 7); do policies[i]=$(rules "$i"); done

register() { # $1: reply file, $2: count, $3: VM id, $4: body
    local out
    out=$(admin_to "$1" "$2" PUT "/v1/vms/$3" "$4") || true
    [ "${out%% *}" = 200 ] && return 0
    echo "registering $3 on the $2-VM path: HTTP ${out%% *}: $(head -c 500 "$1" 2> /dev/null)" >&2
    return 1
}
register_worker() { # $1: worker number; registers the "count index" lines of its work file
    local n i
    while read -r n i; do
        register "$state/reply.w$1" "$n" "o$i" \
            "{\"addresses\": [\"100.65.$((i / 250)).$((i % 250 + 1))\"], \"egress\": ${policies[i % 7 + 1]}}" || exit 1
        echo >> "$state/done.w$1"
    done < "$state/work.$1"
}
register_others() { # the count-1 others of every path, JOBS requests at a time
    local n i w p total done_n running=0 _ wpids=()
    for ((i = 0; i < largest - 1; i++)); do
        for n in "${counts_arr[@]}"; do
            if [ "$i" -lt $((n - 1)) ]; then echo "$n $i"; fi
        done
    done > "$state/work"
    total=$(wc -l < "$state/work")
    for ((w = 0; w < jobs; w++)); do
        awk -v j="$jobs" -v w="$w" 'NR % j == w' "$state/work" > "$state/work.$w"
        : > "$state/done.w$w"
        [ -s "$state/work.$w" ] || continue
        register_worker "$w" &
        wpids+=($!)
        pids+=($!)
    done
    for _ in $(seq 1800); do # an hour at most
        done_n=$(cat "$state"/done.w* | wc -l)
        echo "registered $done_n/$total others" >&2
        gateways_alive
        running=0
        for p in "${wpids[@]}"; do if alive "$p"; then running=1; fi; done
        [ "$running" = 1 ] || break
        sleep 2
    done
    [ "$running" = 0 ] || die "registering the others took over an hour"
    for p in "${wpids[@]}"; do
        wait "$p" || die "registering the others failed (see above)"
    done
}
check_judged() { # $1: count. A port outside the allowlist is refused and counted.
    local gwns packets
    gwns=$(ns_of "$1" gw)
    if ip netns exec "$(ns_of "$1" vm)" timeout --foreground 2 bash -c 'exec 3<> /dev/tcp/203.0.113.80/9002' 2> /dev/null; then
        die "the $1-VM path let a connection to 203.0.113.80:9002 through (not in the allowlist)"
    fi
    packets=$(ip netns exec "$gwns" nft list counter inet egress_machine refused_bench |
        sed -nE 's/.*packets ([0-9]+).*/\1/p')
    [ "${packets:-0}" -gt 0 ] || die "the $1-VM path did not count the refused connection in refused_bench"
    local chains
    chains=$(ip netns exec "$gwns" nft list table inet egress_machine | grep -cE '^[[:space:]]*chain vm_' || true)
    [ "$chains" = "$1" ] || die "the $1-VM path has $chains VM chains, not $1"
}

setup_start=$SECONDS
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for v in "${variants[@]}"; do make_path "$v"; done
for n in "${counts_arr[@]}"; do start_gateway "$n"; done
for n in "${counts_arr[@]}"; do wait_ready "$n"; done
for n in "${counts_arr[@]}"; do
    register "$state/$n/reply" "$n" bench \
        "{\"addresses\": [\"100.64.4.2\"], \"link\": \"vm1\", \"egress\": ${policies[0]}}" || die "registration failed"
done
echo "paths ready, registering the others" >&2
register_others
for n in "${counts_arr[@]}"; do check_judged "$n"; done
setup_s=$((SECONDS - setup_start))
echo "setup done in ${setup_s} s" >&2

num() { # $1: field, $2: JSON from egress-l4load; the number or a failure
    local x
    x=$(sed -nE "s/.*\"$1\":([0-9.eE+-]+).*/\1/p" <<< "$2")
    [[ $x =~ ^[0-9] ]] || die "no $1 in egress-l4load's output: $2"
    echo "$x"
}
busy() { # CPU time the whole machine spent busy so far (user, nice, system, irq, softirq), in ticks
    awk '/^cpu / {print $2 + $3 + $4 + $7 + $8}' /proc/stat
}
measure() { # $1: round, $2: variant; appends "round variant connects/s MiB/s failed-connects connects bytes busy-ticks-connect busy-ticks-bulk"
    local vmns out c f b n bytes t0 tc tb
    vmns=$(ns_of "$2" vm)
    t0=$(busy)
    out=$(timeout --foreground $((secs + 30)) ip netns exec "$vmns" "${pinned[@]}" "$load" connect --target 203.0.113.80:9001 --seconds "$secs" --concurrency "$conc")
    tc=$(($(busy) - t0))
    echo "$2 connect $out" >&2
    c=$(num per_s "$out")
    f=$(num failed "$out")
    n=$(num connects "$out")
    t0=$(busy)
    out=$(timeout --foreground $((secs + 30)) ip netns exec "$vmns" "${pinned[@]}" "$load" bulk --target 203.0.113.80:9000 --seconds "$secs")
    tb=$(($(busy) - t0))
    echo "$2 bulk $out" >&2
    b=$(num mib_per_s "$out")
    bytes=$(num bytes "$out")
    echo "$1 $2 $c $b $f $n $bytes $tc $tb" >> "$results"
}
results=$state/results
: > "$results"
nv=${#variants[@]}
for ((r = 1; r <= rounds; r++)); do
    gateways_alive
    k=$(((r - 1) / 2 % nv))
    order=("${variants[@]:k}" "${variants[@]:0:k}")
    if ((r % 2 == 0)); then
        rev=()
        for ((i = nv - 1; i >= 0; i--)); do rev+=("${order[i]}"); done
        order=("${rev[@]}")
    fi
    for v in "${order[@]}"; do
        measure "$r" "$v"
    done
    echo "round $r/$rounds done (order: ${order[*]})" >&2
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

# Where the CPU goes: `perf record -a` during a connect run of each variant
# (PERF_ROUNDS times, interleaved), and the share of the machine's busy
# samples that netfilter's rule evaluation took (nft_* and its set
# back-ends, nf_hook_slow; conntrack is not counted: every variant has it).
# A share of samples does not move with idle gaps, so it resolves what the
# rates above cannot. PERF_ROUNDS=0 (or no perf) skips it.
perf_rounds=${PERF_ROUNDS:-3}
[[ $perf_rounds =~ ^[0-9]{1,3}$ ]] || die "PERF_ROUNDS must be a number, got '$perf_rounds'"
command -v perf > /dev/null || perf_rounds=0
shares=$state/shares
: > "$shares"
nft_share() { # $1: round, $2: variant; appends "round variant share-of-busy-%"
    local vmns lp data report
    vmns=$(ns_of "$2" vm)
    data=$state/perf.data
    timeout --foreground $((secs + 30)) ip netns exec "$vmns" "${pinned[@]}" "$load" connect --target 203.0.113.80:9001 \
        --seconds $((secs + 1)) --concurrency "$conc" > /dev/null &
    lp=$!
    pids+=("$lp")
    sleep 0.5
    perf record -q -a -o "$data" -- sleep "$secs" > /dev/null 2>&1 || die "perf record failed"
    wait "$lp" || die "the connect run under perf failed"
    report=$(perf report -i "$data" --no-children --sort symbol --stdio 2> /dev/null)
    [ -z "${PERF_KEEP:-}" ] || echo "$report" > "$PERF_KEEP/perf-$2-$1.txt"
    awk -v r="$1" -v v="$2" '
        $1 ~ /%$/ { p = $1; sub(/%/, "", p); seen++
                    if ($3 ~ /^(nft_|__nft_|nf_tables_|nf_hook_slow|pipapo_)/) n += p
                    if ($3 ~ /(safe_halt|cpuidle|default_idle|intel_idle|poll_idle|acpi_idle|mwait)/) i += p }
        END { if (!seen || i >= 100) { print "no busy samples" > "/dev/stderr"; exit 1 }
              printf "%s %s %.3f\n", r, v, 100 * n / (100 - i) }' <<< "$report" >> "$shares" || {
        echo "perf saw no busy CPU in the $2 connect run" >&2
        return 1
    }
    rm -f "$data"
}
for ((r = 1; r <= perf_rounds; r++)); do
    for v in "${variants[@]}"; do
        # perf now and then writes a file its report finds no samples in: once more, then fail
        nft_share "$r" "$v" 2> /dev/null || nft_share "$r" "$v"
    done
    echo "perf round $r/$perf_rounds done" >&2
done

applies=$state/applies
: > "$applies"
for i in $(seq 20); do
    out=$(admin "$largest" PUT /v1/vms/bench/network/egress "$(rules "$i")") || true
    [ "${out%% *}" = 200 ] || {
        cat "$state/$largest/reply" >&2
        die "policy apply $i at $largest VMs: HTTP ${out%% *}"
    }
    echo "${out#* }" >> "$applies"
done
rss=""
for n in "${counts_arr[@]}"; do
    rss+="$n:$(awk '/^VmRSS:/ {print $2}' "/proc/${gwpid[$n]}/status") "
done
gwns=$(ns_of "$largest" gw)
# The node table, and the links' table when the gateway checks links on
# their ingress hook (machine_egress.link_check).
ruleset_bytes=$({
    ip netns exec "$gwns" nft list table inet egress_machine
    ip netns exec "$gwns" nft list table netdev egress_machine 2> /dev/null || true
} | wc -c)
slab_with=$(awk '/^Slab:/ {print $2}' /proc/meminfo)
stop_pid "${gwpid[$largest]}"
ip netns exec "$gwns" nft delete table inet egress_machine 2> /dev/null || true
ip netns exec "$gwns" nft delete table netdev egress_machine 2> /dev/null || true
sleep 1
slab_without=$(awk '/^Slab:/ {print $2}' /proc/meminfo)
echo "$ruleset_bytes $slab_with $slab_without" > "$state/memory"
echo "--- raw: round variant connects/s MiB/s failed-connects connects bytes busy-ticks-connect busy-ticks-bulk" >&2
cat "$results" >&2

python3 - "$results" "$applies" "$state/memory" "$secs" "${counts_arr[*]}" "$setup_s" "$jobs" \
    "$load_before" "$load_after" "$rss" "$(getconf CLK_TCK)" "$shares" "$conc" "${pin:-}" <<'PY'
import sys, statistics as st
(results, applies_f, memory_f, secs, counts, setup_s, jobs,
 load_before, load_after, rss, ticks, shares_f, conc, pin) = sys.argv[1:]
counts = counts.split()
smallest, largest = counts[0], counts[-1]
by = {}  # variant -> {round: (connects/s, MiB/s, failed)}
tick_ms = 1000 / int(ticks)
for line in open(results):
    r, label, c, b, f, n, nbytes, tc, tb = line.split()
    # The machine's busy CPU per 1k connects (ms) and per GiB (s): what a
    # connection costs everything on the path, the load generator and the
    # origin included; idle gaps (a descheduled VM, a neighbour's burst)
    # move the rates above but not this.
    cpu_c = int(tc) * tick_ms / (int(n) / 1000) if int(n) else float("nan")
    cpu_b = int(tb) * tick_ms / 1000 / (int(nbytes) / 2**30) if int(nbytes) else float("nan")
    by.setdefault(label, {})[r] = (float(c), float(b), int(f), cpu_c, cpu_b)
rounds_seen = sorted(by["none"], key=int)
med = st.median
vms = lambda n: f"{n} VM" if n == "1" else f"{n} VMs"

def quartiles(xs):
    if len(xs) < 2:
        return xs[0], xs[0]
    q = st.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]

def ratios(num, den, i):
    return [by[num][r][i] / by[den][r][i] for r in rounds_seen]

def show(xs):
    q1, q3 = quartiles(xs)
    return f"{med(xs):.3f}× (IQR {q1:.3f}–{q3:.3f}, range {min(xs):.3f}–{max(xs):.3f})"

def width(xs):
    q1, q3 = quartiles(xs)
    return (q3 - q1) * 100

print(f"### Machine egress at node scale ({len(rounds_seen)} interleaved round"
      f"{'' if len(rounds_seen) == 1 else 's'}, {secs} s per figure)\n")
print("Every variant is a path of its own, measured in turn within each round; ratios are per round "
      "(median of the rounds' ratios, their interquartile range, their range)."
      + (f" Origins and load runs pinned to CPU {pin}.\n" if pin else "\n"))
none = [by["none"][r] for r in rounds_seen]
widths = {"connects": [], "bulk": [], "CPU per connect": [], "CPU per GiB": []}

def against_none(columns):
    """One table against no table: columns are (heading, index, format, width key) x 2."""
    (h1, i1, f1, w1), (h2, i2, f2, w2) = columns
    print(f"| VMs registered | {h1} | ratio to no table | {h2} | ratio to no table |")
    print("|---|---|---|---|---|")
    print(f"| no table | {med(x[i1] for x in none):{f1}} | 1 | {med(x[i2] for x in none):{f2}} | 1 |")
    for n in counts:
        rs = [by[n][r] for r in rounds_seen]
        r1, r2 = ratios(n, "none", i1), ratios(n, "none", i2)
        widths[w1].append((width(r1), f"{n} against no table"))
        widths[w2].append((width(r2), f"{n} against no table"))
        print(f"| {n} | {med(x[i1] for x in rs):{f1}} | {show(r1)} | {med(x[i2] for x in rs):{f2}} | {show(r2)} |")

against_none([(f"TCP connects/s ({conc} at a time)", 0, ".0f", "connects"),
              ("bulk MiB/s (one connection)", 1, ".0f", "bulk")])
print("\nWhat the machine spent (busy CPU, every process and the kernel: the load generator and the "
      "origin too) per 1k connects and per GiB of bulk; the ratios are of cost, per round "
      "(above 1: the table costs more):\n")
against_none([("CPU ms per 1k connects", 3, ".1f", "CPU per connect"),
              ("CPU s per GiB", 4, ".2f", "CPU per GiB")])
if len(counts) > 1:
    print(f"\nAgainst the smallest count ({vms(smallest)}), per round:\n")
    print(f"| VMs registered | connects/s ratio to {smallest} | bulk ratio to {smallest} | CPU per connect, cost ratio to {smallest} | CPU per GiB, cost ratio to {smallest} |")
    print("|---|---|---|---|---|")
    for n in counts[1:]:
        cr, br = ratios(n, smallest, 0), ratios(n, smallest, 1)
        cc, cb = ratios(n, smallest, 3), ratios(n, smallest, 4)
        widths["connects"].append((width(cr), f"{n} against {smallest}"))
        widths["bulk"].append((width(br), f"{n} against {smallest}"))
        widths["CPU per connect"].append((width(cc), f"{n} against {smallest}"))
        widths["CPU per GiB"].append((width(cb), f"{n} against {smallest}"))
        print(f"| {n} | {show(cr)} | {show(br)} | {show(cc)} | {show(cb)} |")
print()
for what, ws in widths.items():
    if len(rounds_seen) < 2:
        print(f"- Spread, {what}: one round only, so there is no spread to report.")
        continue
    w, which = max(ws)
    over = [x for x in ws if x[0] > 3]
    text = (f"{len(over)} of {len(ws)} ratio IQRs are wider than 3 points, so these rounds do not "
            f"resolve a 3% difference there" if over else f"every ratio IQR is within 3 points")
    print(f"- Spread, {what}: the widest IQR is {w:.1f} points ({which}); {text}.")
failed = {v: sum(by[v][r][2] for r in rounds_seen) for v in ["none"] + counts}
print(f"- Failed connects (no close within a second), summed over the rounds: "
      + ", ".join(f"{'no table' if v == 'none' else v} {f}" for v, f in failed.items()) + ".")
print(f"- Setup: {len(counts) + 1} paths, {vms(str(sum(int(n) for n in counts)))} registered "
      f"({jobs} request{'' if jobs == '1' else 's'} at a time), {float(setup_s):.0f} s. "
      f"Load average (1, 5, 15 min) "
      f"before: {load_before}; after the rounds: {load_after}.")

shares = {}
for line in open(shares_f):
    r, v, x = line.split()
    shares.setdefault(v, []).append(float(x))
if shares:
    n_perf = len(shares["none"])
    print(f"\nNetfilter's rule evaluation (nft_*, its set back-ends, nf_hook_slow; not conntrack, which "
          f"every variant has) as a share of the machine's busy CPU during a connect run, from "
          f"`perf record -a` ({n_perf} interleaved run{'' if n_perf == 1 else 's'} per variant; "
          f"median, range): "
          + "; ".join(f"{'no table' if v == 'none' else vms(v)} {med(xs):.2f}% ({min(xs):.2f}–{max(xs):.2f})"
                      for v, xs in shares.items())
          + ". The difference to no table is what the machine egress table costs a connection, "
            "of all the CPU the connection costs (load generator, origin and kernel included).")

applies = sorted(float(x) * 1000 for x in open(applies_f))
p = lambda q: applies[min(len(applies) - 1, int(q * len(applies)))]
print(f"\nPolicy apply at {vms(largest)}, 256 rules, through `PUT /v1/vms/{{id}}/network/egress` "
      f"(validate, one `nft -f` transaction, fsync'd state), {len(applies)} applies: "
      f"p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms"
      + (" (the slowest of them)." if len(applies) < 100 else "."))
text_bytes, slab_with, slab_without = open(memory_f).read().split()
print(f"\nRuleset at {vms(largest)}: `nft list table` is {int(text_bytes) / 1e6:.1f} MB of text; the "
      f"kernel's slab shrank by {(int(slab_with) - int(slab_without)) / 1024:.0f} MiB when the table "
      f"was deleted (the whole machine's slab, so noisy). Gateway RSS by VM count: "
      + ", ".join(f"{vms(n)} {int(k) / 1024:.0f} MiB"
                 for n, k in (x.split(":") for x in rss.split())) + ".")
PY
