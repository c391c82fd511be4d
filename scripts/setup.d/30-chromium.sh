#!/usr/bin/env bash
# A headless browser for the capture daemon's dashboard test (tests/python/test_capture_daemon.py),
# which drives it with Playwright (requirements-dev.txt) through its executable_path: Debian's
# chromium package, since Playwright's own browser download is not reachable from every machine.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup: no chromium and no apt-get; the dashboard test will be skipped" >&2
  exit 0
fi
echo "setup: installing Debian's chromium (for the dashboard test)" >&2
SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo sudo)
# A browser that cannot be installed (no package mirror, no root) costs one test, not the setup.
if ! { $SUDO apt-get update -q >/dev/null &&
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null; }; then
  echo "setup: WARNING: could not install chromium with apt-get; the dashboard test will be skipped" >&2
fi
