# Sourced by the DNS benchmarks (dns-load.sh, dns-flood.sh, doh-load.sh),
# after they set $root (the repository):
#
#   dns_bench_setup NAME
#
# builds the release gateway and load tool (unless SKIP_BUILD=1), sets $gw
# and $load (GW_BIN and LOAD_BIN override them; CARGO_TARGET_DIR is read),
# makes $state (/tmp/egress-NAME.XXXXXX) and an empty $pids, and on exit
# ends every PID in $pids and removes $state.

dns_bench_setup() {
    local target_dir=${CARGO_TARGET_DIR:-$root/target}
    [ "${SKIP_BUILD:-0}" = 1 ] ||
        cargo build --release --quiet -p egress-gateway -p egress-benches --bins --manifest-path "$root/Cargo.toml"
    gw=${GW_BIN:-$target_dir/release/egress-gateway}
    load=${LOAD_BIN:-$target_dir/release/egress-dnsload}
    state=$(mktemp -d "/tmp/egress-$1.XXXXXX")
    pids=()
    trap dns_bench_cleanup EXIT
}

dns_bench_cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$state"
}
