#!/usr/bin/env bash
# A private PgBouncer in transaction mode in front of the PostgreSQL at DATABASE_URL, for the
# pooler test suite (make test-pooler) and benchmarks.
#
#   scripts/pgbouncer.sh start DIR PORT   installs PgBouncer when missing (apt-get, as root),
#                                         writes DIR/pgbouncer.ini, starts it on 127.0.0.1:PORT
#                                         and waits until it answers
#   scripts/pgbouncer.sh stop DIR         stops the PgBouncer started in DIR (by its PID) and
#                                         removes DIR
#   scripts/pgbouncer.sh running DIR      exits 0 when the PgBouncer started in DIR runs, 1 if not
#   scripts/pgbouncer.sh url PORT         prints the URL through it (no database, no query)
#
# Every database of the server is reachable through it under its own name (a wildcard
# entry), as the user of DATABASE_URL, without a password (the test cluster trusts local TCP).
#
# When the server is on this machine and answers on its Unix socket as the user PgBouncer runs
# as, PgBouncer reaches it through the socket, as a PgBouncer beside its database is usually
# set up: a local TCP hop costs a lock cycle about a tenth more (BENCHMARKS.md §12).
# PGBOUNCER_SERVER_HOST overrides the choice (a socket directory or a host name).
#
# PGBOUNCER_PREPARED=1 starts a PgBouncer that keeps prepared statements in transaction mode
# (max_prepared_statements, PgBouncer >= 1.21), for pgx's default query exec mode: the
# installed one when it is new enough, else the package of Debian 13 (PgBouncer 1.24; Debian
# 12 has 1.18), fetched from deb.debian.org into a cache directory with the C library it was
# built for (Debian 12's is older) and run by that library's loader. Nothing is installed.
set -euo pipefail
URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}"

usage() { echo "usage: $0 start DIR PORT | stop DIR | running DIR | url PORT" >&2; exit 2; }

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

# The version of the PgBouncer at $1 as one comparable number (1.21.0 -> 1021000), 0 if none.
version_of() {
  local v
  v=$("$1" --version 2>/dev/null | awk 'NR == 1 { print $2 }') || true
  [[ "$v" =~ ^([0-9]+)\.([0-9]+)(\.([0-9]+))? ]] || { echo 0; return; }
  echo $(( BASH_REMATCH[1] * 1000000 + BASH_REMATCH[2] * 1000 + ${BASH_REMATCH[4]:-0} ))
}

# prepared_bin prints a command that runs a PgBouncer >= 1.21 (see the header).
prepared_bin() {
  local sys cache root deb f
  sys=$(bin)
  if [ -x "$sys" ] && [ "$(version_of "$sys")" -ge 1021000 ]; then echo "$sys"; return 0; fi
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/perspectives/pgbouncer-debian13"
  if [ ! -x "$cache/pgbouncer" ]; then
    echo "pgbouncer: fetching Debian 13's PgBouncer and C library into $cache" >&2
    [ "$(uname -m)" = x86_64 ] || { echo "pgbouncer: Debian 13's package is fetched for x86_64 only; install PgBouncer >= 1.21" >&2; exit 1; }
    rm -rf "$cache.tmp" && mkdir -p "$cache.tmp/deb" "$cache.tmp/root"
    deb=http://deb.debian.org/debian
    curl -fsS --retry 3 -o "$cache.tmp/Packages.xz" "$deb/dists/trixie/main/binary-amd64/Packages.xz"
    for pkg in pgbouncer libc6 libcares2 libevent-2.1-7t64; do
      f=$(xz -dc "$cache.tmp/Packages.xz" | awk -v p="$pkg" '$0 == "Package: " p { found = 1 } found && /^Filename: / { print $2; exit }')
      [ -n "$f" ] || { echo "pgbouncer: no package $pkg in Debian 13's index" >&2; exit 1; }
      curl -fsS --retry 3 -o "$cache.tmp/deb/$pkg.deb" "$deb/$f"
      dpkg-deb -x "$cache.tmp/deb/$pkg.deb" "$cache.tmp/root"
    done
    root=$cache/root
    printf '#!/bin/sh\nexec "%s" --library-path "%s" "%s" "$@"\n' \
      "$root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" \
      "$root/usr/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu" \
      "$root/usr/sbin/pgbouncer" > "$cache.tmp/pgbouncer"
    chmod 755 "$cache.tmp/pgbouncer"
    rm -rf "$cache.tmp/deb" "$cache.tmp/Packages.xz" "$cache"
    mv "$cache.tmp" "$cache"
    chmod -R a+rX "$cache"
  fi
  echo "$cache/pgbouncer"
}

