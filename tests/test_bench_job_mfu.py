"""bench/job_mfu.py end to end on the CPU (`--quick`: a small ViT, real jobs through the CLI): a
row per job with the job's own reported samples/s over the steps it measured, and no MFU where
the device has no known peak. Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_run_reports_each_job() -> None:
    cmd = [sys.executable, str(REPO / "bench" / "job_mfu.py"), "--quick"]
    cmd += ["--precisions", "bf16-weights"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "job_mfu" and result["model"] == "vit-tiny"
    (row,) = result["rows"]
    assert "error" not in row, row.get("error")
    assert row["job"] == "bf16-weights-b16" and row["precision"] == "bf16-weights"
    # 2 epochs of 7 steps (the training split of 128 synthetic samples, batches of 16), the
    # first 2 left out
    assert row["steps_measured"] == 2 * 7 - 2
    assert row["samples_per_s"] > 0 and row["mfu"] is None
