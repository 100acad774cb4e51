"""bench/lm_speed.py end to end on the CPU (`--quick`: a tiny Llama-shaped model made here, a few
steps of real jobs through the CLI at 1x1 and 2x1 beside a plain `transformers` loop): its one
JSON line has positive tokens/s for each, finite positive ratios, CPU seconds per step for the
loop and every worker, per-rank memory for every rank, a 2x1 / 1x1 memory ratio in (0, 1.5),
positive times to the first step, and its figure draws. Timings and the issue's goals are not asserted (other work shares these cores)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import lm_speed as bench  # noqa: E402

pytestmark = pytest.mark.slow


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_quick_run_reports_speed_memory_and_start_up(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "bench" / "lm_speed.py"), "--quick", "--no-files"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "lm_speed" and "errors" not in result

    speed = result["tokens_per_s"]
    assert set(speed) == {"loop", "1x1", "2x1"}
    assert all(_positive(v) for v in speed.values()), speed
    assert all(_positive(v) for v in result["job_own_tokens_per_s"].values())
    assert _positive(result["job_vs_loop"]) and _positive(result["job_own_vs_loop"])
    assert result["job_vs_loop"] == pytest.approx(speed["1x1"] / speed["loop"])
    assert _positive(result["vs_1x1"]["2x1"])
    for name in ("1x1", "2x1"):
        (job,) = result["runs"][name]
        assert job["steps_measured"] == result["config"]["steps"]
        assert job["first_metrics_step"] == 1

    cpu = result["cpu_s_per_step"]  # CPU seconds per step: the loop's, each worker's
    assert _positive(cpu["loop"]["process"]) and _positive(result["job_vs_loop_cpu"])
    assert _positive(cpu["1x1"]["rank 0"]) and "main" in cpu["1x1"]["rank 0 threads"]
    assert _positive(cpu["2x1"]["rank 0"]) and _positive(cpu["2x1"]["rank 1"])
    assert cpu["2x1"]["all"] >= cpu["2x1"]["rank 0"] + cpu["2x1"]["rank 1"]

    memory = result["memory_mib"]
    assert set(memory["2x1"]["model"]) == {"0", "1"} and set(memory["1x1"]["model"]) == {"0"}
    assert all(_positive(m["max_model"]) and _positive(m["max_peak_rss"]) for m in memory.values())
    goal = result["goals"]["memory_per_rank_2x1_vs_1x1_at_most_0.6"]
    assert 0 < goal["ratio"] < 1.5, memory
    assert goal["implied_state_ratio"] == pytest.approx(0.5, abs=0.01)  # embedding ~ head
    assert isinstance(goal["met"], bool) and isinstance(
        result["goals"]["job_within_10pct_of_loop"]["met"], bool
    )

    for name, seconds in result["to_first_step_s"].items():
        marks = result["milestones_s"][name]
        assert _positive(seconds), (name, marks)
        assert marks["job_created"] < marks["generation_started"] <= seconds, marks

    png = tmp_path / "lm_speed.png"
    bench.plot(result, png)
    assert png.stat().st_size > 10_000
