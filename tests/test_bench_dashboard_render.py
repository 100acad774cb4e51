"""bench/dashboard_render.py on a short job: the store is written as a controller writes one,
every view it is asked for renders without an exception and is timed. Timings are not asserted
(a shared machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_each_view_is_rendered_and_timed() -> None:
    cmd = [sys.executable, str(REPO / "bench" / "dashboard_render.py"), "--steps", "300"]
    cmd += ["--eval-every", "50", "--timing-every", "25", "--repeats", "1"]
    cmd += ["--views", "Training,Pipeline,Compare"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["steps"] == 300
    assert set(result["seconds_per_view"]) == {"Training", "Pipeline", "Compare"}
    assert all(s > 0 for s in result["seconds_per_view"].values())
    assert result["largest_s"] == max(result["seconds_per_view"].values())
    assert result["met"] == (result["largest_s"] <= result["goal_s"])
