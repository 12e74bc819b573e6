#!/usr/bin/env bash
# Makes sure `go test -race` can build: the race detector needs cgo, and so a C compiler.
# On a machine without one, installs gcc with apt-get when running as root, else prints the
# command to run and fails.
set -euo pipefail

ready() {
  [ "$(go env CGO_ENABLED)" = 1 ] && command -v "$(go env CC)" >/dev/null 2>&1
}

if ready; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "cgo: no C compiler for the race detector; installing gcc with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq gcc libc6-dev >&2
  if ready; then
    exit 0
  fi
fi
echo "cgo: the race detector (go test -race) needs cgo and a C compiler ($(go env CC)); install one, e.g. sudo apt-get install gcc libc6-dev, then run make test again" >&2
exit 1
