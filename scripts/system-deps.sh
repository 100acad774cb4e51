#!/usr/bin/env bash
# Install the Debian packages the test suite needs (as root; idempotent).
#   chromium:   headless browser for tests/test_dashboard_browser.py
#   postgresql: server binaries (initdb, postgres) for the PostgreSQL store tests; the test
#               fixture (tests/fixtures_postgres.py) runs its own throwaway server, so no
#               system cluster is created and no service is started here.
#   kubectl:    renders k8s/ (its built-in kustomize) for tests/test_k8s_manifests.py; only
#               from the apt sources already configured. Without it nothing is downloaded and
#               those rendering tests skip, saying why.
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

kubectl_works() {
  command -v kubectl >/dev/null 2>&1 && kubectl version --client >/dev/null 2>&1
}

install_kubectl() {
  if kubectl_works; then
    echo "[system-deps] kubectl already installed: $(kubectl version --client 2>/dev/null | head -n 1)"
    return 0
  fi
  # Debian's own `kubernetes-client` (1.20, kustomize v2) is too old to render k8s/; `kubectl`
  # comes from Kubernetes' apt repository (pkgs.k8s.io) where a machine has it configured.
  echo "[system-deps] installing kubectl (apt-get)"
  if apt_install kubectl 2>/dev/null && kubectl_works; then
    echo "[system-deps] installed: $(kubectl version --client 2>/dev/null | head -n 1)"
  else
    echo "[system-deps] kubectl is not available from the configured apt sources; nothing was" \
      "downloaded. tests/test_k8s_manifests.py will skip its kustomize renders: install" \
      "kubectl >= 1.27 (https://kubernetes.io/docs/tasks/tools/) to run them." >&2
  fi
}

install_chromium
install_postgresql
install_kubectl
