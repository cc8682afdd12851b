#!/usr/bin/env bash
# User-space instructions per request of the intercepting gateway, counted by
# valgrind's callgrind over a fixed number of requests in the benches/peers
# topology. The count does not depend on what else the machine runs, so two
# builds compare to the instruction with no rounds and no spread: an A/B for
# changes too small for benches/peers/run.sh to resolve on a shared machine
# (its CPU figures move 5-10% from round to round).
#
# What it does not see: the kernel (system calls, the network stack,
# wake-ups: two thirds of the gateway's CPU on a keep-alive request), and the
# price of an instruction. A memcpy is counted by its loop's instructions
# (glibc is told not to use `rep movsb`, which callgrind would count once per
# byte), and AES-GCM runs valgrind's CPU's code path (AES-NI and AVX, not
# VAES). Read it beside run.sh's CPU figures, never instead of them.
#
# Root; benches/peers/setup.sh once, and valgrind.
#
#   GW_BIN=/tmp/new GW_BASE_BIN=/tmp/base benches/instr.sh
#   TESTS="ka h2 bulk" N=20000 GW_BIN=… benches/instr.sh      # one build
#
# Environment (all optional):
#   GW_BIN       the build measured (default target/release/egress-gateway)
#   GW_BASE_BIN  a second build, measured the same way; the summary gives the ratio
#   TESTS        "ka h2" (default) and bulk: ka = h2load --h1 -c4 GET /1k;
#                h2 = h2load -c8 -m32 GET /1k; bulk = h2load --h1 -c2 GET /1m
#   N=20000      requests counted per test (bulk: BULK_N=200); N/10 more warm up first
#   TOP=25       functions listed by their own instructions, per run (and per test,
#                with two builds, the functions whose instructions moved most: <test>.diff)
#   KEEP_UP=1    leave the topology up afterwards
#   OUT          raw results (default /tmp/egress-peers/results/instr-<UTC time>)
#   SUMMARY_TO   copy of the summary (default benches/results/instr-<UTC time>.md); "none"
set -euo pipefail
# shellcheck source=benches/peers/lib.sh
. "$(dirname "$0")/peers/lib.sh"
eb_need_root
command -v valgrind >/dev/null || eb_die "valgrind is not installed (apt-get install -y valgrind)"
TESTS=${TESTS:-"ka h2"}
N=${N:-20000}
BULK_N=${BULK_N:-200}
TOP=${TOP:-25}
KEEP_UP=${KEEP_UP:-0}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-$EB_STATE/results/instr-$STAMP}
SUMMARY_TO=${SUMMARY_TO:-$EB_ROOT/benches/results/instr-$STAMP.md}
GW_BIN=${GW_BIN:-$EB_ROOT/target/release/egress-gateway}
for t in $TESTS; do
    case $t in ka|h2|bulk) ;; *) eb_die "unknown test $t (ka, h2, bulk)" ;; esac
done
[ "$N" -ge 100 ] && [ "$N" -le 1000000 ] || eb_die "N 100..1000000"
[ "$BULK_N" -ge 10 ] && [ "$BULK_N" -le 5000 ] || eb_die "BULK_N 10..5000"
builds=("gateway=$GW_BIN")
[ -n "${GW_BASE_BIN:-}" ] && builds+=("gateway-base=$GW_BASE_BIN")
for b in "${builds[@]}"; do [ -x "${b#*=}" ] || eb_die "no gateway binary at ${b#*=}"; done

mkdir -p "$EB_STATE" "$OUT"
exec 9>"$EB_STATE/lock"
flock -n 9 || eb_die "another benches/peers run holds $EB_STATE/lock"
STARTED=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$STARTED" = 1 ]; then
        for b in "${builds[@]}"; do "$EB_DIR/peers.sh" stop "${b%%=*}" >/dev/null 2>&1 || true; done
        "$EB_DIR/topo.sh" mode off >/dev/null 2>&1 || true
        [ "$KEEP_UP" = 1 ] || "$EB_DIR/topo.sh" down || true
    fi
    exit "$rc"
}
trap cleanup EXIT
eb_topology_fresh

# The column's binary is a wrapper that runs `run` under callgrind (and the
# CA commands as they are).
wrapper() {
    local w=$OUT/$1.sh
    cat > "$w" <<WRAP
#!/usr/bin/env bash
[ "\$1" = run ] || exec "$2" "\$@"
export GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=4294967295:glibc.cpu.x86_rep_stosb_threshold=4294967295
exec valgrind --tool=callgrind --separate-threads=no --dump-instr=no \\
    --callgrind-out-file="$OUT/callgrind.$1.%p" "$2" "\$@"
WRAP
    chmod +x "$w"
    echo "$w"
}

