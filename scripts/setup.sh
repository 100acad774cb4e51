#!/usr/bin/env bash
# Create .venv at the repository root and install the project with its test tools.
# torch is pinned and installed first, so the CPU build is used (an unpinned torch pulls CUDA);
# every other package at the version requirements/lock.txt pins (scripts/lock.sh regenerates it),
# and the install fails if the lock misses anything the project needs (scripts/check_lock.py).
# What is installed, and how, is scripts/install.sh's (the Dockerfile runs it too).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $PY"
  "$PY" -m venv .venv
fi
bash scripts/install.sh .venv/bin/python --variant cpu --extras test,bench --editable --tag setup
echo "[setup] done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
