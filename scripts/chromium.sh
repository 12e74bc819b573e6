#!/usr/bin/env bash
# Prints the path of a headless-capable Chromium, for the dashboard's browser test (ui/).
# Installs Debian's chromium with apt-get when none is found (as root); otherwise says what
# to install and fails.
#
#   scripts/chromium.sh        prints e.g. /usr/bin/chromium on stdout (messages go to stderr)
#
# CHROMIUM_BIN, when set, is used as it is (it must be executable).
set -euo pipefail

find_bin() {
  if [ -n "${CHROMIUM_BIN:-}" ]; then
    [ -x "$CHROMIUM_BIN" ] && { echo "$CHROMIUM_BIN"; return 0; }
    echo "chromium: CHROMIUM_BIN=$CHROMIUM_BIN is not an executable file" >&2
    exit 1
  fi
  local b
  for b in chromium chromium-browser google-chrome-stable google-chrome headless_shell; do
    if command -v "$b" >/dev/null 2>&1; then command -v "$b"; return 0; fi
  done
  [ -x /usr/bin/chromium ] && { echo /usr/bin/chromium; return 0; }
  return 1
}

if find_bin; then
  exit 0
fi

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  # One installer at a time (parallel test packages); apt-get itself waits for the dpkg lock.
  exec 9>/tmp/perspectives-chromium-install.lock
  flock 9
  if find_bin; then
    exit 0
  fi
  echo "chromium: not installed; installing Debian's chromium with apt-get (a few minutes, once)" >&2
  export DEBIAN_FRONTEND=noninteractive
  opts=(-y -qq --no-install-recommends -o DPkg::Lock::Timeout=300)
  apt-get install "${opts[@]}" chromium >&2 || { apt-get update -qq >&2 && apt-get install "${opts[@]}" chromium >&2; }
  if find_bin; then
    exit 0
  fi
  echo "chromium: apt-get ran but no chromium binary was found" >&2
  exit 1
fi

echo "chromium: no Chromium found and cannot install it here (not root, or no apt-get)." >&2
echo "chromium: install it (sudo apt-get install -y chromium) or set CHROMIUM_BIN to a Chrome/Chromium binary." >&2
exit 1