load() { # TEST COUNT
    local url=https://$ORIGIN_HOST
    case $1 in
        ka) eb_in "$NS_CL" timeout 600 h2load --h1 -t1 -c4 -n "$2" "$url/1k" ;;
        h2) eb_in "$NS_CL" timeout 600 h2load -t1 -c8 -m32 -n "$2" "$url/1k" ;;
        bulk) eb_in "$NS_CL" timeout 600 h2load --h1 -t1 -c2 -n "$2" "$url/1m" ;;
    esac
}

measure() { # COLUMN BINARY TEST -> "instructions per request" on stdout
    local col=$1 bin=$2 test=$3 n=$N wpid vpid file done
    [ "$test" = bulk ] && n=$BULK_N
    case $col in
        gateway) GW_BIN=$(wrapper "$col" "$bin") MODE=intercept "$EB_DIR/peers.sh" start "$col" >/dev/null ;;
        gateway-base) GW_BASE_BIN=$(wrapper "$col" "$bin") MODE=intercept "$EB_DIR/peers.sh" start "$col" >/dev/null ;;
    esac
    # shellcheck disable=SC2046
    "$EB_DIR/topo.sh" mode $("$EB_DIR/peers.sh" ports "$col") >/dev/null
    wpid=$(eb_pid_of "peer-$col")
    vpid=$(pgrep -P "$wpid" | head -1)
    [ -n "$vpid" ] || eb_die "$col: no process under its wrapper"
    load "$test" $((n / 10)) > "$OUT/$test-$col.warm" 2>&1 || eb_die "$test/$col warm-up failed (see $OUT/$test-$col.warm)"
    callgrind_control -z "$vpid" >/dev/null
    load "$test" "$n" > "$OUT/$test-$col.load" 2>&1 || eb_die "$test/$col load failed (see $OUT/$test-$col.load)"
    done=$(awk '/^requests:/ {print $8}' "$OUT/$test-$col.load")
    [ "$done" = "$n" ] || eb_die "$test/$col: $done of $n requests succeeded (see $OUT/$test-$col.load)"
    callgrind_control -d "$vpid" >/dev/null
    "$EB_DIR/peers.sh" stop "$col" >/dev/null 2>&1 || true
    file=$(ls -t "$OUT/callgrind.$col.$vpid".* | head -1)
    mv "$file" "$OUT/$test-$col.callgrind"
    python3 "$EB_ROOT/benches/instr-top.py" "$OUT/$test-$col.callgrind" "$n" "$TOP" > "$OUT/$test-$col.top"
    head -1 "$OUT/$test-$col.top" | awk '{print $2}'
}

{
    echo "# User-space instructions per request (callgrind), $(date -u +%FT%TZ)"
    echo
    echo "Fixed counts: ka $N (h2load --h1 -c4, 1 KiB), h2 $N (-c8 -m32, 1 KiB), bulk $BULK_N (--h1 -c2, 1 MiB)."
    echo "gw_bin: $GW_BIN${GW_BASE_BIN:+; gw_base_bin: $GW_BASE_BIN}; raw: $OUT"
    echo
    if [ -n "${GW_BASE_BIN:-}" ]; then
        echo "| test | gateway | gateway-base | gateway ÷ base |"
        echo "|---|---:|---:|---:|"
    else
        echo "| test | gateway |"
        echo "|---|---:|"
    fi
} > "$OUT/summary.md"
for t in $TESTS; do
    row="| $t"
    declare -A per=()
    for b in "${builds[@]}"; do
        eb_log "$t: ${b%%=*}"
        per[${b%%=*}]=$(measure "${b%%=*}" "${b#*=}" "$t")
        row+=" | ${per[${b%%=*}]}"
    done
    if [ -n "${GW_BASE_BIN:-}" ]; then
        row+=" | $(awk -v a="${per[gateway]}" -v b="${per[gateway-base]}" 'BEGIN {printf "%.4f", a / b}')"
        n=$N; [ "$t" = bulk ] && n=$BULK_N
        python3 "$EB_ROOT/benches/instr-top.py" "$OUT/$t-gateway.callgrind" "$n" "$TOP" \
            --diff "$OUT/$t-gateway-base.callgrind" "$n" > "$OUT/$t.diff"
    fi
    echo "$row |" >> "$OUT/summary.md"
    unset per
done
echo >> "$OUT/summary.md"
echo "Each run's functions by their own instructions: $OUT/<test>-<column>.top; with two builds, where they differ: $OUT/<test>.diff" >> "$OUT/summary.md"
cat "$OUT/summary.md"
[ "$SUMMARY_TO" = none ] || cp "$OUT/summary.md" "$SUMMARY_TO"
