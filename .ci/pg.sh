#!/usr/bin/env bash
# Starts a throwaway PostgreSQL cluster for the tests and prints its
# DATABASE_URL. Debian's packages (postgresql); as root, the server runs as
# the `postgres` user. The cluster lives in a temp dir and listens on
# 127.0.0.1 only.
#
#   eval "$(.ci/pg.sh start)"   # exports DATABASE_URL and EGRESS_PG_DIR
#   .ci/pg.sh stop "$EGRESS_PG_DIR"
set -euo pipefail
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -n "$bindir" ] || { echo "pg.sh: PostgreSQL is not installed (apt-get install postgresql)" >&2; exit 1; }
port=${PGPORT_TEST:-54329}
case ${1:-start} in
start)
    dir=$(mktemp -d /tmp/egress-pg.XXXXXX)
    if [ "$(id -u)" = 0 ]; then chown postgres "$dir"; fi
    runas() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }
    runas "'$bindir/initdb' -D '$dir/data' -U postgres --auth=trust -E UTF8 >'$dir/initdb.log' 2>&1"
    runas "'$bindir/pg_ctl' -D '$dir/data' -l '$dir/server.log' -w -t 60 -o \"-c listen_addresses=127.0.0.1 -p $port -k '$dir' -c max_connections=400 -c fsync=off\" start >/dev/null"
    echo "export EGRESS_PG_DIR=$dir"
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
