#!/usr/bin/env bash
# A private PgBouncer in transaction mode in front of the PostgreSQL at DATABASE_URL, for the
# pooler test suite (make test-pooler) and benchmarks.
#
#   scripts/pgbouncer.sh start DIR PORT   installs PgBouncer when missing (apt-get, as root),
#                                         writes DIR/pgbouncer.ini, starts it on 127.0.0.1:PORT
#                                         and waits until it answers
#   scripts/pgbouncer.sh stop DIR         stops the PgBouncer started in DIR (by its PID) and
#                                         removes DIR
#   scripts/pgbouncer.sh url PORT         prints the URL through it (no database, no query)
#
# Every database of the server is reachable through it under its own name (a wildcard
# entry), as the user of DATABASE_URL, without a password (the test cluster trusts local TCP).
set -euo pipefail
URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}"

usage() { echo "usage: $0 start DIR PORT | stop DIR | url PORT" >&2; exit 2; }

# host, port and user of URL (postgres://user[:pw]@host:port/db?...).
hostport=${URL#*://}; hostport=${hostport#*@}; hostport=${hostport%%/*}; hostport=${hostport%%\?*}
host=${hostport%%:*}; port=5432
[ "$hostport" != "$host" ] && port=${hostport#*:}
user=postgres
case "${URL#*://}" in *@*) user=${URL#*://}; user=${user%%@*}; user=${user%%:*} ;; esac

install() {
  command -v pgbouncer >/dev/null 2>&1 && return 0
  [ -x /usr/sbin/pgbouncer ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "pgbouncer: not installed; installing it with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq pgbouncer >&2 || { apt-get update -qq >&2 && apt-get install -y -qq pgbouncer >&2; }
    # The package may start its own service on 6432: this script never uses it.
  else
    echo "pgbouncer: not installed; install it (sudo apt-get install -y pgbouncer) and retry" >&2
    exit 1
  fi
}

bin() { command -v pgbouncer 2>/dev/null || echo /usr/sbin/pgbouncer; }

start() {
  local dir=$1 listen=$2
  install
  mkdir -p "$dir"
  echo "\"$user\" \"\"" > "$dir/users.txt"
  cat > "$dir/pgbouncer.ini" <<EOF
[databases]
* = host=$host port=$port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $listen
unix_socket_dir =
auth_type = trust
auth_file = $dir/users.txt
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 40
max_db_connections = 0
server_lifetime = 3600
server_idle_timeout = 60
ignore_startup_parameters = extra_float_digits
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
EOF
  local as=()
  if [ "$(id -u)" = 0 ]; then
    # PgBouncer refuses to run as root: it switches to the postgres user.
    chown -R postgres "$dir"
    as=(-u postgres)
  fi
  "$(bin)" -d "${as[@]}" "$dir/pgbouncer.ini"
  for _ in $(seq 1 50); do
    if pg_isready -q -h 127.0.0.1 -p "$listen" -d postgres -U "$user" -t 1 2>/dev/null; then
      echo "pgbouncer: transaction mode on 127.0.0.1:$listen (pid $(cat "$dir/pgbouncer.pid"), dir $dir)" >&2
      return 0
    fi
    sleep 0.1
  done
  echo "pgbouncer: did not answer on 127.0.0.1:$listen; its log:" >&2
  cat "$dir/pgbouncer.log" >&2 || true
  stop "$dir"
  exit 1
}

stop() {
  local dir=$1 pid
  [ -f "$dir/pgbouncer.pid" ] || { rm -rf "$dir"; return 0; }
  pid=$(cat "$dir/pgbouncer.pid")
  # Only the PgBouncer of this directory: a stale pidfile's PID may be another process's now.
  if ! tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$dir/pgbouncer.ini"; then
    rm -rf "$dir"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -rf "$dir"
}

case "${1:-}" in
  start) [ $# -eq 3 ] || usage; start "$2" "$3" ;;
  stop)  [ $# -eq 2 ] || usage; stop "$2" ;;
  url)   [ $# -eq 2 ] || usage; echo "postgres://$user@127.0.0.1:$2/" ;;
  *) usage ;;
esac
