"""bench/paper.py's pure parts (the jobs themselves are real `pipetransformer run` jobs that only
the benchmark runs): the two image domains share no scan and are the same every time, the
configurations are the paper's ablation and alpha sweep, and the summary's speed-ups, accuracy
deltas and times to the baseline's accuracy follow from the runs given."""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipetransformer.core.freeze import alpha_bound

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import paper  # noqa: E402


def _scans(root: Path) -> dict[str, set[str]]:
    """split -> the scan ids drawn (file `<scan>-<copy>.png`)."""
    return {
        split: {p.stem.split("-")[0] for p in (root / split).glob("*/*.png")}
        for split in ("train", "test")
    }


def test_domains_share_no_scan_and_are_reproducible(tmp_path: Path) -> None:
    src = paper.jittered_digits(tmp_path / "s", 0, paper.SOURCE, copies=1, seed=1)
    tgt = paper.jittered_digits(tmp_path / "t", 1, paper.TARGET, copies=2, seed=2)
    s, t = _scans(src), _scans(tgt)
    assert not (s["train"] | s["test"]) & (t["train"] | t["test"])  # no scan in both domains
    for d in (s, t):
        assert not d["train"] & d["test"]  # held-out scans never trained on, in any copy
        assert 0.15 < len(d["test"]) / (len(d["train"]) + len(d["test"])) < 0.25
    assert sorted(p.name for p in (tgt / "train").iterdir()) == [str(c) for c in range(10)]
    assert len(list((tgt / "train" / "3").glob("*.png"))) == 2 * len(
        {p.stem.split("-")[0] for p in (tgt / "train" / "3").glob("*.png")}
    )
    again = paper.jittered_digits(tmp_path / "t2", 1, paper.TARGET, copies=2, seed=2)
    for a in sorted((tgt / "test").glob("*/*.png"))[:20]:
        b = again / "test" / a.parent.name / a.name
        assert np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))
    # the target domain's tinted background: its typical pixel (the background's) is brighter
    tinted = [np.median(np.asarray(Image.open(p))) for p in sorted((tgt / "test").glob("*/*"))]
    plain = [np.median(np.asarray(Image.open(p))) for p in sorted((src / "test").glob("*/*"))]
    assert np.median(tinted) > np.median(plain) + 10


def test_configurations_are_the_ablation_and_the_sweep() -> None:
    configs = paper.configurations(Fraction(1, 4), keep=2)
    assert configs["baseline"] is None
    assert configs["freeze"]["relayout"] == "off" and configs["freeze"]["cache"] == "off"
    assert configs["freeze+pipe+cache"]["relayout"] == "repartition"
    assert configs["freeze+pipe+dp"] == {
        "policy": "gradient", "keep_trainable": 2, "alpha": 0.25, "relayout": "elastic",
        "cache": "off",
    }  # fmt: skip
    assert [configs[f"all a={a}"]["alpha"] for a in paper.ALPHAS] == [0.2, 0.25, 1 / 3, 0.4, 0.5]
    assert configs["all schedule"]["policy"] == "schedule"


def _run(wall: float, final: float, evals: list[float], first: int | None = 1) -> dict:
    return {
        "wall_s": wall,
        "startup_s": 20.0,
        "final_accuracy": final,
        "evals": [(e + 1, wall * (e + 1) / len(evals), a) for e, a in enumerate(evals)],
        "first_freeze_epoch": first,
        "half_frozen_fraction": 0.5 if first else 0.0,
    }


def test_summary_is_medians_over_seeds_against_each_seeds_baseline() -> None:
    names = paper.configurations(Fraction(1, 4), keep=2)
    seeds = []
    for k, base_wall in enumerate((100.0, 120.0, 110.0)):
        runs = {n: _run(50.0 + k, 0.8, [0.5, 0.79, 0.8]) for n in names}
        runs["baseline"] = _run(base_wall, 0.81, [0.6, 0.7, 0.81], first=None)
        runs["freeze"] = _run(base_wall, 0.7, [0.5, 0.6, 0.7])  # never reaches the baseline's
        seeds.append(runs)
    summary = paper.summarise(seeds, Fraction(1, 4))
    row = summary["ablation"]["all"]
    assert row["wall_time_speedup"] == pytest.approx(110 / 52)  # median of 100/50, 120/51, 110/52
    assert row["training_span_speedup"] == pytest.approx(90 / 32)  # 20 s of start-up each
    assert row["startup_s"] == 20.0
    assert row["accuracy_delta_pp"] == pytest.approx(-1.0)
    assert row["time_to_baseline_accuracy_speedup"] == 0.0  # 0.80 never reaches 0.81
    assert summary["ablation"]["freeze"]["wall_time_speedup"] == pytest.approx(1.0)
    assert summary["ablation"]["freeze"]["accuracy_delta_pp"] == pytest.approx(-11.0)
    assert set(summary["alpha_sweep"]) == {str(a) for a in paper.ALPHAS}
    assert summary["policies"]["gradient"]["first_freeze_epoch"] == 1


def test_time_to_an_accuracy_is_the_first_evaluation_reaching_it() -> None:
    hist = _run(90.0, 0.8, [0.5, 0.8, 0.7])
    assert paper.time_to(hist, 0.8) == pytest.approx(60.0)
    assert paper.time_to(hist, 0.81) is None


