#!/usr/bin/env bash
# Set everything up, lint, and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] pytest"
exec .venv/bin/python -m pytest -q "$@"
