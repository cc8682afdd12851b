#!/usr/bin/env bash
# Container images of egress-gateway, egress-controller and egress-cluster,
# built from scratch (no base image is pulled) with buildah from an existing
# release build, then checked:
#
#   cargo build --release --locked -p egress-gateway -p egress-controller -p egress-cluster
#   bash .ci/images.sh             # as root; OCI archives land in target/images/
#
# Each image holds its binary in /usr/bin, exactly the shared libraries the
# binary loads (ldd, plus the dynamic loader), /etc/passwd and /etc/group
# (root, and nonroot = 65532), and the labels and annotations
# org.opencontainers.image.{version,revision,source,title,created}.
#
# The user: egress-controller and egress-cluster run as 65532:65532; nothing
# they do needs root. egress-gateway runs as 0:0 with only the capabilities
# the pod grants (deploy/kubernetes: NET_ADMIN): `egress-gateway redirect
# --apply` and machine egress run `nft`, which needs CAP_NET_ADMIN, and
# Kubernetes hands an added capability to a non-root process only through
# file capabilities (which allowPrivilegeEscalation: false disables). So the
# gateway image also carries /usr/sbin/nft and the libraries it loads, and
# /usr/sbin/conntrack (machine egress deletes a removed VM's open flows).
#
# Checks: `skopeo inspect` of every archive (labels, user, entrypoint), then
# each is unpacked with umoci and, in a chroot of its root, its binaries
# print --version; the gateway's runs `policy check-config` and
# `policy explain`, prints its redirect rules and applies them with the
# image's own nft inside a throwaway network namespace (loopback only;
# nothing here sends a packet anywhere).
#
# EGRESS_RELEASE_DIR: where the release binaries are (default
# ${CARGO_TARGET_DIR:-target}/release). EGRESS_IMAGE_SOURCE: the
# org.opencontainers.image.source value (default: the git remote origin).
set -euo pipefail
cd "$(dirname "$0")/.."

RELEASE_DIR="${EGRESS_RELEASE_DIR:-${CARGO_TARGET_DIR:-target}/release}"
OUT=target/images
COMPONENTS=(egress-gateway egress-controller egress-cluster)

