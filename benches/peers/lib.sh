# shellcheck shell=bash
# shellcheck disable=SC2034  # the settings are used by the scripts that source this file
# Settings and helpers of the side-by-side harness (benches/peers).  Sourced
# by topo.sh, peers.sh, run.sh and ../idle-rss.sh; every setting can be
# overridden from the environment.

EB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
EB_ROOT=$(cd "$EB_DIR/../.." && pwd)

# All state (test PKI, configs, pid files, logs, raw results) lives here.
EB_STATE=${EB_STATE:-/tmp/egress-peers}
EB_PKI=$EB_STATE/pki
EB_RUN=$EB_STATE/run
EB_WWW=$EB_STATE/www
EB_BIN=$EB_STATE/bin
# Helpers are stdlib-only Python; Debian's interpreter (also mitmdump's).
EB_PYTHON=${EB_PYTHON:-/usr/bin/python3}

# Namespaces: "eb-" (egress bench), distinct from the integration suite's
# egw-*, machine-egress.sh's meb-* and any other testbed's.
EB_NS_PREFIX=${EB_NS_PREFIX:-eb}
NS_CL=$EB_NS_PREFIX-cl   # the client (stands in for a sandbox)
NS_GW=$EB_NS_PREFIX-gw   # the column under test (peer processes, redirect)
NS_OR=$EB_NS_PREFIX-or   # the origin (nginx)

# Links in 100.64.0.0/10 only; the origin on 203.0.113.0/24 (TEST-NET-3).
# No namespace gets a default route or any route to the host's network.
CL_IP=100.64.17.1      # eb-cl  cl0
GW_CL_IP=100.64.17.2   # eb-gw  gwc0
GW_OR_IP=100.64.17.5   # eb-gw  gwo0
OR_IP=100.64.17.6      # eb-or  or0
LINK_NET=100.64.17.0/29
ORIGIN_NET=203.0.113.0/24
ORIGIN_IP=203.0.113.10
ORIGIN_HOST=origin.test

# Where each column listens in eb-gw (TLS port / plain HTTP port).
MITM_PORT=${MITM_PORT:-8081}
SQUID_BUMP_PORT=${SQUID_BUMP_PORT:-3129}
SQUID_BUMP_HTTP_PORT=${SQUID_BUMP_HTTP_PORT:-3131}
SQUID_SPLICE_PORT=${SQUID_SPLICE_PORT:-3130}
SQUID_SPLICE_HTTP_PORT=${SQUID_SPLICE_HTTP_PORT:-3132}
GATEWAY_PORT=${GATEWAY_PORT:-8443}
GW_ADMIN_PORT=${GW_ADMIN_PORT:-15000}

# Test PKI: RSA-2048 (default) or P-256 (EB_KEY_ALG=ec, on a fresh $EB_PKI).
EB_KEY_ALG=${EB_KEY_ALG:-rsa}
ORIGIN_CA_CN="egress-peers Test Origin CA"
PROXY_CA_CN="egress-peers Test Interception CA"
ORIGIN_CA_CRT=$EB_PKI/origin-ca.crt
ORIGIN_CRT=$EB_PKI/origin.crt
ORIGIN_KEY=$EB_PKI/origin.key
PROXY_CA_CRT=$EB_PKI/proxy-ca.crt   # mitmproxy's and Squid's interception CA
PROXY_CA_KEY=$EB_PKI/proxy-ca.key
HOSTS_FILE=$EB_RUN/hosts            # bind-mounted over /etc/hosts in the namespaces
RESOLV_FILE=$EB_RUN/resolv.conf     # bind-mounted over /etc/resolv.conf: loopback only

eb_log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
eb_die() { eb_log "ERROR: $*"; exit 1; }
eb_need_root() { [ "$(id -u)" = 0 ] || eb_die "run as root"; }
eb_ns_exists() { [ -e "/run/netns/$1" ]; }

