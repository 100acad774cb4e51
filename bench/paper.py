"""The paper's experiment in miniature: wall time to the same accuracy when fine-tuning a pretrained
ViT, against a static pipeline, with PipeTransformer's ablation and its alpha sweep.

Design (PipeTransformer, ICML 2021, Section 5, on 2 worker processes of 1 thread each):

    data        scikit-learn's 8x8 digit scans, split in two halves that share no scan: the
                source domain draws one half (`--source-copies` times each, small rotations, no
                background), the target domain the other half (`--copies` times each, larger
                rotations and scales, more noise, a tinted background). The same ten classes in
                both, as ImageNet-21k's concepts cover ImageNet-1k's and CIFAR-100's
    upstream    one job pretrains a Hugging Face ViT (8 blocks of width 64, 32x32 images, 4x4
                patches) from a random initialisation on the source domain (`--upstream-device
                cuda`: minutes on a GPU; on the CPU about an hour at the defaults); its
                checkpoint is exported (`pipetransformer export`) and kept as a body
                (`ViTModel`, no head), as hub pretraining checkpoints are. `--body DIR` takes a
                body kept from an earlier `--keep DIR --upstream-only` run instead
    probe       a linear probe (logistic regression on the body's final [CLS] features) on the
                target domain: what the pretrained features give without fine-tuning
    downstream  every compared job fine-tunes the body on the target domain through the
                `transformers` path with a new head, for the same epochs:

      baseline          static pipeline, 2 stages x 1 replica, no freezing
      freeze            AutoFreeze only: layout and replicas unchanged, no cache
                        (freeze.relayout: off, freeze.cache: off)
      freeze+pipe+cache re-partitioned onto the same stages, frozen prefix from AutoCache
                        (freeze.relayout: repartition)
      freeze+pipe+dp    freed ranks become replicas, no cache (relayout: elastic, cache: off)
      all four          relayout: elastic, cache: auto, at each alpha of the sweep (1/5, 1/4, 1/3,
                        2/5, 1/2); and the same with the schedule policy at the default alpha

With `--policies`, the compared jobs are the freeze rules side by side instead, each with all four
components at the same alpha and cap: the gradient rule, the alpha schedule, the output rule (at
its default ratio and at each of `--output-ratios`) and the bound (the cap frozen after the
first step); the headline is the row of what `policy: auto` runs, with its worst seed, and each
run's wall time is split into where it went (`time_split`).

With `--workload lm`, the same on a decoder (bench/paper_lm.py): a Llama-shaped body of 8 blocks
pretrained on the standard library's packages' source (committed: bench/results/issue50-decoder),
fine-tuned in two regimes (`--regimes`): `continued` pre-training on pydoc's language reference
(prose) and `chat` fine-tuning on docstring answers (loss on the assistant's tokens). Rows: the
encoder's ablation (the paper's gradient rule), every freeze rule with all four components (the
output rule also at each of `--output-ratios`) and the bound, a decision point every `--every`
steps; quality is the held-out perplexity, its change in percent of the baseline's per seed, and
the time to the baseline's final perplexity; the zero-shot perplexity stands where the linear
probe does. Headline: the first regime's `policy: auto` row; bench/out/paper-lm.json and
paper-lm-<regime>-*.png.

Each configuration is a real job through `pipetransformer run`; per seed the configurations run
one after another in a rotated order, so that load drift on this shared machine hits them alike.
Per configuration (medians over seeds): the run's wall time (the `run` command, start-up
included) and its speed-up over the baseline, the speed-up of its span from first to last step,
final held-out accuracy, time to reach the baseline's final accuracy, the epoch of the first
freeze and the fraction of the run spent with at least half of the blocks frozen.

    .venv/bin/python bench/paper.py [--workload vit|lm] [--seeds 0 1 2] [--epochs 10] [--alpha 1/4]
        [--keep-trainable 3] [--sweep-keep-trainable 1] [--policies [--output-ratios R ...]]
        [--only NAME ...] [--keep DIR]
        [--upstream-device cuda]
        [--upstream-epochs 60] [--body DIR | --upstream-only] [--from-json paper.json ...]
        [--regimes continued chat] [--every 20] [--upstream-steps 3000]       (lm)

One JSON line (also bench/out/paper.json) and figures in bench/out/: paper-throughput.png
(samples/s over epochs per configuration), paper-ablation.png (speed-up bars), paper-alpha.png
(speed-up and accuracy against alpha), paper-policies.png (`--policies`: speed-up and accuracy
per seed, and the time split).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from _common import ROOT, emit, environment, out_dir, progress, run_cli_job

from pipetransformer.store import Store, sqlite_url

sys.path.insert(0, str(ROOT / "examples"))
from assets import make_vit  # noqa: E402
from paper_lm import REGIMES  # noqa: E402

CLASSES = range(10)
ALPHAS = [Fraction(1, 5), Fraction(1, 4), Fraction(1, 3), Fraction(2, 5), Fraction(1, 2)]
PAPER = {  # PipeTransformer's own figures (ViT-B/16; ablation on ImageNet, alpha on CIFAR-100)
    "ablation": {"freeze": 0.95, "freeze+pipe+cache": 1.26, "freeze+pipe+dp": 2.27, "all": 2.83},
    "alpha_sweep": {"1/5": 2.04, "1/4": 2.44, "1/3": 2.83, "2/5": 3.29, "1/2": 3.86},
}
# --workload lm: fine-tuning epochs per regime, where the baseline's held-out perplexity is still
# falling (chat rows overfit after 4: freezing would win by stopping that, not by its speed)
LM_EPOCHS = {"continued": 3, "chat": 4}
LM_BATCH = {"continued": 16, "chat": 8}  # and global batch (sequences of 128 tokens)
ABLATION = {  # name -> freeze section (beside policy, alpha, keep_trainable)
    "freeze": {"relayout": "off", "cache": "off"},
    "freeze+pipe+cache": {"relayout": "repartition", "cache": "auto"},
    "freeze+pipe+dp": {"relayout": "elastic", "cache": "off"},
    "all": {"relayout": "elastic", "cache": "auto"},
}


# -- the data and the upstream model --------------------------------------------------------------


@dataclass(frozen=True)
class Style:
    """How a domain draws its digits: rotation (degrees either way), scale range, pixel noise
    (standard deviation, of 255) and a background level (of 255) under the tinted strokes."""

    rotation: float
    scale: tuple[float, float]
    noise: float
    background: tuple[int, int]


# the source (pretraining) domain and the target (fine-tuning) domain: the same ten classes, as
# ImageNet-21k's concepts cover ImageNet-1k's and CIFAR's, drawn from other scans in another style
SOURCE = Style(rotation=12, scale=(0.85, 1.15), noise=8, background=(0, 0))
TARGET = Style(rotation=24, scale=(0.75, 1.05), noise=14, background=(20, 70))


def jittered_digits(
    root: Path, half: int, style: Style, copies: int, seed: int, size: int = 32
) -> Path:
    """`root/{train,test}/<digit>/<n>.png`: one `half` (0 or 1) of scikit-learn's 8x8 scans of each
    digit, each drawn `copies` times at `size` pixels in `style` with a random rotation, scale,
    shift, tint and noise (fixed by `seed`, so that a sample's pixels are the same every epoch and
    AutoCache applies). The two halves never share a scan; the held-out images come from
    held-out scans, never from a training scan's other copies."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    halves = np.random.default_rng(0)  # the same split of the scans for every seed and style
    rng = np.random.default_rng(seed)
    for label in CLASSES:
        idx = np.flatnonzero(digits.target == label)
        halves.shuffle(idx)
        idx = idx[half::2]
        n_test = round(len(idx) * 0.2)
        for split, chosen in (("test", idx[:n_test]), ("train", idx[n_test:])):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                grey = Image.fromarray((digits.images[i] * (255 / 16)).astype(np.uint8))
                grey = grey.resize((24, 24), Image.BILINEAR)
                for c in range(copies):
                    g = grey.rotate(rng.uniform(-style.rotation, style.rotation), Image.BILINEAR)
                    side = int(round(24 * rng.uniform(*style.scale)))
                    g = g.resize((side, side), Image.BILINEAR).crop((0, 0, size, size))
                    canvas = Image.new("L", (size, size))
                    at = rng.integers(0, max(1, size - side + 1), 2)
                    canvas.paste(g, (int(at[0]), int(at[1])))
                    pixels = np.asarray(canvas, dtype=np.float32)
                    back = rng.uniform(*style.background, 3) if style.background[1] else 0.0
                    rgb = pixels[..., None] * rng.uniform(0.6, 1.0, 3) + back
                    rgb = rgb + rng.normal(0, style.noise, rgb.shape)
                    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(
                        folder / f"{i}-{c}.png"
                    )
    return root