say() { echo "-- images: $*"; }
die() { echo "images.sh: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (buildah's store, chroot, ip netns)"
for tool in buildah skopeo umoci jq ldd strip chroot ip nft conntrack; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done
for c in "${COMPONENTS[@]}"; do
  [ -x "$RELEASE_DIR/$c" ] || die "$RELEASE_DIR/$c is missing: cargo build --release --locked -p egress-gateway -p egress-controller -p egress-cluster"
done

REVISION=$(git rev-parse HEAD)
git diff --quiet HEAD -- . 2>/dev/null || REVISION="$REVISION-dirty"
SOURCE="${EGRESS_IMAGE_SOURCE:-$(git remote get-url origin 2>/dev/null || echo "git+file://$PWD")}"
CREATED=$(date -u -d "@$(git log -1 --format=%ct)" +%Y-%m-%dT%H:%M:%SZ)

# buildah in a store of its own (vfs: no overlay mounts needed), removed at
# the end with everything else this run made.
WORK="$(mktemp -d)"
NS="egress-img-$$"
cleanup() {
  local rc=$?
  ip netns del "$NS" 2>/dev/null || true
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
BUILDAH=(buildah --root "$WORK/storage" --runroot "$WORK/run" --storage-driver vfs)

crate_version() { sed -n 's/^version = "\(.*\)"/\1/p' "$1/Cargo.toml" | head -1; }

# The libraries ELF $1 loads, as ldd resolves them, and the loader
# (PT_INTERP): one absolute path per line.
libraries() {
  ldd "$1" | awk '
    $2 == "=>" && $3 ~ /^\// { print $3; next }
    $1 ~ /^\// { print $1 }
  '
}

# A root for component $1 in directory $2.
make_root() {
  local c=$1 root=$2 bin lib
  mkdir -p "$root/usr/bin" "$root/etc"
  # Stripped, as cargo-deb strips the packaged one.
  install -m 0755 "$RELEASE_DIR/$c" "$root/usr/bin/$c"
  strip --strip-unneeded "$root/usr/bin/$c"
  local elves=("$RELEASE_DIR/$c")
  if [ "$c" = egress-gateway ]; then
    mkdir -p "$root/usr/sbin"
    install -m 0755 "$(command -v nft)" "$root/usr/sbin/nft"
    install -m 0755 "$(command -v conntrack)" "$root/usr/sbin/conntrack"
    elves+=("$(command -v nft)" "$(command -v conntrack)")
  fi
  for bin in "${elves[@]}"; do
    if ldd "$bin" | grep 'not found'; then die "$bin: a library is missing on this machine"; fi
    for lib in $(libraries "$bin"); do
      # The path the loader asks for, holding the file the symlink names.
      [ -e "$root$lib" ] || install -D -m 0755 "$(readlink -f "$lib")" "$root$lib"
    done
  done
  printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' \
    'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$root/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nonroot:x:65532:' >"$root/etc/group"
  chmod 0644 "$root/etc/passwd" "$root/etc/group"
}

mkdir -p "$OUT"
for c in "${COMPONENTS[@]}"; do
  version=$(crate_version "${c#egress-}")
  user=65532:65532
  [ "$c" = egress-gateway ] && user=0:0
  root="$WORK/root-$c"
  make_root "$c" "$root"
  ctr=$("${BUILDAH[@]}" from --name "build-$c" scratch)
  "${BUILDAH[@]}" copy --chown 0:0 "$ctr" "$root" / >/dev/null
  meta=()
  for kv in "org.opencontainers.image.title=$c" \
    "org.opencontainers.image.version=$version" \
    "org.opencontainers.image.revision=$REVISION" \
    "org.opencontainers.image.source=$SOURCE" \
    "org.opencontainers.image.created=$CREATED" \
    "org.opencontainers.image.licenses=Apache-2.0"; do
    meta+=(--label "$kv" --annotation "$kv")
  done
  "${BUILDAH[@]}" config "${meta[@]}" \
    --user "$user" --workingdir / \
    --entrypoint "[\"/usr/bin/$c\"]" --cmd '["--help"]' \
    --env PATH=/usr/sbin:/usr/bin \
    --os linux --arch amd64 \
    "$ctr"
  archive="$OUT/$c-$version.oci.tar"
  rm -f "$archive"
  "${BUILDAH[@]}" commit --quiet --format oci --timestamp "$(git log -1 --format=%ct)" \
    --rm "$ctr" "oci-archive:$archive:$version" >/dev/null
  say "$archive ($(du -h "$archive" | cut -f1)): $(find "$root" -type f | sed "s|^$root||" | sort | paste -sd ' ')"
done

# === inspect ===

for c in "${COMPONENTS[@]}"; do
  version=$(crate_version "${c#egress-}")
  archive="$OUT/$c-$version.oci.tar"
  skopeo inspect "oci-archive:$archive" >"$WORK/inspect.json"
  skopeo inspect --config "oci-archive:$archive" >"$WORK/config.json"
  skopeo inspect --raw "oci-archive:$archive" >"$WORK/manifest.json"
  user=65532:65532
  [ "$c" = egress-gateway ] && user=0:0
  for key in title version revision source; do
    case $key in
      title) want=$c ;; version) want=$version ;; revision) want=$REVISION ;; source) want=$SOURCE ;;
    esac
    k="org.opencontainers.image.$key"
    label=$(jq -r --arg k "$k" '.Labels[$k] // empty' "$WORK/inspect.json")
    annotation=$(jq -r --arg k "$k" '.annotations[$k] // empty' "$WORK/manifest.json")
    [ "$label" = "$want" ] || die "$c: label $k is '$label', expected '$want'"
    [ "$annotation" = "$want" ] || die "$c: annotation $k is '$annotation', expected '$want'"
  done
  got_user=$(jq -r '.config.User' "$WORK/config.json")
  [ "$got_user" = "$user" ] || die "$c: the image's user is '$got_user', expected $user"
  entrypoint=$(jq -c '.config.Entrypoint' "$WORK/config.json")
  [ "$entrypoint" = "[\"/usr/bin/$c\"]" ] || die "$c: entrypoint $entrypoint"
  layers=$(jq '.Layers | length' "$WORK/inspect.json")
  [ "$layers" = 1 ] || die "$c: $layers layers, expected 1 (from scratch)"
  say "skopeo inspect $c: $(jq -r '"\(.Architecture)/\(.Os)"' "$WORK/inspect.json"), user $got_user, entrypoint $entrypoint, $layers layer, labels and annotations version=$version revision=${REVISION:0:12} source=$SOURCE"
