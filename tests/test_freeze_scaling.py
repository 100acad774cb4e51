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

from pipetransformer.core.flops import PEAK_ENV, training_flops_per_sample  # noqa: E402

TINY = fs.MODELS["vit-tiny"][0]
CHECKS = {
    "cache_equals_recompute": True,
    # bit for bit on the CPU: the cache was filled from the very batches it is compared on
    "max_abs_diff": 0.0,
    "frozen_unchanged": True,
    "cache_all_hits": True,
}


@pytest.fixture(autouse=True)
def _no_peak(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)


def _measure(tmp_path: Path, **kwargs) -> dict:
    kwargs = {"steps": 1, "repeats": 1, "warmup": 1, "device": "cpu", **kwargs}
    return fs.measure(TINY, batch=4, batches=2, scratch=tmp_path, **kwargs)


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
        # from the measured forward share (timings themselves are not asserted: on a loaded
        # 2-core machine even "a no-grad forward is cheaper than a training step" can fail)
        f, L, share = r["boundary"], TINY.depth, result["forward_share"]
        assert r["bound_recompute"] == pytest.approx(1 / ((L - f) / L + f / L * share))
        assert r["samples_per_s"] > 0 and math.isfinite(r["speedup"])
    assert rows[0]["speedup"] == 1.0
    assert result["forward_share"] > 0
    assert result["checks"] == CHECKS
    # the CPU defaults: fp32, eager, rows in host memory; no peak, so no MFU
    assert (result["precision"], result["compile"], result["cache_memory"]) == (
        "fp32",
        False,
        "host",
    )
    assert result["peak_tflops"] is None and all(r["mfu"] is None for r in rows)
    for r in rows:
        flops = training_flops_per_sample(TINY, r["boundary"], cached=r["mode"] == "cache")
        assert r["flops_per_sample"] == flops
        assert r["tflops"] == pytest.approx(r["samples_per_s"] * flops / 1e12)
    goal = result["goal"]
    speedup = next(r["speedup"] for r in rows if r["config"] == "75% cache")
    assert goal == {
        "config": "75% cache",
        "target_speedup": 3.5,
        "speedup": speedup,
        "met": speedup >= 3.5,
    }


def test_bf16_runs_and_the_cache_still_equals_recomputation(tmp_path: Path) -> None:
    result = _measure(tmp_path, precision="bf16")
    assert result["precision"] == "bf16"
    assert result["checks"] == CHECKS  # the same batch recomputed in bf16 on the CPU: same bits
    assert len(result["rows"]) == 7 and all(r["samples_per_s"] > 0 for r in result["rows"])


def test_compiled_blocks_run_and_the_checks_hold(tmp_path: Path) -> None:
    # the "eager" backend: dynamo traces the blocks, no C++ compiler (inductor takes ~20 s here)
    try:
        result = _measure(tmp_path, compile=True, compile_backend="eager", warmup=0)
    finally:
        torch._dynamo.reset()
    assert result["compile"] is True and result["compile_backend"] == "eager"
    assert result["warmup"] == 2  # compilation happens in the warm-up, whatever was asked
    assert result["checks"] == CHECKS


def test_mfu_is_samples_times_model_flops_over_the_peak(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "0.001")
    result = _measure(tmp_path)
    assert result["peak_tflops"] == 0.001
    for r in result["rows"]:
        assert r["mfu"] == pytest.approx(r["samples_per_s"] * r["flops_per_sample"] / 1e9)
    text = fs.table(result["rows"], "heading")
    assert text.startswith("### heading") and "| MFU |" in text


def test_cache_memory_is_host_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert fs.resolve_cache_memory("auto", cpu, 1 << 40) == "host"
    assert fs.resolve_cache_memory("host", cpu, 1 << 40) == "host"
    for memory in ("pinned", "device"):
        with pytest.raises(ValueError, match="needs CUDA"):
            fs.resolve_cache_memory(memory, cpu, 1)
    assert fs.resolve_precision("auto", cpu) == "fp32"
    assert fs.resolve_precision("bf16", cpu) == "bf16"


def test_boundaries_round_and_keep_a_block_trainable() -> None:
    assert [fs.boundary_for(12, p) for p in fs.PERCENTS] == [0, 3, 6, 9]
    assert [fs.boundary_for(8, p) for p in fs.PERCENTS] == [0, 2, 4, 6]
    assert fs.boundary_for(2, 75) == 1  # never every block


def test_a_cache_serving_wrong_rows_fails_the_run(tmp_path: Path, monkeypatch) -> None:
    real = fs.ActivationCache.get_or_compute

    def off_by_a_bit(self, *args, **kwargs):
        return real(self, *args, **kwargs) + 1e-3

    monkeypatch.setattr(fs.ActivationCache, "get_or_compute", off_by_a_bit)
    for precision in ("fp32", "bf16"):
        with pytest.raises(fs.CheckFailed, match="differs from recomputation"):
            _measure(tmp_path / precision, precision=precision)


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
                      "--repeats", "1", "--steps", "1", "--warmup", "0", "--batches", "2",
                      "--precision", "bf16"],
    )  # fmt: skip
    fs.main()
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["benchmark"] == "freeze_scaling" and result["model"] == "vit-tiny"
    assert (result["precision"], result["compile"], result["cache_memory"]) == (
        "bf16",
        False,
        "host",
    )
    assert set(result["speedup"]) == set(result["mfu"]) == {r["config"] for r in result["rows"]}
    assert result["checks"]["cache_equals_recompute"] is True
    assert result["goal"]["config"] == "75% cache" and isinstance(result["goal"]["met"], bool)
    assert any(line.startswith("### freeze scaling: vit-tiny") and "bf16, eager" in line
               for line in out)  # fmt: skip
    assert any(line.startswith("| 75 % | 3 | cached |") for line in out)
    assert any(line.startswith("goal: 75% cache at ") for line in out)
    assert (tmp_path / "freeze_scaling.png").stat().st_size > 0
    assert json.loads((tmp_path / "freeze_scaling.json").read_text()) == result


def test_cli_rejects_bad_arguments(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["freeze_scaling.py", "--steps", "0"])
    with pytest.raises(SystemExit, match="--steps must be at least 1"):
        fs.main()
    monkeypatch.setattr(sys, "argv", ["freeze_scaling.py", "--device", "cpu",
                                      "--cache-memory", "pinned"])  # fmt: skip
    with pytest.raises(SystemExit, match="--cache-memory pinned needs CUDA"):
        fs.main()
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["freeze_scaling.py", "--device", "cuda"])
        with pytest.raises(SystemExit, match="no CUDA device"):
            fs.main()
