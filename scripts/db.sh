#!/usr/bin/env bash
# Makes sure PostgreSQL answers at DATABASE_URL (default: the local cluster).
# Starts the installed cluster when it is down; on a machine without PostgreSQL, installs it
# with apt-get when running as root, else prints the command to run and fails.
set -euo pipefail
URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}"

answers() {
  command -v pg_isready >/dev/null 2>&1 && pg_isready -q -d "$URL" -t 3 || return 1
  command -v psql >/dev/null 2>&1 || return 0
  psql "$URL" -Atqc 'select 1' >/dev/null 2>&1
}

start_cluster() {
  local ver
  for ver in $(ls /etc/postgresql 2>/dev/null | sort -rn); do
    echo "db: starting PostgreSQL $ver cluster 'main'" >&2
    pg_ctlcluster --skip-systemctl-redirect "$ver" main start 2>&1 | sed 's/^/db: /' >&2 || true
    return 0
  done
  return 1
}

wait_ready() {
  for _ in $(seq 1 30); do
    answers && return 0
    sleep 1
  done
  return 1
}

if answers; then
  exit 0
fi

if [ ! -d /etc/postgresql ] || [ -z "$(ls /etc/postgresql 2>/dev/null)" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "db: PostgreSQL is not installed; installing it with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq postgresql postgresql-client >&2
    ver=$(ls /etc/postgresql | sort -rn | head -1)
    hba=/etc/postgresql/$ver/main/pg_hba.conf
    # A development/test cluster: trust local TCP connections, as DATABASE_URL has no password.
    sed -i -E 's/^(host[[:space:]]+all[[:space:]]+all[[:space:]]+(127\.0\.0\.1\/32|::1\/128)[[:space:]]+)[a-z0-9-]+/\1trust/' "$hba"
    # The package may have started the cluster already: make it read the new rules.
    pg_ctlcluster --skip-systemctl-redirect "$ver" main reload >/dev/null 2>&1 || true
  else
    echo "db: PostgreSQL does not answer at $URL and is not installed." >&2
    echo "db: install and start it, for example:" >&2
    echo "db:   sudo apt-get install -y postgresql && sudo pg_ctlcluster \$(ls /etc/postgresql) main start" >&2
    echo "db: or set DATABASE_URL to a PostgreSQL 13+ server you can create databases on." >&2
    exit 1
  fi
fi

start_cluster || true
if wait_ready; then
  exit 0
fi
echo "db: PostgreSQL still does not answer at $URL." >&2
echo "db: start it with: pg_ctlcluster --skip-systemctl-redirect \$(ls /etc/postgresql) main start" >&2
echo "db: or set DATABASE_URL to a reachable server." >&2
exit 1
