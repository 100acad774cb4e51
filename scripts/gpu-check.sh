#!/usr/bin/env bash
# What to run first on a GPU node: the CUDA tests, then real jobs on the GPUs, then (with
# --bench) the GPU benchmarks. Needs a CUDA build of torch in the interpreter it uses:
#   bash scripts/install.sh .venv/bin/python --variant cuda --extras test,bench --editable
# Usage: scripts/gpu-check.sh [--bench]     (PY=/path/to/python to use another interpreter)
#
# 1. tests/test_cuda.py, tests/test_cuda_cache.py (-m cuda): a one-rank job on cuda through the
#    CLI, bf16 within tolerance of fp32, NCCL groups rebuilt across re-layouts without memory
#    growth, AutoCache rows on the GPU equal to recomputation.
# 2. examples/vit-gpu.yaml on one GPU: freezing, re-layouts, AutoCache on the device; MFU and
#    peak GPU memory in the progress lines and the summary's layout history.
# 3. With 2 or more GPUs: the same job as 2 pipeline stages on 2 GPUs (NCCL sends between
#    stages); freezing then packs the active blocks onto one stage and the freed GPU becomes a
#    second replica (1x2: DDP over NCCL) in the running processes. This is the multi-GPU path
#    that a one-GPU machine cannot exercise.
# 4. --bench: bench/mfu.py and bench/freeze_scaling.py (tables, JSON and PNGs under bench/out/).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "[gpu-check] $PY has no CUDA: install the CUDA build first:" >&2
  echo "  bash scripts/install.sh $PY --variant cuda --extras test,bench --editable" >&2
  exit 1
fi
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
"$PY" -c 'import torch; print("[gpu-check] torch", torch.__version__, "CUDA", torch.version.cuda,
  "NCCL", ".".join(map(str, torch.cuda.nccl.version())), "|", torch.cuda.device_count(), "x",
  torch.cuda.get_device_name(0))'
WORK=$(mktemp -d -t gpu-check-XXXXXX)
trap 'echo "[gpu-check] runs kept in $WORK"' EXIT

echo "[gpu-check] 1/4 CUDA tests"
"$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py tests/test_cuda_cache.py

echo "[gpu-check] 2/4 examples/vit-gpu.yaml on one GPU"
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} "$PY" -P -m pipetransformer.orchestrator.cli run examples/vit-gpu.yaml \
  --workdir "$WORK/one-gpu"

if [ "$GPUS" -ge 2 ]; then
  echo "[gpu-check] 3/4 two GPUs: 2 pipeline stages, re-laid out to 2 replicas as blocks freeze"
  "$PY" - "$WORK/two-gpus.yaml" <<'EOF'
import sys, yaml
spec = yaml.safe_load(open("examples/vit-gpu.yaml"))
spec["name"] = "vit-gpu-2"
spec["parallel"] = {"stages": 2, "replicas": 1, "microbatches": 4}
spec["freeze"]["keep_trainable"] = 2  # 8 blocks: the last two fit one stage -> 1x2
open(sys.argv[1], "w").write(yaml.safe_dump(spec))
EOF
  "$PY" -P -m pipetransformer.orchestrator.cli run "$WORK/two-gpus.yaml" --workdir "$WORK/two-gpus"
else
  echo "[gpu-check] 3/4 skipped: one GPU (NCCL cannot put two ranks on one GPU)"
fi

if [ "${1:-}" = "--bench" ]; then
  echo "[gpu-check] 4/4 benchmarks"
  "$PY" bench/mfu.py
  "$PY" bench/freeze_scaling.py
else
  echo "[gpu-check] 4/4 benchmarks skipped (pass --bench)"
fi
echo "[gpu-check] done"