done

# === unpack and run in a chroot ===

for c in "${COMPONENTS[@]}"; do
  version=$(crate_version "${c#egress-}")
  layout="$WORK/layout-$c"
  mkdir -p "$layout"
  tar -xf "$OUT/$c-$version.oci.tar" -C "$layout"
  umoci unpack --image "$layout:$version" "$WORK/bundle-$c" >/dev/null
  rootfs="$WORK/bundle-$c/rootfs"
  out=$(chroot "$rootfs" "/usr/bin/$c" --version)
  [ "$out" = "$c $version" ] || die "$c: --version in the image printed '$out'"
  say "chroot $c: /usr/bin/$c --version: $out"
done

rootfs="$WORK/bundle-egress-gateway/rootfs"
# A clean environment (the image has no env): VAR=value arguments, then the command.
in_root() {
  local vars=()
  while [ $# -gt 0 ] && [[ $1 == *=* ]]; do vars+=("$1"); shift; done
  env -i PATH=/usr/sbin:/usr/bin "${vars[@]}" chroot "$rootfs" "$@"
}
out=$(in_root nft --version)
say "chroot egress-gateway: nft --version: $out"
out=$(in_root conntrack --version)
say "chroot egress-gateway: conntrack --version: $out"
out=$(in_root SPACE_EGRESS_PROFILES='{"sensor": {"allow": [{"domain": "sensor.example.test"}]}}' \
  SPACE_TLS_INTERCEPTION_EXEMPTIONS='[{"domain": "relay.example.test"}]' \
  /usr/bin/egress-gateway policy check-config)
grep -q sensor <<<"$out" || die "policy check-config in the image: $out"
say "chroot egress-gateway: policy check-config: $(echo "$out" | tr -d '\n ' | cut -c1-160)"
# A bad profile must stop it, naming the variable.
if in_root SPACE_EGRESS_PROFILES='{"Bad": {}}' /usr/bin/egress-gateway policy check-config 2>"$WORK/err"; then
  die "policy check-config in the image accepted a bad profile"
fi
say "chroot egress-gateway: policy check-config refuses a bad profile: $(head -1 "$WORK/err")"
cat >"$rootfs/policy.json" <<'EOF'
{"default": "deny", "allow": [{"domain": "api.example.test"}]}
EOF
out=$(in_root /usr/bin/egress-gateway policy explain --policy /policy.json --dst 192.0.2.7:443 \
  --tls --sni api.example.test --attributed api.example.test)
grep -q '"verdict"' <<<"$out" || die "policy explain in the image: $out"
say "chroot egress-gateway: policy explain: $(echo "$out" | tr -d '\n ' | cut -c1-160)"
rules=$(in_root /usr/bin/egress-gateway redirect --sandbox-iface tap-sb1)
grep -q 'redirect to :15001' <<<"$rules" ||
  die "redirect in the image printed no rules"
# The image's nft applies the rules: inside a namespace of our own (nftables
# is per namespace), the chroot's egress-gateway runs the chroot's nft.
ip netns add "$NS"
ip netns exec "$NS" env -i PATH=/usr/sbin:/usr/bin chroot "$rootfs" \
  /usr/bin/egress-gateway redirect --sandbox-iface tap-sb1 --apply
table=$(ip netns exec "$NS" nft list table inet egress_gw_tap-sb1)
grep -q 'redirect to :15001' <<<"$table" ||
  die "the image's redirect --apply installed no table"
ip netns exec "$NS" env -i PATH=/usr/sbin:/usr/bin chroot "$rootfs" \
  /usr/bin/egress-gateway redirect --sandbox-iface tap-sb1 --remove
ip netns del "$NS"
say "chroot egress-gateway: redirect --apply and --remove ran the image's nft in netns $NS"
echo "images: 3 images built from scratch, inspected, unpacked and run in a chroot"
