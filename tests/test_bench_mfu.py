"""bench/mfu.py (the issue's MFU table, meant for a GPU) on a tiny ViT on the CPU: every
configuration is measured and reported, MFU is samples/s x model FLOPs / peak where a peak is
known (none on the CPU unless $PIPETRANSFORMER_PEAK_TFLOPS says), and a configuration whose
torch.compile fails records its error while the others go on. Timings are not asserted.

Compiled rows use torch.compile's "eager" backend here (dynamo traces the blocks, no C++
compiler runs): inductor on these CPUs takes ~20 s per graph, too slow for a unit test."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import mfu as bench  # noqa: E402

from pipetransformer.core.flops import PEAK_ENV, training_flops_per_sample  # noqa: E402

TINY = bench.MODELS["vit-tiny"][0]


@pytest.fixture(autouse=True)
def _no_peak(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    yield
    torch._dynamo.reset()  # compiled graphs of one test do not leak into the next


def _measure(configs, **kwargs) -> dict:
    kwargs = {"batch": 4, "steps": 1, "repeats": 2, "warmup": 1, "device": "cpu", **kwargs}
    return bench.measure(TINY, configs=configs, **kwargs)


def test_measures_both_precisions_without_a_peak_on_the_cpu() -> None:
    result = _measure(("fp32", "bf16"))
    flops = training_flops_per_sample(TINY)
    assert result["flops_per_sample"] == flops
    assert result["peak_tflops"] == {"fp32": None, "bf16": None}
    rows = result["rows"]
    assert [(r["config"], r["precision"], r["compile"]) for r in rows] == [
        ("fp32", "fp32", None),
        ("bf16", "bf16", None),
    ]
    for r in rows:
        assert r["error"] is None
        assert r["samples_per_s"] > 0 and math.isfinite(r["samples_per_s"])
        assert r["step_ms"] == pytest.approx(1e3 * 4 / r["samples_per_s"])
        assert r["tflops"] == pytest.approx(r["samples_per_s"] * flops / 1e12)
        assert r["mfu"] is None  # no peak for a CPU
        assert r["peak_memory_mib"] is None  # CUDA only
        assert r["warmup_s"] >= 0
    assert result["goal"] == {"target_mfu": 0.4, "config": "bf16", "mfu": None, "met": None}
    assert "not measured (no peak known" in bench.goal_line(result["goal"])


def test_mfu_is_samples_times_flops_over_the_peak(monkeypatch) -> None:
    monkeypatch.setenv(PEAK_ENV, "0.002")  # 2 GFLOP/s: the same peak for both precisions
    result = _measure(("fp32", "bf16"))
    flops = training_flops_per_sample(TINY)
    assert result["peak_tflops"] == {"fp32": 0.002, "bf16": 0.002}
    for r in result["rows"]:
        assert r["mfu"] == pytest.approx(r["samples_per_s"] * flops / 2e9, rel=1e-12)
    bf16 = result["rows"][1]
    assert result["goal"]["config"] == "bf16" and result["goal"]["mfu"] == bf16["mfu"]
    assert result["goal"]["met"] == (bf16["mfu"] >= 0.4)


def test_compiled_rows_are_measured() -> None:
    result = _measure(("fp32+compile", "bf16+compile-stage"), compile_backend="eager", warmup=0)
    assert result["warmup"] == 2  # compiling: the warm-up covers it whatever was asked
    assert [(r["config"], r["compile"], r["error"]) for r in result["rows"]] == [
        ("fp32+compile", "blocks", None),
        ("bf16+compile-stage", "stage", None),
    ]
    assert all(r["samples_per_s"] > 0 for r in result["rows"])


def test_issue_29_candidates_are_measured() -> None:
    # CUDA graphs for the compiled blocks (skipped by torch on the CPU) and bf16 weights with
    # float32 master copies (trainer.optim.MasterWeights), eager and compiled
    configs = ("bf16+compile-cudagraphs", "bf16w", "bf16w+compile")
    result = _measure(configs, compile_backend="eager")
    rows = {r["config"]: r for r in result["rows"]}
    assert [rows[c]["error"] for c in configs] == [None, None, None]
    assert rows["bf16+compile-cudagraphs"]["compile_mode"] == "reduce-overhead"
    assert rows["bf16w"]["weights"] == rows["bf16w+compile"]["weights"] == "bf16"
    assert rows["bf16w"]["precision"] == "bf16" and rows["bf16w+compile"]["compile"] == "blocks"
    assert all(r["samples_per_s"] > 0 for r in rows.values())
    assert result["attention"] == "auto"


def test_attention_choice_is_checked() -> None:
    with pytest.raises(ValueError, match="attention must be one of"):
        bench.use_attention("fa9")


def test_a_failing_compile_is_recorded_and_the_others_go_on(tmp_path: Path) -> None:
    def no_compiler(gm, example_inputs):
        raise RuntimeError("no C++ compiler here")

    result = _measure(("fp32", "bf16+compile"), compile_backend=no_compiler)
    fp32, failed = result["rows"]
    assert fp32["error"] is None and fp32["samples_per_s"] > 0
    assert failed["samples_per_s"] is None and failed["mfu"] is None
    assert "no C++ compiler here" in failed["error"] and len(failed["error"]) <= 500
    assert result["goal"]["config"] is None  # the only bf16 row failed
    text = bench.table(result["rows"])
    assert "| bf16+compile | bf16 | blocks | failed: BackendCompilerFailed: " in text
    assert "TORCHDYNAMO_VERBOSE" not in failed["error"]
    bench._plot(result, "a failed row", tmp_path / "mfu.png")  # the plot copes with it
    assert (tmp_path / "mfu.png").stat().st_size > 0


def test_cli_prints_a_table_and_json_and_plots(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys.modules["_common"], "OUT_DIR", tmp_path)
    monkeypatch.setattr(
        sys, "argv", ["mfu.py", "--model", "vit-tiny", "--device", "cpu", "--batch", "4",
                      "--repeats", "1", "--steps", "1", "--warmup", "1", "--configs", "fp32,bf16"],
    )  # fmt: skip
    bench.main()
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["benchmark"] == "mfu" and result["model"] == "vit-tiny"
    assert result["batch"] == 4 and result["errors"] == {}
    assert set(result["samples_per_s"]) == set(result["mfu"]) == {"fp32", "bf16"}
    assert result["mfu"] == {"fp32": None, "bf16": None}
    assert any(line.startswith("| bf16 | bf16 | - |") for line in out)
    assert any(line.startswith("goal: bf16 MFU >= 40%") for line in out)
    assert any(line.startswith("[") and "repeat 1/1" in line for line in out)
    assert (tmp_path / "mfu.png").stat().st_size > 0
    assert json.loads((tmp_path / "mfu.json").read_text()) == result


def test_cli_rejects_bad_arguments(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["mfu.py", "--steps", "0"])
    with pytest.raises(SystemExit, match="--steps must be at least 1"):
        bench.main()
    monkeypatch.setattr(sys, "argv", ["mfu.py", "--configs", "fp32,fp8"])
    with pytest.raises(SystemExit, match=r"unknown \['fp8'\]"):
        bench.main()
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["mfu.py", "--device", "cuda"])
        with pytest.raises(SystemExit, match="no CUDA device"):
            bench.main()