# Run a command in namespace NS with the harness's hosts file and a
# loopback-only resolv.conf bind-mounted over /etc's (inside the private
# mount namespace `ip netns exec` makes; the host's files are untouched).
# Names resolve from the hosts file or not at all.  exec keeps the pid.
#   eb_in NS cmd...
# shellcheck disable=SC2016  # expanded by the inner sh
EB_NAMES_THEN_EXEC='mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf && shift 2 && exec "$@"'
eb_in() {
    local ns=$1; shift
    ip netns exec "$ns" sh -c "$EB_NAMES_THEN_EXEC" sh "$HOSTS_FILE" "$RESOLV_FILE" "$@"
}

# Start a long-running process in NS in its own session (so its process
# group can be stopped by id), output to $EB_RUN/NAME.log, pid to NAME.pid.
# It does not inherit descriptor 9 (run.sh's lock).
#   eb_spawn NAME NS cmd...
eb_spawn() {
    local name=$1 ns=$2; shift 2
    mkdir -p "$EB_RUN"
    setsid ip netns exec "$ns" sh -c "$EB_NAMES_THEN_EXEC" sh "$HOSTS_FILE" "$RESOLV_FILE" "$@" \
        >"$EB_RUN/$name.log" 2>&1 </dev/null 9>&- &
    echo $! >"$EB_RUN/$name.pid"
}

# Is PID alive and in one of our namespaces?
eb_pid_ours() {
    local pid=$1 ns
    [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
    ns=$(ip netns identify "$pid" 2>/dev/null) || return 1
    case "$ns" in "$NS_CL"|"$NS_GW"|"$NS_OR") return 0 ;; esac
    return 1
}

# Stop what eb_spawn started as NAME: SIGTERM to its process group (the
# group id is the recorded pid), up to 5 s, then SIGKILL.
eb_stop() {
    local f=$EB_RUN/$1.pid pid
    [ -f "$f" ] || return 0
    pid=$(cat "$f")
    if eb_pid_ours "$pid"; then
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 50); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
        [ -d "/proc/$pid" ] && { kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true; }
    fi
    rm -f "$f"
}

eb_pid_of() { cat "$EB_RUN/$1.pid" 2>/dev/null || true; }

# After the caller's EXIT trap (which tears down what was started): INT and
# TERM end the run through it, and the topology comes up fresh (one left up
# by KEEP_UP=1 or a killed run is replaced). STARTED=1 from here on, so the
# EXIT trap also takes down a topology that came up halfway.
eb_topology_fresh() {
    trap 'exit 130' INT
    trap 'exit 143' TERM
    eb_ns_exists "$NS_GW" && "$EB_DIR/topo.sh" down
    STARTED=1
    "$EB_DIR/topo.sh" up
}

# Wait until something listens on TCP PORT in NS (TRIES × 0.1 s, default 20 s).
eb_wait_listen() {
    local ns=$1 port=$2 tries=${3:-200}
    for _ in $(seq "$tries"); do
        ip netns exec "$ns" ss -Hltn "sport = :$port" | grep -q . && return 0
        sleep 0.1
    done
    return 1
}

# CPU clock ticks (user + system, plus reaped children's) of PID and all its
# descendants, read from /proc/<pid>/stat (Squid's helpers and the gateway
# under its wrapper are children of the spawned process).
eb_tree_ticks() {
    local root=$1
    if [ -z "$root" ] || [ ! -d "/proc/$root" ]; then echo 0; return; fi
    "$EB_PYTHON" -c '
import os, sys
root, parent, ticks = sys.argv[1], {}, {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open("/proc/%s/stat" % pid) as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        continue  # gone meanwhile
    # fields after comm: state ppid ... utime(12) stime(13) cutime(14) cstime(15)
    parent[pid] = rest[1]
    ticks[pid] = sum(int(x) for x in rest[11:15])
tree, todo = set(), [root]
while todo:
    p = todo.pop()
    if p in tree:
        continue
    tree.add(p)
    todo.extend(c for c, pp in parent.items() if pp == p)
print(sum(ticks.get(p, 0) for p in tree))
' "$root"
}
EB_CLK_TCK=$(getconf CLK_TCK)