# server_host prints where PgBouncer reaches the server (see the header). Its arguments, when
# given, are the command prefix that runs psql as PgBouncer's user.
server_host() {
  local d
  if [ -n "${PGBOUNCER_SERVER_HOST:-}" ]; then echo "$PGBOUNCER_SERVER_HOST"; return; fi
  case "$host" in 127.0.0.1|localhost|::1|"[::1]") ;; *) echo "$host"; return ;; esac
  if command -v psql >/dev/null 2>&1; then
    for d in /var/run/postgresql /run/postgresql /tmp; do
      [ -S "$d/.s.PGSQL.$port" ] || continue
      if "$@" psql -h "$d" -p "$port" -U "$user" -d postgres -Atqc 'select 1' >/dev/null 2>&1; then
        echo "$d"
        return
      fi
    done
  fi
  echo "$host"
}

start() {
  local dir=$1 listen=$2 cmd extra="" server
  if [ "${PGBOUNCER_PREPARED:-}" = 1 ]; then
    cmd=$(prepared_bin)
    extra="max_prepared_statements = 200"
  else
    install
    cmd=$(bin)
  fi
  local as=()
  # PgBouncer refuses to run as root: it switches to the postgres user.
  [ "$(id -u)" = 0 ] && as=(-u postgres)
  if [ ${#as[@]} -gt 0 ]; then server=$(server_host runuser "${as[@]}" --); else server=$(server_host); fi
  mkdir -p "$dir"
  echo "\"$user\" \"\"" > "$dir/users.txt"
  cat > "$dir/pgbouncer.ini" <<EOF
[databases]
* = host=$server port=$port

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
$extra
EOF
  [ ${#as[@]} -gt 0 ] && chown -R postgres "$dir"
  "$cmd" -d "${as[@]}" "$dir/pgbouncer.ini"
  for _ in $(seq 1 50); do
    if pg_isready -q -h 127.0.0.1 -p "$listen" -d postgres -U "$user" -t 1 2>/dev/null; then
      echo "pgbouncer: $("$cmd" --version | head -1), transaction mode${extra:+, $extra}, 127.0.0.1:$listen to $server (pid $(cat "$dir/pgbouncer.pid"), dir $dir)" >&2
      return 0
    fi
    sleep 0.1
  done
  echo "pgbouncer: did not answer on 127.0.0.1:$listen; its log:" >&2
  cat "$dir/pgbouncer.log" >&2 || true
  stop "$dir"
  exit 1
}

# running DIR: whether the PgBouncer started in DIR runs; its PID is printed when it does.
# Only the PgBouncer of this directory: a stale pidfile's PID may be another process's now.
running() {
  local dir=$1 pid
  [ -f "$dir/pgbouncer.pid" ] || return 1
  pid=$(cat "$dir/pgbouncer.pid")
  { tr '\0' ' ' < "/proc/$pid/cmdline"; } 2>/dev/null | grep -q -- "$dir/pgbouncer.ini" || return 1
  echo "$pid"
}

stop() {
  local dir=$1 pid
  if ! pid=$(running "$dir"); then
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
  running) [ $# -eq 2 ] || usage; running "$2" >/dev/null ;;
  url)   [ $# -eq 2 ] || usage; echo "postgres://$user@127.0.0.1:$2/" ;;
  *) usage ;;
esac
