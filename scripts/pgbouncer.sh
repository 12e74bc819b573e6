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
#   scripts/pgbouncer.sh prepared         makes sure a PgBouncer that keeps prepared statements
#                                         is installed when the system's package sources offer
#                                         one, prints the installed version, exits 0 when it is
#                                         >= 1.21 and 3 when it is older
#
# Every database of the server is reachable through it under its own name (a wildcard
# entry), as the user of DATABASE_URL, without a password (the test cluster trusts local TCP).
#
# When the server is on this machine and answers on its Unix socket as the user PgBouncer runs
# as, PgBouncer reaches it through the socket, as a PgBouncer beside its database is usually
# set up (a local TCP hop adds to every round trip). PGBOUNCER_SERVER_HOST overrides the
# choice (a socket directory or a host name).
#
# PgBouncer comes from the system's package manager only (apt-get install pgbouncer, as root).
# PGBOUNCER_PREPARED=1 starts a PgBouncer that keeps prepared statements in transaction mode
# (max_prepared_statements, PgBouncer >= 1.21), for pgx's default query exec mode. When the
# installed PgBouncer is older and the configured apt sources offer 1.21 or later, it is
# upgraded through apt-get; when they do not (Debian 12 offers 1.18), start fails and says
# which version is installed.
set -euo pipefail
URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}"

usage() { echo "usage: $0 start DIR PORT | stop DIR | running DIR | url PORT | prepared" >&2; exit 2; }

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
    # One installer at a time (parallel tests start PgBouncer at once); apt-get itself waits
    # for the dpkg lock.
    exec 9>/tmp/perspectives-pgbouncer-install.lock
    flock 9
    if command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ]; then
      exec 9>&-
      return 0
    fi
    echo "pgbouncer: not installed; installing it with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    local opts=(-y -qq -o DPkg::Lock::Timeout=300)
    apt-get install "${opts[@]}" pgbouncer >&2 || { apt-get update -qq >&2 && apt-get install "${opts[@]}" pgbouncer >&2; }
    exec 9>&-
    # The package may start its own service on 6432: this script never uses it.
  else
    echo "pgbouncer: not installed; install it (sudo apt-get install -y pgbouncer) and retry" >&2
    exit 1
  fi
}

bin() { command -v pgbouncer 2>/dev/null || echo /usr/sbin/pgbouncer; }

# The version of the PgBouncer at $1 as it prints it (1.18.0), "none" if there is none.
version_name() {
  local v
  v=$("$1" --version 2>/dev/null | awk 'NR == 1 { print $2 }') || true
  echo "${v:-none}"
}

# The version of the PgBouncer at $1 as one comparable number (1.21.0 -> 1021000), 0 if none.
version_of() {
  local v
  v=$(version_name "$1")
  [[ "$v" =~ ^([0-9]+)\.([0-9]+)(\.([0-9]+))? ]] || { echo 0; return; }
  echo $(( BASH_REMATCH[1] * 1000000 + BASH_REMATCH[2] * 1000 + ${BASH_REMATCH[4]:-0} ))
}

# candidate prints the version of pgbouncer that apt-get would install (1.18.0-1+deb12u1),
# nothing when apt offers none.
candidate() {
  apt-cache policy pgbouncer 2>/dev/null | awk '$1 == "Candidate:" && $2 != "(none)" { print $2 }'
}

# new_enough VERSION: whether a Debian package version is 1.21 or later.
new_enough() {
  [ -n "$1" ] || return 1
  if command -v dpkg >/dev/null 2>&1; then dpkg --compare-versions "$1" ge 1.21; return; fi
  [[ "${1#*:}" =~ ^([0-9]+)\.([0-9]+) ]] || return 1
  (( BASH_REMATCH[1] * 1000 + BASH_REMATCH[2] >= 1021 ))
}

# install_prepared installs PgBouncer when missing and, when the installed one is older than
# 1.21 and the configured apt sources offer 1.21 or later, upgrades it through apt-get.
# It returns 0 when the installed PgBouncer is >= 1.21, 3 when it is older.
install_prepared() {
  local c
  install || return 1
  [ "$(version_of "$(bin)")" -ge 1021000 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    c=$(candidate)
    if ! new_enough "$c"; then
      apt-get update -qq >&2 || echo "pgbouncer: apt-get update failed; using the package lists at hand" >&2
      c=$(candidate)
    fi
    if new_enough "$c"; then
      echo "pgbouncer: $(version_name "$(bin)") keeps no prepared statements; installing $c with apt-get" >&2
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >&2 || return 1
      [ "$(version_of "$(bin)")" -ge 1021000 ] && return 0
    fi
  fi
  return 3
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
  local dir=$1 listen=$2 cmd extra="" server rc
  if [ "${PGBOUNCER_PREPARED:-}" = 1 ]; then
    rc=0; install_prepared || rc=$?
    if [ "$rc" = 3 ]; then
      echo "pgbouncer: PGBOUNCER_PREPARED=1 needs PgBouncer >= 1.21 (max_prepared_statements); the installed one is $(version_name "$(bin)") and the system's package sources offer no newer one" >&2
      exit 3
    fi
    [ "$rc" = 0 ] || { echo "pgbouncer: could not install PgBouncer" >&2; exit 1; }
    cmd=$(bin)
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
  prepared) [ $# -eq 1 ] || usage; rc=0; install_prepared || rc=$?; version_name "$(bin)"; exit "$rc" ;;
  *) usage ;;
esac
