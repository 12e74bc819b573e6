#!/usr/bin/env bash
# Private PostgreSQL clusters for the restart and failover tests: their own data directory and
# port on 127.0.0.1, trust authentication, never the shared cluster.
#
#   scripts/pgcluster.sh primary DIR PORT          initdb DIR, start it on PORT
#   scripts/pgcluster.sh standby DIR PORT PRIMARY  a streaming-replication standby of the
#                                                  primary on port PRIMARY (pg_basebackup -R),
#                                                  started on PORT; the primary then waits for
#                                                  it at every commit (synchronous replication)
#   scripts/pgcluster.sh restart DIR               pg_ctl restart -m immediate (a crash)
#   scripts/pgcluster.sh crash DIR                 pg_ctl stop -m immediate
#   scripts/pgcluster.sh promote DIR               pg_ctl promote (waits until it is done)
#   scripts/pgcluster.sh stop DIR                  stops it (fast, then by its PID) and removes DIR
#
# Runs the server binaries as the postgres user when started as root (initdb refuses root).
set -euo pipefail

bindir=""
for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -rV); do
  [ -x "$d/initdb" ] && { bindir=$d; break; }
done
[ -n "$bindir" ] || { echo "pgcluster: no PostgreSQL server binaries under /usr/lib/postgresql (make db installs them)" >&2; exit 1; }

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

usage() { echo "usage: $0 primary DIR PORT | standby DIR PORT PRIMARY_PORT | restart|crash|promote|stop DIR" >&2; exit 2; }

prepare_dir() {
  mkdir -p "$1"
  [ "$(id -u)" = 0 ] && chown postgres "$1"
  chmod 700 "$1"
}

settings() { # DIR PORT
  cat >> "$1/postgresql.conf" <<EOF
port = $2
listen_addresses = '127.0.0.1'
unix_socket_directories = ''
max_connections = 200
shared_buffers = 32MB
fsync = on
wal_level = replica
max_wal_senders = 5
wal_keep_size = 128MB
hot_standby = on
logging_collector = off
EOF
}

start() { # DIR
  as_pg "$bindir/pg_ctl" -D "$1" -l "$1/server.log" -w -t 60 start >/dev/null
}

case "${1:-}" in
  primary)
    [ $# -eq 3 ] || usage
    dir=$2 port=$3
    prepare_dir "$dir"
    as_pg "$bindir/initdb" -D "$dir" -U postgres -A trust --no-sync >/dev/null
    settings "$dir" "$port"
    echo "host replication all 127.0.0.1/32 trust" >> "$dir/pg_hba.conf"
    start "$dir"
    ;;
  standby)
    [ $# -eq 4 ] || usage
    dir=$2 port=$3 primary=$4
    prepare_dir "$dir"
    as_pg "$bindir/pg_basebackup" -h 127.0.0.1 -p "$primary" -U postgres -D "$dir" -R -X stream --no-sync \
      -C -S "standby_$port" -d "application_name=standby_$port" >/dev/null
    # The copied postgresql.conf names the primary's port: the last setting wins.
    settings "$dir" "$port"
    echo "primary_conninfo = 'host=127.0.0.1 port=$primary user=postgres application_name=standby_$port'" >> "$dir/postgresql.auto.conf"
    start "$dir"
    # Commits on the primary now wait until the standby has the WAL.
    as_pg psql -h 127.0.0.1 -p "$primary" -U postgres -qc "ALTER SYSTEM SET synchronous_standby_names = 'standby_$port'" -c 'SELECT pg_reload_conf()' >/dev/null
    ;;
  restart)
    [ $# -eq 2 ] || usage
    as_pg "$bindir/pg_ctl" -D "$2" -l "$2/server.log" -m immediate -w -t 60 restart >/dev/null
    ;;
  crash)
    [ $# -eq 2 ] || usage
    as_pg "$bindir/pg_ctl" -D "$2" -m immediate -w stop >/dev/null
    ;;
  promote)
    [ $# -eq 2 ] || usage
    as_pg "$bindir/pg_ctl" -D "$2" -w -t 60 promote >/dev/null
    ;;
  stop)
    [ $# -eq 2 ] || usage
    dir=$2
    if [ -f "$dir/postmaster.pid" ]; then
      pid=$(head -1 "$dir/postmaster.pid")
      if ! as_pg "$bindir/pg_ctl" -D "$dir" -m fast -w -t 20 stop >/dev/null 2>&1; then
        # Only a postmaster of this data directory: a stale pidfile's PID may be another's now.
        if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$dir"; then
          kill -KILL "$pid" 2>/dev/null || true
        fi
      fi
    fi
    rm -rf "$dir"
    ;;
  *) usage ;;
esac
