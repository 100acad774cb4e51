#!/usr/bin/env bash
# Create .venv at the repository root and install the project with its test tools.
# torch is pinned and installed first, so the CPU build is used (an unpinned torch pulls CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PY"
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0 (CPU build)"
  "${PIP[@]}" install torch==2.13.0
fi
echo "[setup] installing pipetransformer and its dependencies"
"${PIP[@]}" install -e ".[test,bench]"
echo "[setup] done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
