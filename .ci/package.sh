#!/usr/bin/env bash
# Debian packages of egress-gateway, egress-controller and egress-cluster
# (`[package.metadata.deb]` in each crate's Cargo.toml), made from an existing
# release build, then checked as an operator would meet them:
#
#   cargo build --release --locked -p egress-gateway -p egress-controller -p egress-cluster
#   bash .ci/package.sh            # as root; the packages land in target/debian/
#
# It installs all three with `dpkg -i`, checks their units with
# `systemd-analyze verify`, runs the INSTALLED /usr/bin/egress-gateway with the
# PACKAGED /etc/egress-gateway/gateway.toml in a throwaway network namespace
# (loopback only) until /readyz answers, applies and removes the redirect
# unit's rules there, stops the gateway by its PID, then purges the packages
# and checks that nothing of them is left. The namespace is deleted and the
# packages purged on any exit.
#
# Network: nothing here sends a packet off this machine. The gateway runs in
# a namespace whose only interface is its own loopback, so nothing it does
# (the packaged config has no DNS upstream; a configured one would be
# unreachable) can leave it; the only traffic is curl to its loopback.
#
# EGRESS_RELEASE_DIR: where the release binaries are (default
# ${CARGO_TARGET_DIR:-target}/release; cargo-deb finds them the same way).
# BUILD_ONLY=1: make the packages and stop (nothing installed or purged):
# the way to make them on a machine that runs them.
# EGRESS_PACKAGE_PURGE=1: purge installed egress-* packages first (their
# state and CA with them); without it the script refuses to touch them.
set -euo pipefail
cd "$(dirname "$0")/.."

RELEASE_DIR="${EGRESS_RELEASE_DIR:-${CARGO_TARGET_DIR:-target}/release}"
OUT=target/debian
export DEBIAN_FRONTEND=noninteractive
PACKAGES=(egress-gateway egress-controller egress-cluster)

say() { echo "-- package: $*"; }
die() { echo "package.sh: $*" >&2; exit 1; }

BUILD_ONLY="${BUILD_ONLY:-0}"
[ "$BUILD_ONLY" = 1 ] || [ "$(id -u)" = 0 ] || die "must run as root (dpkg -i, ip netns)"
tools="dpkg dpkg-deb systemd-analyze ip nft curl setpriv"
[ "$BUILD_ONLY" = 1 ] && tools="dpkg-deb"
for tool in $tools; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done
for p in "${PACKAGES[@]}"; do
  [ -x "$RELEASE_DIR/$p" ] || die "$RELEASE_DIR/$p is missing: cargo build --release --locked -p egress-gateway -p egress-controller -p egress-cluster"
done
if ! command -v cargo-deb >/dev/null; then
  say "installing cargo-deb"
  # Pinned: which directory a version treats as systemd's (and so which
  # units it enables) has moved between versions.
  cargo install --locked cargo-deb --version 3.8.0
fi

