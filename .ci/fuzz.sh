#!/usr/bin/env bash
# Smoke-runs every fuzz target (docs/contributing.md; rustls' CI runs each for 10 s):
# builds them with `cargo +nightly fuzz build`, replays fuzz/regressions/<t>/
# (inputs that once crashed: each must pass now), then fuzzes each target for
# ${FUZZ_SECONDS:-30} seconds starting from its committed seeds,
# fuzz/corpus/<t>/. The fuzzer works on a temporary copy of the seeds, so a
# run never writes into the repository. Fails on any crash, leak, timeout or
# out-of-memory, printing the input's path and base64; prints per target the
# executions libFuzzer reports (stat::number_of_executed_units).
#
#   FUZZ_SECONDS=10 bash .ci/fuzz.sh            # every target
#   FUZZ_SECONDS=60 bash .ci/fuzz.sh dns_answer  # some targets
#
# FUZZ_BUILD=only builds and stops; FUZZ_BUILD=skip runs what is already in
# fuzz/target (.ci/run builds while its release build runs, then runs).
# FUZZ_JOBS targets run at once (default: the number of cores, at most 4),
# each fuzzing on one core; their reports print in the targets' order.
#
# Needs the nightly toolchain (libFuzzer's sanitizer flags are nightly-only);
# installs cargo-fuzz when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-30}
export CARGO_TERM_COLOR=never

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo ".ci/fuzz.sh: the nightly toolchain is not installed (rustup toolchain install nightly)" >&2
  exit 1
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "== cargo install --locked cargo-fuzz"
  cargo install --locked cargo-fuzz
fi

mapfile -t all_targets < <(cd fuzz && cargo +nightly fuzz list)
if [ "$#" -gt 0 ]; then
  targets=("$@")
else
  targets=("${all_targets[@]}")
fi
if [ "${#targets[@]}" -eq 0 ]; then
  echo ".ci/fuzz.sh: no fuzz targets" >&2
  exit 1
fi

# cargo-fuzz has no --locked (rust-fuzz/cargo-fuzz#312): check the lock file
# first, so a stale fuzz/Cargo.lock fails here instead of being rewritten.
if ! (cd fuzz && cargo +nightly metadata --locked --format-version 1 >/dev/null); then
  echo ".ci/fuzz.sh: fuzz/Cargo.lock is out of date: run 'cargo +nightly metadata --format-version 1 >/dev/null' in fuzz/ and commit it" >&2
  exit 1
fi

build=${FUZZ_BUILD:-yes}
case "$build" in
  yes | only | skip) ;;
  *) echo ".ci/fuzz.sh: FUZZ_BUILD must be yes, only or skip, not '$build'" >&2; exit 1 ;;
esac
if [ "$build" != skip ]; then
  echo "== cargo +nightly fuzz build (${#targets[@]} targets)"
  if [ "$#" -eq 0 ]; then
    (cd fuzz && cargo +nightly fuzz build)
  else
    for t in "${targets[@]}"; do
      (cd fuzz && cargo +nightly fuzz build "$t")
    done
  fi
fi
if [ "$build" = only ]; then
  echo "== built ${#targets[@]} fuzz targets"
  exit 0
fi
triple=$(rustc +nightly -vV | sed -n 's/^host: //p')
bin_dir="fuzz/target/$triple/release"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Prints every input libFuzzer saved in $1 (crash-, leak-, timeout-, oom-).
report_artifacts() {
  local found=0 f
  for f in "$1"/crash-* "$1"/leak-* "$1"/timeout-* "$1"/oom-*; do
    [ -e "$f" ] || continue
    found=1
    echo "   input: $f"
    echo "   base64: $(base64 -w0 "$f")"
    mkdir -p fuzz/artifacts
    cp "$f" fuzz/artifacts/ && echo "   kept as fuzz/artifacts/$(basename "$f")"
  done
  [ "$found" = 1 ] || echo "   (libFuzzer saved no input; see the log above)"
}

