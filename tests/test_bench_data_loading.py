"""bench/data_loading.py end to end at tiny sizes (a few images, a few MiB of table): its one JSON
line has both parts, with positive rates, a stall fraction in [0, 1], every row of the table read
once and a positive peak memory. Timings are not asserted."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import data_loading as bench  # noqa: E402


def test_stored_png_holds_the_pixels_uncompressed() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (12, 7, 3), dtype=np.uint8)
    blob = bench.stored_png(pixels)
    assert len(blob) >= pixels.size
    with Image.open(io.BytesIO(blob)) as im:
        assert im.mode == "RGB" and np.array_equal(np.asarray(im), pixels)


def test_quick_run_reports_both_parts(tmp_path: Path) -> None:
    budget = 2.0
    cmd = [
        sys.executable, str(REPO / "bench" / "data_loading.py"), "--quick", "--no-files",
        "--workdir", str(tmp_path), "--per-class", "6", "--batch", "16", "--rounds", "2",
        "--turn-steps", "4", "--skip-steps", "1", "--warmup-steps", "2", "--budget-mib", str(budget),
        "--image-size", "64", "--memory-batch", "32", "--sample-s", "0.02",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])

    a = result["throughput"]
    example = yaml.safe_load(bench.EXAMPLE.read_text())
    assert a["loader_workers"] == example["data"]["loader_workers"] and a["threads"] >= 1
    for name in ("image_folder", "in_memory"):
        assert a[name]["samples_per_s"] > 0 and a[name]["steps"] == 2 * (4 - 1)
    assert a["samples_per_s_ratio"] > 0 and a["round_ratio_min"] <= a["round_ratio_max"]
    assert 0 <= a["stall_fraction"] <= 1 and a["wait_ms_per_step"] >= 0
    assert a["stall_fraction"] == a["image_folder"]["stall_fraction"]
    assert a["goal"]["stall_fraction_max"] == 0.05

    m = result["memory"]
    assert m["budget_mib"] == budget and m["data_stored_mib"] >= 3 * budget
    assert m["rows_read"] == m["rows"] and m["steps"] > 0
    assert m["peak_rss_mib"] > 0 and m["peak_pss_mib"] > 0
    assert m["peak_rss_mib"] >= m["training_process_peak"]["rss"] > 0
    assert m["loader_processes_seen"] >= 1 and m["loader_process_peak"]["rss"] > 0
    assert 0 <= m["stall_fraction"] <= 1 and m["samples_per_s"] > 0
