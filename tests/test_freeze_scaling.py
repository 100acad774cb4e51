"""bench/freeze_scaling.py (the GPU table of the elastic-freezing issue) on a tiny ViT on the CPU:
it measures every configuration, its correctness checks hold, and they fail when the cache or
the frozen weights go wrong. The benchmark is meant for a GPU that CI never has, so this keeps it
from rotting; the timings themselves are not asserted."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

# float results compared across computations: run again under other kernels (scripts/test.sh)
pytestmark = pytest.mark.numerics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import freeze_scaling as fs  # noqa: E402

TINY = fs.MODELS["vit-tiny"][0]


def _measure(tmp_path: Path) -> dict:
    return fs.measure(
        TINY, batch=4, batches=2, steps=1, repeats=1, warmup=1, device="cpu", scratch=tmp_path
    )


def test_measures_every_fraction_and_checks_hold(tmp_path: Path) -> None:
    result = _measure(tmp_path)
    rows = result["rows"]
    assert [(r["percent"], r["mode"]) for r in rows] == [
        (0, "train"),
        (25, "recompute"),
        (25, "cache"),
        (50, "recompute"),
        (50, "cache"),
        (75, "recompute"),
        (75, "cache"),
    ]
    assert [r["boundary"] for r in rows] == [0, 1, 1, 2, 2, 3, 3]
    for r in rows:
        assert r["bound"] == pytest.approx(TINY.depth / (TINY.depth - r["boundary"]))
        assert 1.0 <= r["bound_recompute"] <= r["bound"]
        assert r["samples_per_s"] > 0 and math.isfinite(r["speedup"])
    assert rows[0]["speedup"] == 1.0
    assert 0 < result["forward_share"] < 1  # a no-grad forward is cheaper than a training step
    assert result["checks"] == {
        "cache_equals_recompute": True,
        # bit for bit on the CPU: the cache was filled from the very batches it is compared on
        "max_abs_diff": 0.0,
        "frozen_unchanged": True,
        "cache_all_hits": True,
    }


def test_boundaries_round_and_keep_a_block_trainable() -> None:
    assert [fs.boundary_for(12, p) for p in fs.PERCENTS] == [0, 3, 6, 9]
    assert [fs.boundary_for(8, p) for p in fs.PERCENTS] == [0, 2, 4, 6]
    assert fs.boundary_for(2, 75) == 1  # never every block


def test_a_cache_serving_wrong_rows_fails_the_run(tmp_path: Path, monkeypatch) -> None:
    real = fs.ActivationCache.get_or_compute

    def off_by_a_bit(self, *args, **kwargs):
        return real(self, *args, **kwargs) + 1e-3

    monkeypatch.setattr(fs.ActivationCache, "get_or_compute", off_by_a_bit)
    with pytest.raises(fs.CheckFailed, match="differs from recomputation"):
        _measure(tmp_path)


def test_frozen_weights_moving_fails_the_run(tmp_path: Path, monkeypatch) -> None:
    real = fs.Replica.step

    def leaky(self) -> None:
        real(self)
        if self.boundary:
            with torch.no_grad():
                next(self.full.blocks["0"].parameters()).add_(1e-3)

    monkeypatch.setattr(fs.Replica, "step", leaky)
    with pytest.raises(fs.CheckFailed, match="frozen weights changed"):
        _measure(tmp_path)


def test_cli_prints_a_table_and_json_and_plots(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys.modules["_common"], "OUT_DIR", tmp_path)
    monkeypatch.setattr(
        sys, "argv", ["freeze_scaling.py", "--model", "vit-tiny", "--device", "cpu",
                      "--repeats", "1", "--steps", "1", "--warmup", "0", "--batches", "2"],
    )  # fmt: skip
    fs.main()
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["benchmark"] == "freeze_scaling" and result["model"] == "vit-tiny"
    assert set(result["speedup"]) == {r["config"] for r in result["rows"]}
    assert any(line.startswith("| 75 % | 3 | cached |") for line in out)
    assert (tmp_path / "freeze_scaling.png").stat().st_size > 0
    assert json.loads((tmp_path / "freeze_scaling.json").read_text()) == result


def test_cli_rejects_bad_arguments(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["freeze_scaling.py", "--steps", "0"])
    with pytest.raises(SystemExit, match="--steps must be at least 1"):
        fs.main()
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["freeze_scaling.py", "--device", "cuda"])
        with pytest.raises(SystemExit, match="no CUDA device"):
            fs.main()