build_debs() {
  mkdir -p "$OUT"
  local p
  for p in "${PACKAGES[@]}"; do
    rm -f "$OUT/${p}"_*.deb
    cargo deb --no-build --locked -p "$p" -o "$OUT/" >/dev/null
  done
}
if [ "$BUILD_ONLY" = 1 ]; then
  build_debs
  ls "$OUT"/*.deb
  exit 0
fi

# Leftovers of an interrupted run would hide what this run installs: an
# installed egress-gateway, egress-controller or egress-cluster is purged
# first, but only when EGRESS_PACKAGE_PURGE=1 says so: a purge removes the
# gateway's state and CA, which every sandbox of a worker trusts.
installed() {
  local p status
  for p in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    if [ -n "$status" ] && [ "$status" != not-installed ]; then
      echo "$p"
    fi
  done
}
if [ -n "$(installed)" ] && [ "${EGRESS_PACKAGE_PURGE:-0}" != 1 ]; then
  die "installed here: $(installed | tr '\n' ' ')- this script would purge them (state and CA included); BUILD_ONLY=1 makes the packages alone, EGRESS_PACKAGE_PURGE=1 purges"
fi
purge_all() {
  local p
  for p in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
    if [ -n "$status" ] && [ "$status" != not-installed ]; then
      dpkg --purge "$p" >/dev/null
    fi
  done
}
purge_all

NS="egress-pkg-$$"
WORK="$(mktemp -d)"
GW_PID=""
cleanup() {
  local rc=$?
  if [ -n "$GW_PID" ] && kill -0 "$GW_PID" 2>/dev/null; then
    kill -KILL "$GW_PID" 2>/dev/null || true
    wait "$GW_PID" 2>/dev/null || true
  fi
  ip netns del "$NS" 2>/dev/null || true
  purge_all || true
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# === build the packages ===

build_debs
DEBS=()
for p in "${PACKAGES[@]}"; do
  deb=$(ls "$OUT/${p}"_*.deb)
  DEBS+=("$deb")
  say "$deb ($(du -h "$deb" | cut -f1)): $(dpkg-deb -f "$deb" Version) Depends: $(dpkg-deb -f "$deb" Depends)"
  dpkg-deb --contents "$deb" | awk '$6 !~ /\/$/ {print "     " $1, $6}'
done

# === install ===

say "dpkg -i ${DEBS[*]}"
# No systemd runs as PID 1 here: the postinst enables egress-gateway.service
# (symlinks in /etc/systemd/system) but cannot start it.
dpkg -i "${DEBS[@]}"

crate_version() { sed -n 's/^version = "\(.*\)"/\1/p' "$1/Cargo.toml" | head -1; }
for p in "${PACKAGES[@]}"; do
  version=$(crate_version "${p#egress-}")
  out=$("/usr/bin/$p" --version)
  say "/usr/bin/$p --version: $out"
  [ "$out" = "$p $version" ] || die "/usr/bin/$p --version printed '$out', expected '$p $version'"
done

# Conffiles and their modes: the controller's hold the database password and
# the bearer tokens.
conffiles=$(dpkg-query -W -f='${Conffiles}\n' "${PACKAGES[@]}")
for f in /etc/egress-gateway/gateway.toml /etc/logrotate.d/egress-gateway \
  /etc/egress-controller/controller.env /etc/egress-controller/tenants.json \
  /etc/egress-cluster/relay.env; do
  grep -q " $f " <<<"$conffiles" || die "$f is not a conffile"
done
for f in /etc/egress-controller/controller.env /etc/egress-controller/tenants.json; do
  [ "$(stat -c '%a %U:%G' "$f")" = "640 root:root" ] || die "$f: $(stat -c '%a %U:%G' "$f"), expected 640 root:root"
done
[ "$(stat -c %a /var/lib/egress-gateway)" = 700 ] || die "/var/lib/egress-gateway is not mode 0700"
[ "$(stat -c '%a %U' /etc/egress-gateway/admin.token)" = "600 root" ] ||
  die "/etc/egress-gateway/admin.token: $(stat -c '%a %U' /etc/egress-gateway/admin.token 2>&1), expected 600 root"
[ "$(wc -c </etc/egress-gateway/admin.token)" = 64 ] || die "the admin token is not 32 bytes in hex"
ADMIN_AUTH="Authorization: Bearer $(cat /etc/egress-gateway/admin.token)"
[ -d /var/log/egress-gateway ] || die "the postinst did not make /var/log/egress-gateway"
[ -L /etc/systemd/system/multi-user.target.wants/egress-gateway.service ] ||
  die "egress-gateway.service was not enabled on install"
[ -L /etc/systemd/system/multi-user.target.wants/egress-gateway-fence.service ] ||
  die "egress-gateway-fence.service was not enabled on install"

# Every key the packaged configuration shows commented out is one the gateway
# knows, with a value it accepts: uncommented, the file still loads
# (`run --check` reads every table and starts nothing).
sed -E 's/^#([a-z_]+ = )/\1/' /etc/egress-gateway/gateway.toml >"$WORK/uncommented.toml"
shown=$(grep -cE '^[a-z_]+ = ' "$WORK/uncommented.toml")
/usr/bin/egress-gateway run --check --config "$WORK/uncommented.toml" >/dev/null ||
  die "gateway.toml with its commented keys uncommented does not load"
say "gateway.toml: loads with all $shown keys it shows uncommented"

# === units ===

UNITS=(egress-gateway.service egress-gateway-redirect@.service egress-gateway-fence.service
  egress-controller-api.service egress-controller-dispatcher.service
  egress-cluster-relay.service)
for u in "${UNITS[@]}"; do
  [ -f "/usr/lib/systemd/system/$u" ] || die "/usr/lib/systemd/system/$u is not installed"
done
# The drop-in that applies the fence and the active redirect units again
# after nftables.service starts (a start flushes the ruleset; PartOf= and
# ReloadPropagatedFrom= pass on only a stop, restart or reload). The
# redirect template is not PartOf= nftables: a stop of nftables would stop
# its instances, and the start after it would leave them stopped, their
# interfaces routed past the gateway where no fence is set.
NFT_DROPIN=/usr/lib/systemd/system/nftables.service.d/egress-gateway.conf
[ -f "$NFT_DROPIN" ] || die "$NFT_DROPIN is not installed"
grep -q '^ExecStartPost=.* reload-or-restart egress-gateway-fence\.service$' "$NFT_DROPIN" ||
  die "$NFT_DROPIN does not apply the fence again after nftables.service starts"
grep -q '^ExecStartPost=.* try-reload-or-restart egress-gateway-redirect@\*\.service$' "$NFT_DROPIN" ||
  die "$NFT_DROPIN does not apply the redirect units again after nftables.service starts"
if grep -q '^PartOf=' /usr/lib/systemd/system/egress-gateway-redirect@.service; then
  die "egress-gateway-redirect@.service is PartOf= a unit: a stop of nftables would leave its instances stopped"
fi
# A template is verified through an instance (the interface name keeps its '-').
say "systemd-analyze verify"
# nftables.service is verified with the drop-in above (a finding in it
# names egress-gateway.conf).
verify_out=$(cd /usr/lib/systemd/system && systemd-analyze verify \
  egress-gateway.service egress-gateway-redirect@tap-sb1.service egress-gateway-fence.service \
  egress-controller-api.service egress-controller-dispatcher.service \
  egress-cluster-relay.service nftables.service 2>&1) || { echo "$verify_out"; die "systemd-analyze verify failed"; }
# Only our units' own findings count: verify also reads units we depend on.
if echo "$verify_out" | grep -E 'egress-(gateway|controller|cluster)' >&2; then
  die "systemd-analyze verify found problems in the units above"
fi
[ -z "$verify_out" ] || echo "$verify_out" | sed 's/^/     (not ours) /'
say "systemd-analyze verify: the ${#UNITS[@]} units are clean"

# The redirect unit's commands exactly as it runs them (ExecStart=/ExecStop=
# with the instance tap-sb1), below.
unit_cmd() {
  sed -n "s/^$1=//p" /usr/lib/systemd/system/egress-gateway-redirect@.service | sed 's/%i/tap-sb1/g'
}
read -r -a REDIRECT_START <<<"$(unit_cmd ExecStart)"
read -r -a REDIRECT_STOP <<<"$(unit_cmd ExecStop)"

# === the installed gateway, the packaged configuration, a namespace ===

ip netns add "$NS"
ip -n "$NS" link set lo up
say "netns $NS: $(ip -n "$NS" -brief link | tr -s ' ' | paste -sd ';')"
[ "$(ip -n "$NS" -brief link | wc -l)" = 1 ] || die "the namespace has more than its loopback"

# As the unit runs it (its Environment=), minus systemd.
ip netns exec "$NS" env RUST_LOG=info MIMALLOC_ALLOW_THP=0 MIMALLOC_PURGE_DELAY=0 \
  /usr/bin/egress-gateway run --config /etc/egress-gateway/gateway.toml \
  >"$WORK/gateway.out" 2>"$WORK/gateway.err" &
GW_PID=$!
ready=""
for _ in $(seq 1 100); do
  if ready=$(ip netns exec "$NS" curl -fsS --max-time 2 http://127.0.0.1:15000/readyz 2>/dev/null); then
    break
  fi
  kill -0 "$GW_PID" 2>/dev/null || { cat "$WORK/gateway.err" >&2; die "the gateway exited before it was ready"; }
  sleep 0.2
done
[ -n "$ready" ] || { cat "$WORK/gateway.err" >&2; die "/readyz did not answer in 20 s"; }
say "/readyz (pid $GW_PID): $ready"
health=$(ip netns exec "$NS" curl -fsS --max-time 2 http://127.0.0.1:15000/healthz)
say "/healthz: $health"
# The packaged configuration requires the postinst's token on every other route.
unauthorized=$(ip netns exec "$NS" curl -s -o /dev/null -w '%{http_code}' --max-time 2 http://127.0.0.1:15000/metrics)
[ "$unauthorized" = 401 ] || die "/metrics without the admin token answered $unauthorized, expected 401"
metrics=$(ip netns exec "$NS" curl -fsS --max-time 2 -H "$ADMIN_AUTH" http://127.0.0.1:15000/metrics)
grep -q '^egress_active_connections ' <<<"$metrics" || die "/metrics has no egress_active_connections"
say "/metrics: $(grep -c '^# TYPE egress_' <<<"$metrics") metric families"
# One flow straight to the transparent listener: it was not redirected, so it
# has no original destination and is denied; its line goes to the packaged
# flow log.
ip netns exec "$NS" curl -s --max-time 5 -o /dev/null http://127.0.0.1:15001/ || true

for f in ca/ca.crt ca/ca.key gateway.lock; do
  [ -f "/var/lib/egress-gateway/$f" ] || die "state_dir has no $f"
done
[ "$(stat -c %a /var/lib/egress-gateway/ca/ca.key)" = 600 ] || die "ca.key is not mode 0600"

# The fence unit's command (with the packaged configuration's fence
# uncommented: ["tap*"]), then the redirect unit's ExecStart and ExecStop, in
# the namespace (nftables is per namespace), with only the capability the
# units leave them: attaching lets tap-sb1 through the fence, detaching closes it.
read -r -a FENCE_START <<<"$(sed -n 's/^ExecStart=//p' /usr/lib/systemd/system/egress-gateway-fence.service |
  sed "s#/etc/egress-gateway/gateway.toml#$WORK/uncommented.toml#")"
ip netns exec "$NS" setpriv --bounding-set=-all,+net_admin "${FENCE_START[@]}"
fence=$(ip netns exec "$NS" nft list table inet egress_gw_fence)
grep -q 'iifname "tap\*" iifname != @attached counter packets 0 bytes 0 drop' <<<"$fence" ||
  { echo "$fence"; die "the fence does not drop unattached tap* interfaces"; }
say "fence: ExecStart installed inet egress_gw_fence for tap*"
ip netns exec "$NS" setpriv --bounding-set=-all,+net_admin "${REDIRECT_START[@]}"
# (Captured first: `nft … | grep -q` under pipefail fails when grep stops reading.)
attached=$(ip netns exec "$NS" nft list set inet egress_gw_fence attached)
grep -q '"tap-sb1"' <<<"$attached" ||
  { echo "$attached"; die "attaching tap-sb1 did not let it through the fence"; }
table=$(ip netns exec "$NS" nft list table inet egress_gw_tap-sb1)
grep -q 'iifname "tap-sb1" meta l4proto tcp redirect to :15001' <<<"$table" ||
  { echo "$table"; die "the redirect table does not send tap-sb1's TCP to :15001"; }
say "redirect@tap-sb1: ExecStart installed inet egress_gw_tap-sb1 ($(echo "$table" | grep -c redirect) redirects)"
ip netns exec "$NS" setpriv --bounding-set=-all,+net_admin "${REDIRECT_STOP[@]}"
if ip netns exec "$NS" nft list table inet egress_gw_tap-sb1 >/dev/null 2>&1; then
  die "ExecStop left the table inet egress_gw_tap-sb1"
fi
attached=$(ip netns exec "$NS" nft list set inet egress_gw_fence attached)
if grep -q '"tap-sb1"' <<<"$attached"; then
  die "detaching tap-sb1 left it through the fence"
fi
say "redirect@tap-sb1: ExecStop removed it and closed the fence on it"

# Stop by PID: SIGTERM drains (nothing is open) and exits 0.
kill -TERM "$GW_PID"
rc=0
wait "$GW_PID" || rc=$?
GW_PID=""
[ "$rc" = 0 ] || { cat "$WORK/gateway.err" >&2; die "the gateway exited $rc on SIGTERM"; }
grep -q 'sandboxes must trust the interception CA /var/lib/egress-gateway/ca/ca.crt' "$WORK/gateway.err" ||
  { cat "$WORK/gateway.err" >&2; die "the gateway did not announce its CA in state_dir"; }
say "the gateway stopped on SIGTERM (exit 0); its log:"
sed 's/^/     /' "$WORK/gateway.err"
line=$(tail -1 /var/log/egress-gateway/flows.jsonl 2>/dev/null) ||
  die "no flow log at /var/log/egress-gateway/flows.jsonl"
grep -q '"verdict":"deny"' <<<"$line" || die "the flow log's line is not a deny: $line"
say "flow log /var/log/egress-gateway/flows.jsonl: $line"
[ ! -s "$WORK/gateway.out" ] || die "the gateway wrote to stdout with a file flow log: $(head -3 "$WORK/gateway.out")"
ip netns del "$NS"

# === purge: nothing may be left ===

say "dpkg --purge ${PACKAGES[*]}"
dpkg --purge "${PACKAGES[@]}"
left=()
for p in "${PACKAGES[@]}"; do
  for path in "/usr/bin/$p" "/etc/$p" "/var/lib/$p" "/var/log/$p" "/usr/share/doc/$p" "/etc/logrotate.d/$p"; do
    [ ! -e "$path" ] || left+=("$path")
  done
done
while IFS= read -r path; do left+=("$path"); done < <(
  find /usr/lib/systemd/system /etc/systemd/system /var/lib/systemd/deb-systemd-helper-enabled \
    /var/lib/systemd/deb-systemd-helper-masked /var/lib/dpkg/info \
    -name 'egress-*' 2>/dev/null
)
if [ "${#left[@]}" -gt 0 ]; then
  printf '     %s\n' "${left[@]}" >&2
  die "the purge left the paths above"
fi
say "purged: no binary, unit, enable link, conffile, state, log or dpkg record is left"
echo "package: 3 packages built, installed, run, verified and purged"