# Replays then fuzzes one target. Its report goes to $work/$1.out, and one
# line to $work/$1.summary: "ok <text>" or "failed <text>".
run_target() {
  local t=$1
  local bin="$bin_dir/$t" artifacts="$work/$t-artifacts" corpus="$work/$t-corpus"
  local log="$work/$t.log" status=0 execs replayed inputs
  mkdir -p "$artifacts" "$corpus"
  if [ -d "fuzz/corpus/$t" ]; then
    cp -R "fuzz/corpus/$t/." "$corpus/"
  fi

  # Every target has its regression folder (fuzz/regressions/README.md);
  # libFuzzer prints "Executed <file>" for each input it ran, so the replay
  # is checked to have run every one of them.
  inputs=("fuzz/regressions/$t"/*)
  if [ ! -e "${inputs[0]}" ]; then
    echo "!! $t: fuzz/regressions/$t has no inputs (see fuzz/regressions/README.md)"
    echo "failed $t: no regression inputs" >"$work/$t.summary"
    return
  fi
  echo "== $t: replaying ${#inputs[@]} inputs of fuzz/regressions/$t"
  if ! "$bin" -artifact_prefix="$artifacts/" "${inputs[@]}" >"$log" 2>&1; then
    grep -a -A4 'panicked at' "$log" | head -n 12 || true
    tail -n 40 "$log"
    echo "!! $t: a regression input fails again"
    report_artifacts "$artifacts"
    echo "failed $t: regression failed" >"$work/$t.summary"
    return
  fi
  replayed=$(grep -c '^Executed ' "$log" || true)
  if [ "$replayed" -ne "${#inputs[@]}" ]; then
    tail -n 20 "$log"
    echo "!! $t: replayed $replayed of ${#inputs[@]} regression inputs"
    echo "failed $t: regression replay incomplete" >"$work/$t.summary"
    return
  fi

  echo "== $t: fuzzing for ${seconds}s from $(ls -A "$corpus" | wc -l) seeds"
  "$bin" "$corpus" \
    -max_total_time="$seconds" \
    -timeout=25 \
    -rss_limit_mb=2048 \
    -print_final_stats=1 \
    -artifact_prefix="$artifacts/" >"$log" 2>&1 || status=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  if [ "$status" -ne 0 ]; then
    # The panic's message comes before its backtrace, which the tail cuts.
    grep -a -A4 'panicked at' "$log" | head -n 12 || true
    tail -n 60 "$log"
    echo "!! $t: libFuzzer exited with $status"
    report_artifacts "$artifacts"
    echo "failed $t: FAILED after ${execs:-?} executions" >"$work/$t.summary"
  else
    echo "ok $t: ${replayed} regressions replayed, ${execs:-?} executions in ${seconds}s, corpus $(ls -A "$corpus" | wc -l) inputs" >"$work/$t.summary"
  fi
}

for t in "${targets[@]}"; do
  [ -x "$bin_dir/$t" ] || { echo ".ci/fuzz.sh: $bin_dir/$t was not built" >&2; exit 1; }
done
jobs_max=${FUZZ_JOBS:-$(nproc)}
[ "$jobs_max" -le 4 ] || jobs_max=4
[ "$jobs_max" -ge 1 ] || jobs_max=1
echo "== fuzzing ${#targets[@]} targets, $jobs_max at a time"
running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs_max" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_target "$t" >"$work/$t.out" 2>&1 &
  running=$((running + 1))
done
wait

failed=()
summary=()
for t in "${targets[@]}"; do
  cat "$work/$t.out"
  line=$(cat "$work/$t.summary" 2>/dev/null || echo "failed $t: no report (the run was cut)")
  summary+=("${line#* }")
  case "$line" in
    ok\ *) echo "   ${line#ok }" ;;
    *) failed+=("$t") ;;
  esac
done

echo "== fuzz summary"
printf '   %s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "!! failed: ${failed[*]}"
  exit 1
fi
echo "== all ${#targets[@]} fuzz targets passed"
