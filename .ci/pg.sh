#!/usr/bin/env bash
# Starts a throwaway PostgreSQL cluster for the tests and prints its
# DATABASE_URL. Debian's packages (postgresql); as root, the server runs as
# the `postgres` user. The cluster lives in a temp dir and listens on
# 127.0.0.1 only, with TLS on (a self-signed certificate for 127.0.0.1,
# made here with openssl): clients that prefer TLS (sqlx's default) use it,
# and EGRESS_PG_CA lets a test ask for sslmode=verify-full.
#
#   eval "$(.ci/pg.sh start)"   # exports DATABASE_URL, EGRESS_PG_DIR, EGRESS_PG_CA
#   .ci/pg.sh stop "$EGRESS_PG_DIR"
set -euo pipefail
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -n "$bindir" ] || { echo "pg.sh: PostgreSQL is not installed (apt-get install postgresql)" >&2; exit 1; }
port=${PGPORT_TEST:-54329}
# A CA (ca.crt in DIR) and a server certificate for 127.0.0.1 it signed, in
# DIR/data (server.crt, server.key): what ssl=on serves.
tls() {
    local d=$1 ec=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
    printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n' >"$d/server.ext"
    {
        openssl req -x509 "${ec[@]}" -days 2 -subj /CN=egress-test-postgres-ca -keyout "$d/ca.key" -out "$d/ca.crt"
        openssl req "${ec[@]}" -subj /CN=127.0.0.1 -keyout "$d/data/server.key" -out "$d/server.csr"
        openssl x509 -req -in "$d/server.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 2 -extfile "$d/server.ext" -out "$d/data/server.crt"
    } >"$d/openssl.log" 2>&1 || { cat "$d/openssl.log" >&2; exit 1; }
    chmod 600 "$d/data/server.key"
}

case ${1:-start} in
start)
    dir=$(mktemp -d /tmp/egress-pg.XXXXXX)
    if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; fi
    runas() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }
    runas "'$bindir/initdb' -D '$dir/data' -U postgres --auth=trust -E UTF8 >'$dir/initdb.log' 2>&1"
    tls "$dir"
    if [ "$(id -u)" = 0 ]; then chown postgres "$dir/data/server.key" "$dir/data/server.crt"; fi
    runas "'$bindir/pg_ctl' -D '$dir/data' -l '$dir/server.log' -w -t 60 -o \"-c listen_addresses=127.0.0.1 -p $port -k '$dir' -c max_connections=400 -c fsync=off -c ssl=on\" start >/dev/null"
    echo "export EGRESS_PG_DIR=$dir"
    echo "export EGRESS_PG_CA=$dir/ca.crt"
    echo "export DATABASE_URL=postgres://postgres@127.0.0.1:$port/postgres"
    ;;
stop)
    dir=${2:?pg.sh stop DIR}
    if [ "$(id -u)" = 0 ]; then
        su postgres -s /bin/sh -c "'$bindir/pg_ctl' -D '$dir/data' -m fast stop" >/dev/null || true
    else
        "$bindir/pg_ctl" -D "$dir/data" -m fast stop >/dev/null || true
    fi
    rm -rf "$dir"
    ;;
*) echo "usage: pg.sh start | stop DIR" >&2; exit 2 ;;
esac
