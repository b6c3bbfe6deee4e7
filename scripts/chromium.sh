#!/usr/bin/env bash
# Debian's Chromium for the admin page's browser tests (Playwright drives /usr/bin/chromium;
# it never downloads a browser). Safe to run again.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq chromium >/dev/null
