#!/usr/bin/env bash
# The profile of the release build (profile-guided optimisation). The gateway
# is built with instrumentation, run through benches/pgo-train.sh (every
# path a worker's traffic takes, a few seconds each, in network namespaces),
# and its counts are merged into one profile. The release build reads it:
#
#   profile=$(bash .ci/pgo.sh)        # the profile's path, on standard output
#   RUSTFLAGS="-Cprofile-use=$profile" cargo build --release --locked -p egress-gateway ...
#
# On this project's benchmarks it cut the gateway's user-space instructions
# per request by a fifth (benches/RESULTS.md, "The release build guided by a
# profile"). Root (namespaces). Needs llvm-profdata of the LLVM version
# rustc is built on (Debian: llvm-N, N its major version) and what
# pgo-train.sh names. Takes one more release build (into PGO_DIR/gen: 7 min
# alone on 2 cores, 14-16 min beside CI's fuzz build) and about 40 s of training.
#
# Environment: PGO_DIR (default ${CARGO_TARGET_DIR:-target}/pgo): the instrumented build, the
# raw counts (PGO_DIR/raw) and the profile (PGO_DIR/egress-gateway-HASH.profdata).
# PGO_PACKAGES (default "egress-gateway egress-controller egress-cluster"):
# the packages the release build builds together, the same set (.ci/run
# passes its RELEASE_PACKAGES).
# PGO_SECS (default 2): seconds per training load.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "pgo.sh: $*" >&2; }
die() { say "$*"; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (the training runs in network namespaces)"
PGO_DIR=$(realpath -m "${PGO_DIR:-${CARGO_TARGET_DIR:-$PWD/target}/pgo}")
major=$(rustc -vV | sed -n 's/^LLVM version: \([0-9]*\).*/\1/p')
[ -n "$major" ] || die "rustc -vV names no LLVM version"
profdata=$(command -v "llvm-profdata-$major" || true)
# Exit 3: no profile can be made here (.ci/run then builds without one);
# every other failure exits 1.
[ -n "$profdata" ] || { say "llvm-profdata-$major is missing: rustc is built on LLVM $major, and an older llvm-profdata cannot read its counts (Debian: apt-get install llvm-$major)"; exit 3; }

rm -rf "$PGO_DIR/raw" "$PGO_DIR/build-scripts" "$PGO_DIR"/*.profdata
mkdir -p "$PGO_DIR/raw"
# The instrumented build builds what the release build builds: cargo
# unifies the features of shared crates over the packages built together,
# and a crate built with other features is other code, whose counts the
# release build would not match (measured: a profile of the gateway built
# alone left the three-package release build's gateway where it was).
# Built with the release profile as it is (fat LTO): an instrumented build
# without LTO (2.3 min shorter) made a profile the release build matched
# next to nothing of (benches/RESULTS.md).
read -r -a packages <<< "${PGO_PACKAGES:-egress-gateway egress-controller egress-cluster}"
say "building ${packages[*]} instrumented into $PGO_DIR/gen"
# The build scripts are instrumented too: their counts go apart, unused.
RUSTFLAGS="-Cprofile-generate=$PGO_DIR/build-scripts" \
    cargo build --release --locked "${packages[@]/#/--package=}" --target-dir "$PGO_DIR/gen" >&2 ||
    die "the instrumented build failed"

say "training (benches/pgo-train.sh)"
LLVM_PROFILE_FILE="$PGO_DIR/raw/gateway-%p.profraw" \
    bash benches/pgo-train.sh "$PGO_DIR/gen/release/egress-gateway" >&2 ||
    die "the training failed (benches/pgo-train.sh, above)"

shopt -s nullglob
raw=("$PGO_DIR"/raw/*.profraw)
# The three columns of the training and the DNS gateway, each when it
# stopped (pgo-train.sh checks each one's file as it stops it).
[ ${#raw[@]} -eq 4 ] || die "${#raw[@]} processes wrote counts in $PGO_DIR/raw, not the 4 the training runs"
"$profdata" merge -o "$PGO_DIR/merged.profdata" "${raw[@]}" >&2
# Named by its content: cargo tracks RUSTFLAGS, not the file they name, so a
# new profile under the old name would leave an earlier build as it was.
profile=$PGO_DIR/egress-gateway-$(sha256sum "$PGO_DIR/merged.profdata" | cut -c1-16).profdata
mv "$PGO_DIR/merged.profdata" "$profile"
rm -rf "$PGO_DIR/raw" "$PGO_DIR/build-scripts"
say "profile: $profile ($(stat -c %s "$profile") bytes from ${#raw[@]} processes)"
echo "$profile"