def test_a_sweep_of_its_own_and_whether_it_trades_speed_for_accuracy() -> None:
    configs = paper.configurations(Fraction(1, 4), keep=3, sweep_keep=1)
    # the headline keeps its cap; the sweep's rows are their own, with the lower one
    assert configs["all a=1/4"]["keep_trainable"] == 3
    assert "all a=1/2" not in configs
    assert [configs[f"sweep a={a}"]["keep_trainable"] for a in paper.ALPHAS] == [1] * 5
    # a partial run (--only the sweep and the baseline) summarises the sweep alone
    seeds = []
    for base_wall in (100.0, 110.0, 120.0):
        runs = {"baseline": _run(base_wall, 0.81, [0.6, 0.7, 0.81], first=None)}
        for k, a in enumerate(paper.ALPHAS):  # faster and less accurate as alpha grows
            runs[f"sweep a={a}"] = _run(60.0 - 5 * k, 0.81 - 0.002 * k, [0.5, 0.7, 0.81])
        seeds.append(runs)
    summary = paper.summarise(seeds, Fraction(1, 4))
    assert summary["ablation"] == {} and summary["policies"] == {}
    assert list(summary["alpha_sweep"]) == [str(a) for a in paper.ALPHAS]
    assert summary["alpha_sweep_monotonic"] == {"speedup_rises": True, "accuracy_falls": True}
    seeds[1]["sweep a=1/3"]["wall_s"] = 30.0  # one seed's outlier moves no median
    assert paper.summarise(seeds, Fraction(1, 4))["alpha_sweep_monotonic"]["speedup_rises"]
    for runs in seeds:  # a real dip is seen
        runs["sweep a=2/5"]["wall_s"] = 70.0
    assert not paper.summarise(seeds, Fraction(1, 4))["alpha_sweep_monotonic"]["speedup_rises"]
    assert paper.monotonic({"1/4": summary["alpha_sweep"]["1/4"]}) is None


def test_the_policy_comparison_runs_each_rule_at_the_same_alpha_and_cap() -> None:
    configs = paper.policy_configurations(Fraction(1, 4), keep=3, output_ratios=[0.4])
    assert list(configs) == [
        "baseline",
        "all gradient",
        "all schedule",
        "all output",
        "all output r=0.4",
        "bound",
    ]
    rules = [configs[n] for n in configs if n.startswith("all ")]
    assert {(c["alpha"], c["keep_trainable"], c["relayout"], c["cache"]) for c in rules} == {
        (0.25, 3, "elastic", "auto")
    }
    assert [c["policy"] for c in rules] == ["gradient", "schedule", "output", "output"]
    assert "output_ratio" not in configs["all output"]  # the spec's default
    assert configs["all output r=0.4"]["output_ratio"] == 0.4
    # the bound: a decision after every step, an alpha that reaches the cap at the first
    assert configs["bound"]["every"] == 1 and configs["bound"]["keep_trainable"] == 3
    assert alpha_bound(configs["bound"]["alpha"], 8, 1) >= 8 - 3  # the body's 8 blocks


def test_the_headline_is_what_auto_runs_with_its_worst_seed() -> None:
    names = paper.policy_configurations(Fraction(1, 4), keep=3)
    seeds = []
    for k, acc in enumerate((0.80, 0.78, 0.81)):
        runs = {n: _run(50.0, 0.8, [0.5, 0.8]) for n in names}
        runs["baseline"] = _run(100.0, 0.8, [0.6, 0.8], first=None)
        runs["all output"] = _run(40.0 + k, acc, [0.6, acc])
        seeds.append(runs)
    summary = paper.summarise(seeds, Fraction(1, 4))
    head = paper.headline_row(summary)
    assert head["name"] == "all output"
    assert head["accuracy_delta_pp"] == pytest.approx(0.0)
    assert head["worst_seed_accuracy_delta_pp"] == pytest.approx(-2.0)
    assert head["accuracy_delta_pp_by_seed"] == pytest.approx([0.0, -2.0, 1.0])
    assert head["worst_seed_wall_time_speedup"] == pytest.approx(100 / 42)
    assert summary["policies"]["output"]["first_freeze_epoch"] == 1
    assert "all" not in summary["ablation"]  # no ablation ran: nothing stands in for it


def test_the_tradeoff_figure_draws_every_run_against_its_first_freeze(tmp_path: Path) -> None:
    names = paper.policy_configurations(Fraction(1, 4), keep=3)
    seeds = []
    for first in (2, None):  # one seed's runs froze at epoch 2, the other's never
        runs = {n: _run(50.0, 0.8, [0.5, 0.8], first=first) for n in names}
        runs["baseline"] = _run(100.0, 0.8, [0.6, 0.8], first=None)
        runs["bound"] = _run(40.0, 0.7, [0.6, 0.7], first=0)  # -10 pp: off the speed panel
        for hist in runs.values():
            hist["samples_per_s_by_epoch"] = {"1": 10.0, "2": 20.0}
        seeds.append(runs)
    summary = paper.summarise(seeds, Fraction(1, 4))
    assert summary["rows"]["all output"]["first_freeze_epoch_by_seed"] == [2, None]
    assert summary["rows"]["bound"]["first_freeze_epoch_by_seed"] == [0, 0]
    paths = paper.plot(seeds, summary, tmp_path)
    tradeoff = tmp_path / "paper-tradeoff.png"
    assert str(tradeoff) in paths
    assert Image.open(tradeoff).size[0] > 1000
