#!/usr/bin/env bash
# Install the Debian packages the test suite needs (as root; idempotent).
#   chromium: headless browser for tests/test_dashboard_browser.py
set -euo pipefail

install_chromium() {
  if [ -x /usr/bin/chromium ]; then
    echo "[system-deps] chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
    return 0
  fi
  echo "[system-deps] installing chromium (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
  echo "[system-deps] installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
}

install_chromium
