#!/usr/bin/env bash
# The pooler suite of make test: the locker, worker, fx and CLI tests again, through a
# PgBouncer of their own in transaction mode (scripts/pgbouncer.sh: installed when missing,
# a free private port, a temporary directory), once with pgx's exec query mode and once with
# simple_protocol. PgBouncer is stopped by its PID when the suite ends, however it ends.
set -euo pipefail
cd "$(dirname "$0")/.."

port=""
for p in $(seq 6439 6499); do
  if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then port=$p; break; fi
done
[ -n "$port" ] || { echo "test-pooler: no free port in 6439-6499" >&2; exit 1; }

dir=$(mktemp -d /tmp/perspectives-pgbouncer.XXXXXX)
trap 'scripts/pgbouncer.sh stop "$dir"' EXIT
scripts/pgbouncer.sh start "$dir" "$port"
url=$(scripts/pgbouncer.sh url "$port")
for mode in exec simple_protocol; do
  echo "test-pooler: through PgBouncer (transaction mode), default_query_exec_mode=$mode" >&2
  PGTEST_POOLER_URL="$url?sslmode=disable&default_query_exec_mode=$mode" \
    go test -race -count=1 ${GOTESTFLAGS:-} ./locker/ ./worker/ ./fxmodule/ ./cmd/...
done
