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
echo "[test] import rules (lint-imports; contracts in pyproject.toml [tool.importlinter])"
.venv/bin/lint-imports pyproject.toml --no-cache --no-logo
# The whole suite runs in two test processes (pytest-xdist, a file's tests in one process: their
# fixtures are per module): the multi-process tests wait on leases and subprocesses about a
# third of the time, so two fill the 2 cores of a CI machine. PYTEST_WORKERS=0 runs them all in
# this process; a targeted run (arguments given) does too.
XDIST=()
if [ $# -eq 0 ] && [ "${PYTEST_WORKERS:-2}" != 0 ]; then
  XDIST=(-n "${PYTEST_WORKERS:-2}" --dist loadfile)
fi
echo "[test] pytest ${XDIST[*]}"
.venv/bin/python -m pytest -q --durations=25 "${XDIST[@]}" "$@"

# Float results depend on the batch shape, the thread count and the kernels the CPU's instruction
# set selects (an AMD EPYC runs MKL's AVX2 path, a recent Intel its AVX-512 one; they differ in
# the last bit for the same sample). Run the tests that compare float results across
# computations (marker `numerics`) again as other CPUs would, so that a comparison that only
# holds on this machine's CPU fails here first. A targeted run (arguments given) skips this;
# NUMERICS_MATRIX=0 skips it too.
#
# AVX2 with one thread is what the other kind of CI machine runs: every fast numerics test, and
# of the slow ones (multi-process, whole jobs) the last case of each test function, its widest
# layout (tests/conftest.py, PT_SLOW_ONE_PER_FUNCTION): whether a comparison holds under these
# kernels shows in one layout as well as in all of them, in a third of the time. The SSE
# baseline is no machine CI runs on, and its kernels are the slowest: the fast tests only.
#
# On a CPU whose own kernels are AVX2 already (an AMD EPYC without AVX-512), the pytest run above
# was the AVX2 row for the slow numerics tests: they compute in worker processes of one thread
# each (tests/mp.py, runtime.threads_per_worker) against references at two threads, a mixed
# comparison and the stricter one. (test_cuda's bf16 run, the one slow test in-process, compares
# held-out accuracy to 4 points, not values.) There the AVX2 row re-runs only the fast tests,
# whose thread count it does change.
#
# Each row collects only the files that hold numerics tests.
if [ $# -eq 0 ] && [ "${NUMERICS_MATRIX:-1}" != 0 ]; then
  native=$(.venv/bin/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')
  mapfile -t files < <(grep -l 'mark.numerics' tests/test_*.py)
  while read -r name marks settings; do
    marks="${marks//_/ }"  # one word in the table below
    if [ "$name" = avx2-1thread ] && [ "$native" = AVX2 ]; then
      echo "[test] this CPU's own kernels are AVX2: its slow numerics tests ran as this row would"
      marks="$marks and not slow"
    fi
    echo "[test] numerics under $name (-m '$marks'): $settings"
    # one thread per test: two test processes; two threads: one
    workers=1 && [[ $settings == *OMP_NUM_THREADS=1* ]] && workers=${PYTEST_WORKERS:-2}
    [ "$workers" -gt 1 ] && par=(-n "$workers" --dist loadfile) || par=()
    env $settings PT_SLOW_ONE_PER_FUNCTION=1 \
      .venv/bin/python -m pytest -q -m "$marks" -p no:cacheprovider "${par[@]}" "${files[@]}"
  done <<'MATRIX'
avx2-1thread numerics MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1
baseline-2threads numerics_and_not_slow MKL_ENABLE_INSTRUCTIONS=SSE4_2 ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 OMP_NUM_THREADS=2
MATRIX
fi
