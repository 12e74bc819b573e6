#!/usr/bin/env bash
# The pooler suite of make test: the locker, worker, fx and CLI tests again, through a
# PgBouncer of their own in transaction mode (scripts/pgbouncer.sh: installed from the
# system's package manager when missing, a free private port, a temporary directory): the
# installed PgBouncer once with pgx's exec query mode and once with simple_protocol, then,
# where the installed PgBouncer keeps prepared statements (>= 1.21, max_prepared_statements;
# PGBOUNCER_PREPARED in scripts/pgbouncer.sh), a third time with pgx's default mode. Where
# the installed PgBouncer is older and the system's package sources offer no newer one
# (Debian 12 offers 1.18), the third pass is not run: the output says so and why, and the
# suite does not fail for it. Each PgBouncer is stopped by its PID when the suite ends,
# however it ends.
#
# When a PgBouncer exits while the tests run, the end of its log is printed and the tests
# that failed with it count as failed. Once per run, when the log shows PgBouncer stopping
# on an assertion of its own ("FATAL @src/...": PgBouncer 1.18 has known ones, such as
# pgbouncer#822 on a cancel request, fixed in 1.21), it is started again on its port and
# that pass runs once more; that pass must then pass whole.
set -euo pipefail
cd "$(dirname "$0")/.."

# free_port prints a free port in 6439-6499 other than those given.
free_port() {
  local p
  for p in $(seq 6439 6499); do
    case " $* " in *" $p "*) continue ;; esac
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return 0; fi
  done
  echo "test-pooler: no free port in 6439-6499" >&2
  return 1
}

dirs=()
trap 'for d in "${dirs[@]}"; do scripts/pgbouncer.sh stop "$d"; done' EXIT
restarted=0

# suite DIR PORT PREPARED QUERY WHAT: the tests through the PgBouncer started in DIR on
# PORT (PREPARED: its PGBOUNCER_PREPARED), with QUERY added to its URL.
suite() {
  local dir=$1 port=$2 prepared=$3 query=$4 what=$5 rc=0
  echo "test-pooler: through $what" >&2
  PGTEST_POOLER_URL="$(scripts/pgbouncer.sh url "$port")?$query" \
    go test -race -count=1 ${GOTESTFLAGS:-} ./locker/ ./worker/ ./fxmodule/ ./cmd/... || rc=$?
  scripts/pgbouncer.sh running "$dir" && return "$rc"
  echo "test-pooler: PgBouncer ($dir) exited while the tests ran; the end of its log:" >&2
  tail -n 8 "$dir/pgbouncer.log" >&2 || true
  if [ "$restarted" = 0 ] && grep -q "FATAL @src/" "$dir/pgbouncer.log" 2>/dev/null; then
    restarted=1
    echo "test-pooler: PgBouncer stopped on an assertion of its own (above); starting it again and running this pass once more" >&2
    scripts/pgbouncer.sh stop "$dir"
    PGBOUNCER_PREPARED=$prepared scripts/pgbouncer.sh start "$dir" "$port"
    suite "$@"
    return
  fi
  return 1
}

start() { # DIR PORT PREPARED
  dirs+=("$1")
  PGBOUNCER_PREPARED=$3 scripts/pgbouncer.sh start "$1" "$2"
}

port=$(free_port)
dir=$(mktemp -d /tmp/perspectives-pgbouncer.XXXXXX)
start "$dir" "$port" ""
for mode in exec simple_protocol; do
  suite "$dir" "$port" "" "sslmode=disable&default_query_exec_mode=$mode" \
    "the installed PgBouncer (transaction mode), default_query_exec_mode=$mode"
done

rc=0; version=$(scripts/pgbouncer.sh prepared) || rc=$?
if [ "$rc" = 3 ]; then
  echo "test-pooler: NOT RUN: the pass through a PgBouncer keeping prepared statements (pgx's default mode): it needs PgBouncer >= 1.21 (max_prepared_statements), the installed PgBouncer is $version and the system's package sources offer no newer one" >&2
  exit 0
fi
[ "$rc" = 0 ] || exit "$rc"
pport=$(free_port "$port")
pdir=$(mktemp -d /tmp/perspectives-pgbouncer.XXXXXX)
start "$pdir" "$pport" 1
suite "$pdir" "$pport" 1 "sslmode=disable" \
  "a PgBouncer keeping prepared statements (transaction mode), pgx's default mode"
