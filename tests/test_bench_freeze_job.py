"""bench/freeze_job.py end to end on the CPU (`--quick`: a small ViT, real jobs through the CLI):
the job without freezing keeps one layout, the freezing job re-lays out as its boundary grows,
both finish with an accuracy, and the speed-up is the ratio of their wall times. Timings are not
asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_run_compares_the_two_jobs() -> None:
    cmd = [sys.executable, str(REPO / "bench" / "freeze_job.py"), "--quick"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    plain, freezing = result["rows"]["no-freezing"], result["rows"]["freezing"]
    assert "error" not in plain and "error" not in freezing, (plain, freezing)
    assert len(plain["layouts"]) == 1 and list(plain["samples_per_s_by_boundary"]) == ["0"]
    assert len(freezing["layouts"]) > 1  # the schedule froze, the layout followed
    assert len(freezing["samples_per_s_by_boundary"]) > 1
    assert 0 <= plain["final_accuracy"] <= 1 and 0 <= freezing["final_accuracy"] <= 1
    assert result["wall_time_speedup"] == plain["wall_s"] / freezing["wall_s"]
