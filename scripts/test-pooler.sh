#!/usr/bin/env bash
# The pooler suite of make test: the locker, worker, fx and CLI tests again, through a
# PgBouncer of their own in transaction mode (scripts/pgbouncer.sh: installed when missing,
# a free private port, a temporary directory): Debian 12's PgBouncer 1.18 once with pgx's
# exec query mode and once with simple_protocol, and a PgBouncer that keeps prepared
# statements (>= 1.21, max_prepared_statements; PGBOUNCER_PREPARED in scripts/pgbouncer.sh)
# with pgx's default mode. Each PgBouncer is stopped by its PID when the suite ends, however
# it ends.
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

suite() { # URL through the pooler, what it is
  echo "test-pooler: through $2" >&2
  PGTEST_POOLER_URL="$1" go test -race -count=1 ${GOTESTFLAGS:-} ./locker/ ./worker/ ./fxmodule/ ./cmd/...
}

port=$(free_port)
dirs+=("$(mktemp -d /tmp/perspectives-pgbouncer.XXXXXX)")
scripts/pgbouncer.sh start "${dirs[0]}" "$port"
url=$(scripts/pgbouncer.sh url "$port")
for mode in exec simple_protocol; do
  suite "$url?sslmode=disable&default_query_exec_mode=$mode" "the installed PgBouncer (transaction mode), default_query_exec_mode=$mode"
done

pport=$(free_port "$port")
dirs+=("$(mktemp -d /tmp/perspectives-pgbouncer.XXXXXX)")
PGBOUNCER_PREPARED=1 scripts/pgbouncer.sh start "${dirs[1]}" "$pport"
suite "$(scripts/pgbouncer.sh url "$pport")?sslmode=disable" "a PgBouncer keeping prepared statements (transaction mode), pgx's default mode"