def _run(tmp: Path, spec: dict, job_id: str, cache: Path) -> float:
    """`pipetransformer run` of `spec` as job `job_id` under `tmp/<job_id>`; its wall time (s)."""
    res, wall = run_cli_job(tmp, spec, job_id, {"PIPETRANSFORMER_CACHE": str(cache)})
    if res.returncode != 0:
        raise SystemExit(f"{job_id} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return wall


def _job(name: str, pretrained: Path, data: Path, classes: int, seed: int, epochs: int) -> dict:
    return {
        "name": name,
        "model": {"pretrained": str(pretrained), "num_classes": classes},
        "data": {
            "dataset": "image-folder",
            "train": str(data / "train"),
            "test": str(data / "test"),
            "loader_workers": 1,
        },
        "training": {
            "epochs": epochs,
            "global_batch_size": 64,
            "lr": 0.001,
            "warmup_steps": 10,
            "seed": seed,
        },
        "parallel": {"stages": 2, "replicas": 1, "microbatches": 4},
        "checkpoint": {"every_epochs": epochs, "keep": 1},
    }


def upstream(tmp: Path, epochs: int, cache: Path, device: str = "cpu") -> Path:
    """Pretrain a random ViT on the source task (one process on `device`: `cuda` is the quick
    way, as hub checkpoints come from accelerators; else 2 CPU processes); its blocks exported
    as a `ViTModel` body."""
    from transformers import AutoImageProcessor, ViTForImageClassification

    init = make_vit(tmp / "vit-init", patch_size=4, layers=8, num_labels=len(CLASSES))
    spec = _job("upstream", init, tmp / "source", len(CLASSES), 100, epochs)
    spec["training"].update(lr=0.003, warmup_steps=20)
    if device != "cpu":
        spec["runtime"] = {"device": device}
        spec["parallel"] = {"stages": 1, "replicas": 1, "microbatches": 1}
        spec["data"]["loader_workers"] = 4
    wall = _run(tmp, spec, "upstream", cache)
    exported = tmp / "upstream-export"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pipetransformer.orchestrator.cli",
            "export",
            "upstream",
            "--to",
            str(exported),
        ]
        + ["--workdir", str(tmp / "upstream")],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={**os.environ, "PIPETRANSFORMER_CACHE": str(cache)},
    )
    body = tmp / "body"
    ViTForImageClassification.from_pretrained(exported).vit.save_pretrained(body)
    AutoImageProcessor.from_pretrained(exported).save_pretrained(body)
    store = Store.open(sqlite_url(tmp / "upstream" / "store.db"), migrate=False)
    acc = store.evaluations("upstream")[-1].accuracy
    store.close()
    progress(f"upstream: {epochs} epochs in {wall:.0f}s, source held-out accuracy {acc:.3f}")
    return body


def linear_probe(body: Path, data: Path) -> float:
    """Held-out accuracy of logistic regression on the frozen body's final [CLS] features."""
    import torch
    from PIL import Image
    from sklearn.linear_model import LogisticRegression
    from transformers import AutoImageProcessor, ViTModel

    processor = AutoImageProcessor.from_pretrained(body)
    model = ViTModel.from_pretrained(body, add_pooling_layer=False).eval()

    def features(split: str) -> tuple[np.ndarray, np.ndarray]:
        files = sorted((data / split).glob("*/*.png"))
        out = []
        for i in range(0, len(files), 256):
            images = [Image.open(p).convert("RGB") for p in files[i : i + 256]]
            pixels = processor(images=images, return_tensors="pt")["pixel_values"]
            with torch.no_grad():
                out.append(model(pixel_values=pixels).last_hidden_state[:, 0].numpy())
        return np.concatenate(out), np.array([int(p.parent.name) for p in files])

    (x, y), (xt, yt) = features("train"), features("test")
    probe = LogisticRegression(max_iter=2000).fit(x, y)
    return float((probe.predict(xt) == yt).mean())


