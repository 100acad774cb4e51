#!/usr/bin/env bash
# Install the Debian packages the test suite needs (as root; idempotent).
#   chromium:   headless browser for tests/test_dashboard_browser.py
#   postgresql: server binaries (initdb, postgres) for the PostgreSQL store tests; the test
#               fixture (tests/fixtures_postgres.py) runs its own throwaway server, so no
#               system cluster is created and no service is started here.
set -euo pipefail

apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then
    apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

install_chromium() {
  if [ -x /usr/bin/chromium ]; then
    echo "[system-deps] chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
    return 0
  fi
  echo "[system-deps] installing chromium (apt-get)"
  apt_install chromium
  echo "[system-deps] installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
}

postgres_bin() {
  # Newest installed server version's bin folder, if any.
  local initdb
  initdb=$(ls -1d /usr/lib/postgresql/*/bin/initdb 2>/dev/null | sort -V | tail -n 1 || true)
  [ -n "$initdb" ] && dirname "$initdb"
}

install_postgresql() {
  local bin
  if bin=$(postgres_bin); then
    echo "[system-deps] postgresql already installed: $("$bin/postgres" --version)"
    return 0
  fi
  echo "[system-deps] installing postgresql (apt-get; no cluster, no service)"
  # Tell postgresql-common not to create (and so not to start) the default 'main' cluster.
  mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = false" >/etc/postgresql-common/createcluster.d/pipetransformer.conf
  apt_install postgresql
  bin=$(postgres_bin) || { echo "[system-deps] postgresql installed but no initdb found" >&2; exit 1; }
  echo "[system-deps] installed: $("$bin/postgres" --version) in $bin"
}

install_chromium
install_postgresql
