"""bench/etcd_read_cost.py kept from rotting: against a real etcd, each kind of rendezvous read
is measured, the filtered reads return nothing (the benchmark checks it), and the result holds a
figure per kind and size. Timings are not asserted (2 shared cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_small_run_reports_each_kind_of_read_per_size() -> None:
    cmd = [sys.executable, str(REPO / "bench" / "etcd_read_cost.py")]
    cmd += ["--alive", "8,64", "--reads", "50", "--rounds", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "etcd_read_cost" and result["sizes"] == [8, 64]
    assert [row["alive_keys"] for row in result["rows"]] == [8, 64]
    for row in result["rows"]:
        assert set(row["etcd_cpu_ms_per_read"]) == {"span", "deltas", "count"}
        assert all(ms >= 0 for ms in row["etcd_cpu_ms_per_read"].values())
        assert all(ms > 0 for ms in row["client_ms_per_read"].values())


def test_sizes_that_are_not_whole_numbers_are_refused_by_name() -> None:
    cmd = [sys.executable, str(REPO / "bench" / "etcd_read_cost.py"), "--alive", "64,many"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 2 and "--alive '64,many'" in run.stderr