# -- the compared jobs ----------------------------------------------------------------------------


def configurations(
    alpha: Fraction, keep: int, sweep_keep: int | None = None
) -> dict[str, dict | None]:
    """name -> the freeze section of its spec (None: the baseline, no freezing). With a
    `sweep_keep` other than `keep`, the alpha sweep is its own rows (`sweep a=X`, all four
    components with keep_trainable `sweep_keep`) beside the headline `all a=alpha`: with a cap
    that every alpha reaches within two decisions, alpha cannot show what it trades."""
    configs: dict[str, dict | None] = {"baseline": None}
    base = {"policy": "gradient", "keep_trainable": keep}
    for name, extra in ABLATION.items():
        if name != "all":
            configs[name] = {**base, "alpha": float(alpha), **extra}
    if sweep_keep is None or sweep_keep == keep:
        for a in ALPHAS:
            configs[f"all a={a}"] = {**base, "alpha": float(a), **ABLATION["all"]}
    else:
        configs[f"all a={alpha}"] = {**base, "alpha": float(alpha), **ABLATION["all"]}
        for a in ALPHAS:
            configs[f"sweep a={a}"] = {
                **base,
                "keep_trainable": sweep_keep,
                "alpha": float(a),
                **ABLATION["all"],
            }
    configs["all schedule"] = {
        **base,
        "policy": "schedule",
        "alpha": float(alpha),
        **ABLATION["all"],
    }
    return configs


# the freeze rules side by side (`--policies`), each with all four components at the same alpha
# and cap; `bound`: every block but the top keep_trainable frozen at the first step (a decision
# point after every step, and an alpha that reaches the cap at once), the most freezing can give
POLICY_ROWS = ("all gradient", "all schedule", "all output", "bound")


def policy_configurations(
    alpha: Fraction, keep: int, output_ratios: list[float] | None = None
) -> dict[str, dict | None]:
    """name -> freeze section for the policy comparison: the baseline, the gradient rule, the
    alpha schedule and the output rule (at the spec's default `output_ratio`, and at each of
    `output_ratios` as rows `all output r=X`) under all four components, and the bound."""
    base = {"keep_trainable": keep, "alpha": float(alpha), **ABLATION["all"]}
    configs: dict[str, dict | None] = {
        "baseline": None,
        "all gradient": {**base, "policy": "gradient"},
        "all schedule": {**base, "policy": "schedule"},
        "all output": {**base, "policy": "output"},
    }
    for r in output_ratios or []:
        configs[f"all output r={r:g}"] = {**base, "policy": "output", "output_ratio": r}
    configs["bound"] = {**base, "policy": "schedule", "every": 1, "alpha": 0.99}
    return configs


def lm_configurations(
    alpha: Fraction, keep: int, every: int, output_ratios: list[float] | None = None
) -> dict[str, dict | None]:
    """name -> freeze section for the decoder (`--workload lm`): the encoder's ablation rows
    (the paper's gradient rule), every freeze rule with all four components (the output rule
    also at each of `output_ratios`) and the bound, each deciding every `every` optimizer
    steps (an epoch holds a few dozen)."""
    rows = configurations(alpha, keep)
    rows = {n: rows[n] for n in ("baseline", *(a for a in ABLATION if a != "all"))}
    rows |= {n: c for n, c in policy_configurations(alpha, keep, output_ratios).items() if c}
    for config in rows.values():
        if config is not None:
            config.setdefault("every", every)
    return rows


