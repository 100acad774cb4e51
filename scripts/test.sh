#!/usr/bin/env bash
# Set everything up, lint, and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$(id -u)" = 0 ]; then
  bash scripts/system-deps.sh   # Debian packages the tests use (chromium, postgresql)
else
  echo "[test] not root: skipping Debian packages; browser and PostgreSQL tests skip without them"
fi
echo "[test] ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "[test] pytest"
exec .venv/bin/python -m pytest -q "$@"
