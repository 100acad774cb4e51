"""bench/relayout_pause.py end to end on the CPU (the digits job, one round of each handover,
real jobs through the CLI): both re-lay out at the same steps to the same layouts, every switch's
pause and cost is read back from the store, the medians are those of the runs, and the figure is
written. Timings are not asserted."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_one_round_compares_the_two_handovers() -> None:
    cmd = [sys.executable, str(REPO / "bench" / "relayout_pause.py"), "--rounds", "1"]
    # one profile store: both runs plan from the same measurements, hence the same layouts
    cmd += ["--epochs", "3", "--warm-profiles"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    memory, checkpoint = (result["runs"][h][0] for h in ("memory", "checkpoint"))
    assert "error" not in memory and "error" not in checkpoint, (memory, checkpoint)
    # decisions every 10 of 69 steps, the first a warm-up: F = 2, 4, 4, 5, 5 (alpha 0.3 of 6
    # blocks, keep 1), so three switches each
    assert memory["layouts"] == checkpoint["layouts"] and len(memory["layouts"]) == 4
    assert memory["layouts"][-1] == "1x2 [5-5] F=5 v4"  # one active block: 1x2 is the only shape
    for row, handover in ((memory, "memory"), (checkpoint, "checkpoint")):
        assert len(row["pauses_s"]) == 3 and all(p >= 0 for p in row["pauses_s"])
        assert [c["handover"] for c in row["costs"]] == [handover] * 3
    assert all(c["checkpoint_s"] == 0 for c in memory["costs"])
    assert all(c["checkpoint_s"] > 0 and c["moved_bytes"] == 0 for c in checkpoint["costs"])
    # 2x1 -> 1x2 at one of the switches: rank 1 gains the embedding and the frozen blocks
    assert max(c["moved_bytes"] for c in memory["costs"]) > 0
    assert result["pause_s_p50"] == statistics.median(memory["pauses_s"])
    assert result["checkpoint_pause_s_max"] == max(checkpoint["pauses_s"])
    assert Path(result["figure"]).stat().st_size > 0