def history(workdir: Path, job_id: str, wall: float) -> dict[str, Any]:
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    try:
        metrics, evals = store.metrics(job_id), store.evaluations(job_id)
        model = store.get_job(job_id).spec.model
        depth, lm = model.depth, model.task == "causal-lm"
    finally:
        store.close()
    t0 = metrics[0].time  # the first step's end: start-up (and that step) come before it
    steps_per_epoch = max(m.step for m in metrics) / max(e.epoch for e in evals)
    epochs: dict[int, list[float]] = {}
    for m in metrics:
        epochs.setdefault(int((m.step - 1) // steps_per_epoch) + 1, []).append(m.samples_per_s or 0)
    # the epoch at whose end the first freeze came: the one before the first that trained frozen
    first_freeze = next((e.epoch - 1 for e, m in _evals_with_frozen(evals, metrics) if m > 0), None)
    half = [m.time for m in metrics if (m.frozen or 0) >= depth / 2]
    span = metrics[-1].time - t0
    # a language model's held-out loss is per counted token: its exp is the perplexity
    ppl = [math.exp(e.loss) if lm and e.loss is not None else None for e in evals]
    return {
        "wall_s": wall,
        "startup_s": wall - span,
        "final_accuracy": evals[-1].accuracy,
        "final_perplexity": ppl[-1],
        "evals": [
            (e.epoch, e.time - t0 + (wall - span), e.accuracy, p)
            for e, p in zip(evals, ppl, strict=True)
        ],
        "samples_per_s_by_epoch": {k: statistics.median(v) for k, v in sorted(epochs.items())},
        "first_freeze_epoch": first_freeze,
        "half_frozen_fraction": (metrics[-1].time - half[0]) / span if half else 0.0,
        "final_frozen": metrics[-1].frozen or 0,
    }


def time_split(workdir: Path, job_id: str, started: float, wall: float) -> dict[str, float]:
    """Where a run's wall time went (seconds), from its store: `startup` (the command's start to
    the first step's start), `steps_unfrozen` and `steps_frozen` (optimizer steps trained under
    boundary 0 and above it, each step's time being its rows over its measured samples/s),
    `relayout_pauses` (the re-layouts' own pauses), `frozen_prefix` (rank 0's time computing the
    frozen prefix or filling and reading AutoCache, inside the frozen steps), `evaluation`
    (rank 0's held-out passes), `other` (what else the span between steps holds: control points,
    decision points and their probes) and `final` (the last step's end to the command's end, less
    the last evaluation: the final checkpoint and shutdown). All but `frozen_prefix` and
    `freeze_probes` (the output rule's probes, inside `other`) add up to the wall time. Each
    step's rows follow from the training split's samples (a language model's: its packed
    sequences) and the global batch, an epoch's last step having the remainder."""
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    try:
        batch = store.get_job(job_id).spec.training.global_batch_size
        train = store.events(job_id, kinds=["data_opened"])[0].data["origin"]["train"]
        rows = train.get("sequences") or train["rows"]
        metrics, evals = store.metrics(job_id), store.evaluations(job_id)
        layouts = store.events(job_id, kinds=["layout_planned"])
        probes = sum(f.probe_s for f in store.freeze_signals(job_id))
        times = [t for t in store.stage_times(job_id) if t.rank == 0]
    finally:
        store.close()
    per_epoch = -(-rows // batch)
    last = rows - (per_epoch - 1) * batch

    def step_s(m: Any) -> float:
        n = last if m.step % per_epoch == 0 else batch
        return n / m.samples_per_s if m.samples_per_s else 0.0

    unfrozen = sum(step_s(m) for m in metrics if not m.frozen)
    frozen = sum(step_s(m) for m in metrics if m.frozen)
    first = step_s(metrics[0])
    startup = metrics[0].time - first - started
    final = started + wall - metrics[-1].time
    pauses = sum(
        (e.data or {}).get("seconds") or 0.0 for e in layouts if (e.data or {}).get("cost")
    )
    evaluation = sum(t.seconds.evaluation for t in times)
    prefix = sum(t.seconds.frozen_prefix for t in times)
    span = metrics[-1].time - (metrics[0].time - first)
    # the last epoch's evaluation comes after the last step: in the tail, not the span (the
    # passes are alike, each the same held-out rows)
    last_eval = evaluation / len(evals) if evals else 0.0
    return {
        "startup": startup,
        "steps_unfrozen": unfrozen,
        "steps_frozen": frozen,
        "frozen_prefix": prefix,
        "relayout_pauses": pauses,
        "evaluation": evaluation,
        "other": span - unfrozen - frozen - pauses - (evaluation - last_eval),
        "final": final - last_eval,
        "freeze_probes": probes,
    }


def _evals_with_frozen(evals: list, metrics: list) -> list[tuple[Any, int]]:
    """Each evaluation with the boundary its epoch's last step trained under."""
    frozen = {m.step: m.frozen or 0 for m in metrics}
    return [(e, frozen.get(e.step, 0)) for e in evals]


def time_to(hist: dict, accuracy: float) -> float | None:
    """Seconds from the run's start until its held-out accuracy first reached `accuracy`."""
    return next((e[1] for e in hist["evals"] if e[2] >= accuracy - 1e-12), None)


def time_to_perplexity(hist: dict, perplexity: float) -> float | None:
    """Seconds from the run's start until its held-out perplexity first fell to `perplexity`."""
    return next((e[1] for e in hist["evals"] if e[3] <= perplexity * (1 + 1e-12)), None)


# -- figures --------------------------------------------------------------------------------------


def plot(per_seed: list[dict], summary: dict, out: Path, prefix: str = "paper") -> list[str]:
    """The figures as `out/<prefix>-*.png`; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, hist in per_seed[0].items():
        by_epoch = hist["samples_per_s_by_epoch"]
        ax.plot(list(by_epoch), list(by_epoch.values()), marker="o", ms=3, label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("samples/s (median step; a language model's: sequences)")
    ax.set_title("Fine-tuning throughput per epoch (first seed)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(str(out / f"{prefix}-throughput.png"))
    fig.savefig(paths[-1], dpi=120)

    if summary["ablation"]:
        paths.append(_plot_ablation(plt, summary, out / f"{prefix}-ablation.png"))
    if summary["alpha_sweep"]:
        paths.append(_plot_alpha(plt, summary, out / f"{prefix}-alpha.png"))
    if "all output" in summary["rows"]:
        paths.append(_plot_policies(plt, summary, out / f"{prefix}-policies.png"))
        paths.append(_plot_tradeoff(plt, summary, out / f"{prefix}-tradeoff.png"))
    plt.close("all")
    return paths


def _plot_ablation(plt: Any, summary: dict, path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(summary["ablation"])
    ours = [summary["ablation"][n]["wall_time_speedup"] for n in names]
    x = np.arange(len(names))
    ax.bar(x - 0.2, ours, 0.4, label="this project (2 CPU processes)")
    ax.bar(x + 0.2, [PAPER["ablation"][n] for n in names], 0.4, label="paper (ViT-B, ImageNet)")
    ax.set_xticks(x, names)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("wall-time speed-up over the baseline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


SPLIT_COLOURS = {
    "startup": "tab:grey",
    "steps_unfrozen": "tab:blue",
    "steps_frozen": "tab:green",
    "relayout_pauses": "tab:red",
    "evaluation": "tab:purple",
    "other": "tab:olive",
    "final": "tab:brown",
}


def _plot_policies(plt: Any, summary: dict, path: Path) -> str:
    """The freeze rules side by side: speed-up and accuracy delta per seed (dots) and their
    medians (bars), and the median wall time split into where it went."""
    rows = {n: r for n, r in summary["rows"].items() if n != "baseline"}
    names = list(rows)
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    quality = _quality(summary)
    for ax, key, label in (
        (axes[0], "wall_time_speedup", "wall-time speed-up over the baseline"),
        (axes[1], quality[0], quality[1]),
    ):
        ax.bar(x, [rows[n][key] for n in names], 0.6, alpha=0.5)
        for i, n in enumerate(names):
            seeds = rows[n].get(f"{key}_by_seed", [])
            ax.plot([i] * len(seeds), seeds, "k.", ms=5)
        ax.set_xticks(x, names, rotation=20, fontsize=8)
        ax.set_ylabel(label)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].axhline(1.8, color="tab:green", lw=0.8, ls="--")
    # the parity limits: no seed past the first, the median within the second
    axes[1].axhline(quality[2][0], color="tab:red", lw=0.8, ls="--")
    axes[1].axhline(quality[2][1], color="tab:orange", lw=0.8, ls="--")
    everything = {"baseline": summary["rows"]["baseline"], **rows}
    bottom = np.zeros(len(everything))
    for part, colour in SPLIT_COLOURS.items():
        values = np.array([r.get("time_split", {}).get(part) or 0.0 for r in everything.values()])
        axes[2].bar(
            np.arange(len(everything)), values, 0.6, bottom=bottom, color=colour, label=part
        )
        bottom += values
    axes[2].set_xticks(np.arange(len(everything)), list(everything), rotation=20, fontsize=8)
    axes[2].set_ylabel("seconds (median over seeds)")
    axes[2].legend(fontsize=7)
    fig.suptitle("Freeze rules side by side (dots: seeds; bars: medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def _quality(summary: dict) -> tuple[str, str, tuple[float, float]]:
    """The quality column of a summary's rows, its label and the parity limits: the one no
    seed may pass, and the one the median must stay within."""
    if "perplexity_delta_pct" in summary["rows"]["baseline"]:
        return "perplexity_delta_pct", "held-out perplexity change (%)", (2.0, 1.0)
    return "accuracy_delta_pp", "held-out accuracy delta (pp)", (-1.0, -0.5)


def _plot_tradeoff(plt: Any, summary: dict, path: Path) -> str:
    """Every run of every rule as a dot: its quality change against the epoch it first froze
    in (left: when a rule freezes decides what it costs), and its speed-up against its quality
    change, with the goal's corner shaded (right: what a rule would have to reach)."""
    key, label, (limit, _) = _quality(summary)
    rows = {n: r for n, r in summary["rows"].items() if n != "baseline"}
    epochs = max(
        (e for r in rows.values() for e in r["first_freeze_epoch_by_seed"] if e), default=1
    )
    never = epochs + 1
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    off: list[str] = []  # rows off the right panel's scale (medians)
    for i, (name, row) in enumerate(rows.items()):
        colour = f"C{i}"
        quality, speed = row[f"{key}_by_seed"], row["wall_time_speedup_by_seed"]
        first = [never if e is None else e for e in row["first_freeze_epoch_by_seed"]]
        jitter = (i - len(rows) / 2) * 0.06  # rules side by side at each epoch
        left.plot([e + jitter for e in first], quality, "o", color=colour, label=name, ms=5)
        if abs(row[key]) <= 3 * abs(limit):  # the bound's cost would squeeze the rest
            right.plot(quality, speed, "o", color=colour, label=name, ms=5)
        else:
            off.append(f"{name}: {row[key]:+.1f}, {row['wall_time_speedup']:.2f}x")
    left.set_xticks(range(never + 1), [*map(str, range(never)), "never"])
    left.set_xlabel("epoch of the first freeze (0: the first step)")
    left.set_ylabel(label)
    left.axhline(limit, color="tab:red", lw=0.8, ls="--")
    left.axhline(0.0, color="grey", lw=0.8)
    right.set_xlabel(label)
    right.set_ylabel("wall-time speed-up over the baseline")
    if off:
        right.set_title("off the scale (median): " + "; ".join(off), fontsize=8)
    right.axhline(1.0, color="grey", lw=0.8)
    (low, high), top = right.get_xlim(), max(right.get_ylim()[1], 1.9)
    goal = (limit, high) if limit < 0 else (low, limit)  # a quality loss: the side within it
    right.fill_between(goal, 1.8, top, color="tab:green", alpha=0.12, label="goal")
    right.set_xlim(low, high)
    right.set_ylim(top=top)
    right.legend(fontsize=7)
    fig.suptitle("Freeze rules, every seed: what freezing early costs, and the goal's corner")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def _plot_alpha(plt: Any, summary: dict, path: Path) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = list(summary["alpha_sweep"])
    alphas = [float(Fraction(a)) for a in labels]
    sweep = summary["alpha_sweep"]
    ax.plot(alphas, [sweep[a]["wall_time_speedup"] for a in labels], "o-", label="speed-up")
    ax.plot(alphas, [PAPER["alpha_sweep"][a] for a in labels], "s--", label="paper's speed-up")
    ax.set_xlabel("alpha")
    ax.set_ylabel("wall-time speed-up")
    ax2 = ax.twinx()
    ax2.plot(
        alphas,
        [sweep[a]["accuracy_delta_pp"] for a in labels],
        "^-",
        color="tab:red",
        label="accuracy delta (pp)",
    )
    ax2.set_ylabel("held-out accuracy delta (pp)")
    lines = [h for a in (ax, ax2) for h in a.get_legend_handles_labels()[0]]
    ax.legend(lines, [h.get_label() for h in lines], fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


# -- the run --------------------------------------------------------------------------------------


def _probe_fraction(hist: dict) -> float | None:
    split = hist.get("time_split")
    if not split:
        return None
    steps = split["steps_unfrozen"] + split["steps_frozen"]
    return split["freeze_probes"] / steps if steps else None


def _med(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summarise(
    per_seed: list[dict[str, dict]], default_alpha: Fraction, all_row: str | None = None
) -> dict[str, Any]:
    """Per configuration: medians over seeds of speed-up, accuracy delta and time to the
    baseline's accuracy (a seed that never reaches it counts as no speed-up there); for a
    language model also the perplexity's change (%) and the time to the baseline's final
    perplexity. `all_row`: the row that is the ablation's all four (default `all a=<alpha>`)."""
    rows: dict[str, dict] = {}
    lm = per_seed[0]["baseline"].get("final_perplexity") is not None
    for name in per_seed[0]:
        speedups, spans, deltas, tta, first, half = [], [], [], [], [], []
        for runs in per_seed:
            base, hist = runs["baseline"], runs[name]
            speedups.append(base["wall_s"] / hist["wall_s"])
            # the same without the time outside the first-to-last-step span (start-up: etcd,
            # controller, workers, the model; the last checkpoint), which does not shrink
            spans.append(
                (base["wall_s"] - base["startup_s"]) / (hist["wall_s"] - hist["startup_s"])
            )
            deltas.append(100 * (hist["final_accuracy"] - base["final_accuracy"]))
            t_base, t_this = (
                time_to(base, base["final_accuracy"]),
                time_to(hist, base["final_accuracy"]),
            )
            tta.append(t_base / t_this if t_base and t_this else 0.0)
            first.append(hist["first_freeze_epoch"])
            half.append(hist["half_frozen_fraction"])
        rows[name] = {
            "wall_time_speedup": _med(speedups),
            "worst_seed_wall_time_speedup": min(speedups),
            "training_span_speedup": _med(spans),
            "startup_s": _med([r[name]["startup_s"] for r in per_seed]),
            "accuracy_delta_pp": _med(deltas),
            "worst_seed_accuracy_delta_pp": min(deltas),
            "accuracy_delta_pp_by_seed": deltas,
            "wall_time_speedup_by_seed": speedups,
            "first_freeze_epoch_by_seed": first,
            "time_to_baseline_accuracy_speedup": _med(tta),
            "wall_s": _med([r[name]["wall_s"] for r in per_seed]),
            "final_accuracy": _med([r[name]["final_accuracy"] for r in per_seed]),
            "first_freeze_epoch": _med(first),
            "half_frozen_fraction": _med(half),
            "time_split": {
                k: _med([r[name]["time_split"][k] for r in per_seed])
                for k in per_seed[0][name].get("time_split", {})
            },
            # what reading the freeze signal cost, against the time in optimizer steps
            "probe_cost_fraction": _med([_probe_fraction(r[name]) for r in per_seed]),
        }
        if lm:
            rows[name] |= _perplexity_columns([(r["baseline"], r[name]) for r in per_seed])
    default = all_row or f"all a={default_alpha}"
    # a partial run (--only) summarises what it ran
    ablation = {n: rows[n] for n in ABLATION if n != "all" and n in rows}
    if default in rows:
        ablation["all"] = rows[default]
    prefix = "sweep" if any(n.startswith("sweep a=") for n in rows) else "all"
    sweep = {str(a): rows[f"{prefix} a={a}"] for a in ALPHAS if f"{prefix} a={a}" in rows}
    kinds = ("first_freeze_epoch", "half_frozen_fraction")
    policies = {
        policy: {k: rows[name][k] for k in kinds}
        for policy, name in (
            ("gradient", default if default in rows else "all gradient"),
            ("schedule", "all schedule"),
            ("output", "all output"),
        )
        if name in rows
    }
    return {
        "rows": rows,
        "ablation": ablation,
        "alpha_sweep": sweep,
        "alpha_sweep_monotonic": monotonic(sweep),
        "policies": policies,
    }


def _perplexity_columns(pairs: list[tuple[dict, dict]]) -> dict[str, Any]:
    """A language model's row over (baseline, run) per seed: the held-out perplexity's change
    in percent of the baseline's (lower is better, so the worst seed is the highest) and the
    speed-up to the baseline's final perplexity."""
    deltas, tta = [], []
    for base, hist in pairs:
        deltas.append(100 * (hist["final_perplexity"] / base["final_perplexity"] - 1))
        t_base = time_to_perplexity(base, base["final_perplexity"])
        t_this = time_to_perplexity(hist, base["final_perplexity"])
        tta.append(t_base / t_this if t_base and t_this else 0.0)
    return {
        "final_perplexity": _med([h["final_perplexity"] for _, h in pairs]),
        "perplexity_delta_pct": _med(deltas),
        "worst_seed_perplexity_delta_pct": max(deltas),
        "perplexity_delta_pct_by_seed": deltas,
        "time_to_baseline_perplexity_speedup": _med(tta),
    }


def headline_row(summary: dict[str, Any]) -> dict[str, Any]:
    """The row the last JSON line leads with: all four components under what `policy: auto`
    runs where the policies were compared, else the ablation's all four (empty: neither ran)."""
    from pipetransformer.core.freeze import AUTO_POLICY

    rows = summary["rows"]
    name = f"all {AUTO_POLICY}"
    if name in rows:
        return {"name": name, **rows[name]}
    if "all" in summary["ablation"]:
        return {"name": "all", **summary["ablation"]["all"]}
    return {}


def monotonic(sweep: dict[str, dict]) -> dict[str, bool] | None:
    """Whether the sweep trades as the paper's does: speed-up never falling and accuracy never
    rising as alpha grows (None: fewer than two alphas)."""
    if len(sweep) < 2:
        return None
    ordered = [sweep[a] for a in sorted(sweep, key=Fraction)]
    speed = [r["wall_time_speedup"] for r in ordered]
    acc = [r["accuracy_delta_pp"] for r in ordered]
    return {
        "speedup_rises": all(b >= a for a, b in zip(speed, speed[1:], strict=False)),
        "accuracy_falls": all(b <= a for a, b in zip(acc, acc[1:], strict=False)),
    }


def run_rows(
    tmp: Path,
    configs: dict[str, dict | None],
    seeds: list[int],
    spec_for: Callable[[int], dict],
    cache: Path,
    label: str = "",
) -> list[dict[str, dict]]:
    """Each configuration as a real job per seed (`spec_for(seed)` with its freeze section), in
    an order rotated per seed so that load drift on this shared machine hits them alike; per
    seed, name -> the run's history and time split."""
    per_seed: list[dict[str, dict]] = []
    names = list(configs)
    for k, seed in enumerate(seeds):
        runs: dict[str, dict] = {}
        for name in names[k % len(names) :] + names[: k % len(names)]:
            spec = spec_for(seed)
            if configs[name] is not None:
                spec["freeze"] = configs[name]
            job = f"{label}s{seed}-{len(runs)}"
            started = time.time()
            wall = _run(tmp, spec, job, cache)
            runs[name] = history(tmp / job, job, wall)
            runs[name]["time_split"] = time_split(tmp / job, job, started, wall)
            quality = (
                f"perplexity {runs[name]['final_perplexity']:.2f}"
                if runs[name]["final_perplexity"] is not None
                else f"accuracy {runs[name]['final_accuracy']:.3f}"
            )
            progress(
                f"{label}seed {seed} {name}: {wall:.0f}s, {quality}, first freeze epoch "
                f"{runs[name]['first_freeze_epoch']}"
            )
        per_seed.append({n: runs[n] for n in names})
    return per_seed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        choices=("vit", "lm"),
        default="vit",
        help="vit: the encoder (a ViT between two image domains); lm: a decoder between two "
        "text domains, in two regimes (bench/paper_lm.py)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--epochs",
        type=int,
        help="fine-tuning epochs (default: 10 for vit; for lm, per regime: "
        + ", ".join(f"{r} {e}" for r, e in LM_EPOCHS.items())
        + ")",
    )
    parser.add_argument("--upstream-epochs", type=int, default=60, help="vit's pretraining")
    parser.add_argument(
        "--upstream-steps", type=int, default=3000, help="lm's pretraining (AdamW steps)"
    )
    parser.add_argument("--copies", type=int, default=4, help="drawings of each target scan")
    parser.add_argument("--source-copies", type=int, default=16, help="of each source scan")
    parser.add_argument(
        "--upstream-device", default="cpu", help="where vit's upstream job runs (cpu, cuda)"
    )
    parser.add_argument(
        "--body",
        type=Path,
        help="a pretrained body from an earlier --keep run (skip upstream): vit's "
        "bench/results/issue24-body, lm's bench/results/issue50-decoder",
    )
    parser.add_argument(
        "--upstream-only", action="store_true", help="pretrain, probe and stop (with --keep)"
    )
    parser.add_argument("--alpha", type=Fraction, default=Fraction(1, 4), help="'all' alpha")
    parser.add_argument(
        "--keep-trainable",
        type=int,
        default=3,
        help="freeze.keep_trainable of every freezing job (default 3 of the 8 blocks: with 2 the "
        "target's domain shift cost about 1 pp of accuracy)",
    )
    parser.add_argument(
        "--sweep-keep-trainable",
        type=int,
        help="freeze.keep_trainable of the alpha sweep's jobs, as rows `sweep a=X` of their own "
        "(default: --keep-trainable, the sweep being the `all a=X` rows); 1 lets alpha, not the "
        "cap, set how fast the boundary rises",
    )
    parser.add_argument(
        "--policies",
        action="store_true",
        help="the freeze rules side by side instead of the ablation: the gradient rule, the "
        "alpha schedule and the output rule with all four components at --alpha and "
        "--keep-trainable, and the bound (the cap frozen at the first step); the headline is "
        "the row of what `policy: auto` runs (lm: always both, the ablation under auto's rule)",
    )
    parser.add_argument(
        "--output-ratios",
        type=float,
        nargs="*",
        default=[],
        help="with --policies (and lm): the output rule at these freeze.output_ratio values too",
    )
    parser.add_argument(
        "--regimes",
        nargs="+",
        choices=REGIMES,
        default=list(REGIMES),
        help="lm: continued pre-training on prose, supervised fine-tuning on chat rows",
    )
    parser.add_argument(
        "--every",
        type=int,
        default=20,
        help="lm: a freeze decision point every this many optimizer steps",
    )
    parser.add_argument("--only", nargs="+", help="run only these configurations (and baseline)")
    parser.add_argument("--keep", type=Path, help="keep the runs under this directory")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        help="summarise and plot earlier runs' paper.json again (several: their seeds together, "
        "the first one's config)",
    )
    return parser


def main_lm(args: argparse.Namespace) -> None:
    """The decoder (`--workload lm`): the upstream decoder (or `--body`), then per regime its
    zero-shot perplexity and every configuration per seed; the headline is the first regime's
    row of what `policy: auto` runs."""
    import paper_lm

    all_row = "all gradient"  # the ablation's all four: the paper's rule, as its other rows
    if args.from_json:
        runs = [json.loads(f.read_text().strip().splitlines()[-1]) for f in args.from_json]
        earlier = runs[0]
        for regime, result in earlier["regimes"].items():
            result["per_seed"] = [s for run in runs for s in run["regimes"][regime]["per_seed"]]
        earlier["config"]["seeds"] = [s for run in runs for s in run["config"]["seeds"]]
        regimes = {
            regime: _lm_regime(
                regime, r["per_seed"], r["zero_shot_perplexity"], args.alpha, all_row
            )
            for regime, r in earlier["regimes"].items()
        }
        emit(earlier | _lm_headline(regimes), save_as="paper-lm.json")
        return
    configs = lm_configurations(args.alpha, args.keep_trainable, args.every, args.output_ratios)
    if args.only:
        configs = {k: v for k, v in configs.items() if k == "baseline" or k in args.only}
    regimes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or Path(scratch)
        cache = tmp / "cache"
        targets = paper_lm.make_targets(tmp / "targets")
        if args.body:
            body = args.body
        else:
            progress(f"upstream: pretraining on the source ({args.upstream_steps} steps)")
            body = paper_lm.upstream(tmp / "decoder", targets, args.upstream_steps)
        zero_shot = {r: paper_lm.zero_shot_perplexity(body, targets[r]) for r in args.regimes}
        progress(f"zero-shot perplexity on the targets: {zero_shot}")
        if args.upstream_only:
            return
        for regime in args.regimes:
            epochs = args.epochs or LM_EPOCHS[regime]

            def spec_for(seed: int, regime: str = regime, epochs: int = epochs) -> dict:
                return paper_lm.job(
                    "ft", body, regime, targets[regime], seed, epochs, LM_BATCH[regime]
                )

            per_seed = run_rows(tmp, configs, args.seeds, spec_for, cache, f"{regime}-")
            regimes[regime] = _lm_regime(regime, per_seed, zero_shot[regime], args.alpha, all_row)
    emit(
        {
            "benchmark": "paper",
            "workload": "lm",
            **_lm_headline(regimes),
            "regimes": regimes,
            "paper": PAPER,
            "goals": {
                "wall_time_speedup": 1.8,
                "perplexity_delta_pct": 1.0,
                "worst_seed_perplexity_delta_pct": 2.0,
            },
            "config": {
                "seeds": args.seeds,
                "epochs": {r: args.epochs or LM_EPOCHS[r] for r in args.regimes},
                "global_batch_size": {r: LM_BATCH[r] for r in args.regimes},
                "every": args.every,
                "upstream_steps": args.upstream_steps,
                "body": str(args.body) if args.body else None,
                "alpha": str(args.alpha),
                "keep_trainable": args.keep_trainable,
                "only": args.only,
            },
            "environment": environment(),
        },
        save_as="paper-lm.json",
    )


def _lm_regime(
    regime: str, per_seed: list[dict], zero_shot: float, alpha: Fraction, all_row: str
) -> dict[str, Any]:
    """One regime's result: its summary, the per-seed runs and its figures."""
    summary = summarise(per_seed, alpha, all_row=all_row)
    head = headline_row(summary)
    return {
        "headline": head.get("name"),
        "wall_time_speedup": head.get("wall_time_speedup"),
        "perplexity_delta_pct": head.get("perplexity_delta_pct"),
        "worst_seed_perplexity_delta_pct": head.get("worst_seed_perplexity_delta_pct"),
        "zero_shot_perplexity": zero_shot,
        "ablation": summary["ablation"],
        "policies": summary["policies"],
        "configurations": summary["rows"],
        "per_seed": per_seed,
        "figures": plot(per_seed, summary, out_dir(), prefix=f"paper-lm-{regime}"),
    }


def _lm_headline(regimes: dict[str, dict]) -> dict[str, Any]:
    """The last JSON line's headline fields: the first regime's `auto` row."""
    regime, result = next(iter(regimes.items()), (None, {}))
    return {
        "headline": f"{regime}: {result.get('headline')}" if regime else None,
        **{
            k: result.get(k)
            for k in (
                "wall_time_speedup",
                "perplexity_delta_pct",
                "worst_seed_perplexity_delta_pct",
            )
        },
    }


def main() -> None:
    args = _parser().parse_args()
    if args.alpha not in ALPHAS:
        raise SystemExit(f"--alpha must be one of the sweep's {', '.join(map(str, ALPHAS))}")
    if args.workload == "lm":
        main_lm(args)
        return
    epochs = args.epochs or 10
    if args.from_json:
        runs = [json.loads(f.read_text().strip().splitlines()[-1]) for f in args.from_json]
        earlier = runs[0]
        earlier["per_seed"] = [seed for run in runs for seed in run["per_seed"]]
        earlier["config"]["seeds"] = [s for run in runs for s in run["config"]["seeds"]]
        alpha = Fraction(earlier["config"]["alpha"])
        summary = summarise(earlier["per_seed"], alpha)
        headline = headline_row(summary)
        earlier |= {
            "headline": headline.get("name"),
            "wall_time_speedup": headline.get("wall_time_speedup"),
            "accuracy_delta_pp": headline.get("accuracy_delta_pp"),
            "worst_seed_accuracy_delta_pp": headline.get("worst_seed_accuracy_delta_pp"),
            "configurations": summary["rows"],
            **{
                k: summary[k]
                for k in ("ablation", "alpha_sweep", "alpha_sweep_monotonic", "policies")
            },
            "figures": plot(earlier["per_seed"], summary, out_dir()),
        }
        emit(earlier, save_as="paper.json")
        return
    if args.policies:
        configs = policy_configurations(args.alpha, args.keep_trainable, args.output_ratios)
    else:
        configs = configurations(args.alpha, args.keep_trainable, args.sweep_keep_trainable)
    if args.only:
        configs = {k: v for k, v in configs.items() if k == "baseline" or k in args.only}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or Path(scratch)
        cache = tmp / "cache"
        progress("making the source and target images ...")
        jittered_digits(tmp / "target", 1, TARGET, args.copies, seed=2)
        if args.body:
            body = args.body
        else:
            jittered_digits(tmp / "source", 0, SOURCE, args.source_copies, seed=1)
            progress(f"upstream: pretraining on the source scans ({args.upstream_epochs} epochs)")
            body = upstream(tmp, args.upstream_epochs, cache, args.upstream_device)
        probe = linear_probe(body, tmp / "target")
        progress(f"linear probe on the target scans: {probe:.3f}")
        if args.upstream_only:
            return
        per_seed = run_rows(
            tmp,
            configs,
            args.seeds,
            lambda seed: _job("ft", body, tmp / "target", len(CLASSES), seed, epochs),
            cache,
        )
        summary = summarise(per_seed, args.alpha)
        figures = plot(per_seed, summary, out_dir())
    headline = headline_row(summary)
    emit(
        {
            "benchmark": "paper",
            "headline": headline.get("name"),
            "wall_time_speedup": headline.get("wall_time_speedup"),
            "accuracy_delta_pp": headline.get("accuracy_delta_pp"),
            "worst_seed_accuracy_delta_pp": headline.get("worst_seed_accuracy_delta_pp"),
            "linear_probe_accuracy": probe,
            "ablation": summary.get("ablation"),
            "alpha_sweep": summary.get("alpha_sweep"),
            "alpha_sweep_monotonic": summary.get("alpha_sweep_monotonic"),
            "policies": summary.get("policies"),
            "configurations": summary["rows"],
            "paper": PAPER,
            "goals": {"wall_time_speedup": 1.8, "accuracy_delta_pp": -0.5},
            "config": {
                "seeds": args.seeds,
                "epochs": epochs,
                "upstream_epochs": args.upstream_epochs,
                "copies": args.copies,
                "source_copies": args.source_copies,
                "body": str(args.body) if args.body else None,
                "alpha": str(args.alpha),
                "keep_trainable": args.keep_trainable,
                "sweep_keep_trainable": args.sweep_keep_trainable,
                "only": args.only,
            },
            "per_seed": per_seed,
            "figures": figures,
            "environment": environment(),
        },
        save_as="paper.json",
    )


if __name__ == "__main__":
    main()
