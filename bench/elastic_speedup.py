"""Elastic speed-up: the digits ViT trained (a) statically on 2 pipeline stages with no freezing,
and (b) with AutoFreeze + in-process re-layout + AutoCache, same seeds, same global batch.

Two regimes (`--regime`):

    scratch   (a) and (b) train from a seeded random initialisation on all ten digits
              (examples/vit-digits.yaml)
    finetune  PipeTransformer's setting: one pretraining job first trains the ViT on all ten
              digits; (a) and (b) then fine-tune its weights, with a new head, on digits 5-9
              (`init`, `data.classes`; the held-out images are the pretraining job's held-out
              images of those digits), at a fine-tuning learning rate

Each configuration is a real job through `pipetransformer run` (2 worker processes, 1 thread
each); (a) and (b) alternate per seed so machine-load drift hits both alike. From the stores:

    throughput_ratio        samples/s of (b) over (a), over the steps after (b) froze half of the
                            blocks (the same step range in both runs); median over seeds
    time_to_accuracy_ratio  wall time for (a) to reach its final accuracy / time for (b) to reach
                            the same accuracy; median over seeds, where a seed in which (b)
                            never reaches it counts as 0 (per seed: null)
    accuracy_delta_pp       final held-out accuracy (b) - (a), mean over seeds, percentage points
    wall_time_ratio         wall time of the whole run (same epochs), (a) over (b); median

The last line is one JSON object; a PNG of samples/s and frozen blocks over time (first seed)
goes to bench/out/elastic_speedup.png.

    .venv/bin/python bench/elastic_speedup.py [--regime scratch|finetune] [--seeds 0 1 2]
        [--epochs 20 (finetune: 10)] [--policy gradient] [--alpha 0.25] [--threshold 0.2]
        [--warmup 0] [--keep-trainable 1]

The defaults are the recommended AutoFreeze configuration (core/freeze.py says why).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from _common import ROOT, emit, environment, out_dir, progress

from pipetransformer.store import Store, sqlite_url  # noqa: E402

PRETRAIN_SEED = 100  # the pretraining job's training seed: none of the fine-tuning seeds
FINETUNE_CLASSES = [5, 6, 7, 8, 9]
FINETUNE = {"lr": 0.001, "warmup_steps": 10}  # a quarter of the warm-up, a third of the LR


def _example(name: str, seed: int, epochs: int) -> dict:
    """examples/vit-digits.yaml under another name, training seed and length."""
    spec = yaml.safe_load((ROOT / "examples" / "vit-digits.yaml").read_text())
    spec["name"] = name
    spec["training"].update(seed=seed, epochs=epochs)
    return spec


def _write(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def _spec(
    path: Path,
    seed: int,
    epochs: int,
    elastic: bool,
    freeze: dict,
    pretrained: Path | None = None,
) -> Path:
    spec = _example("elastic" if elastic else "static", seed, epochs)
    if pretrained is None:
        spec["data"]["seed"] = seed
    else:
        # the pretraining job's held-out split (data.seed 0), filtered to the new task's digits
        spec["training"].update(FINETUNE)
        spec["data"]["classes"] = FINETUNE_CLASSES
        spec["model"]["num_classes"] = len(FINETUNE_CLASSES)
        spec["init"] = {"checkpoint": str(pretrained), "skip": ["head"]}
    if elastic:
        spec["freeze"] = {**freeze, "cache": "auto"}
    return _write(path, spec)


def _pretrain(tmp: Path, epochs: int) -> Path:
    """The pretraining job: the example ViT on all ten digits; returns its checkpoints."""
    path = _write(tmp / "pretrain.yaml", _example("pretrain", PRETRAIN_SEED, epochs))
    _run(tmp / "pretrain", path, "pretrain", tmp / "profile-cache")
    return tmp / "pretrain" / "jobs" / "pretrain" / "checkpoints"


def _run(workdir: Path, spec: Path, job_id: str, cache: Path) -> None:
    env = {**os.environ, "PIPETRANSFORMER_CACHE": str(cache), "COLUMNS": "200"}
    cmd = [
        sys.executable,
        "-m",
        "pipetransformer.orchestrator.cli",
        "run",
        str(spec),
        "--workdir",
        str(workdir),
    ]
    res = subprocess.run(
        [*cmd, "--job-id", job_id], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if res.returncode != 0:
        raise SystemExit(f"{job_id} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def _history(store: Store, job_id: str) -> dict:
    metrics = store.metrics(job_id)
    evals = store.evaluations(job_id)
    t0 = metrics[0].time - 1.0 / max(metrics[0].samples_per_s or 1.0, 1e-9)
    freezes = [
        (e.data["step"], e.data["boundary"])
        for e in reversed(store.events(job_id, limit=1000))
        if e.kind == "freeze"
    ]
    return {
        "steps": [m.step for m in metrics],
        "time": [m.time - t0 for m in metrics],
        "samples_per_s": [m.samples_per_s for m in metrics],
        "evals": [(e.time - t0, e.accuracy) for e in evals],
        "final_accuracy": evals[-1].accuracy,
        "freezes": freezes,
        "depth": store.get_job(job_id).spec.model.depth,
    }


def _frozen_at(hist: dict, step: int) -> int:
    frozen = 0
    for s, boundary in hist["freezes"]:
        if s <= step:
            frozen = boundary
    return frozen


def _throughput(hist: dict, from_step: int) -> float:
    """Median per-step samples/s over steps >= from_step (robust to the odd slow step, such as
    a decision point or an evaluation)."""
    rates = [r for s, r in zip(hist["steps"], hist["samples_per_s"], strict=True) if s >= from_step]
    return statistics.median(rates) if rates else float("nan")


def _time_to(hist: dict, accuracy: float) -> float | None:
    for t, acc in hist["evals"]:
        if acc >= accuracy - 1e-12:
            return t
    return None


def _plot(static: dict, elastic: dict, path: Path, regime: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for hist, name, colour in (
        (static, "(a) static 2 stages", "tab:blue"),
        (elastic, "(b) AutoFreeze + re-layout + AutoCache", "tab:orange"),
    ):
        ax.plot(hist["time"], hist["samples_per_s"], color=colour, alpha=0.6, lw=1, label=name)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("samples/s")
    ax2 = ax.twinx()
    frozen = [_frozen_at(elastic, s) for s in elastic["steps"]]
    ax2.step(
        elastic["time"], frozen, where="post", color="black", lw=1.5, label="(b) frozen blocks"
    )
    ax2.set_ylabel("frozen blocks")
    ax2.set_ylim(0, elastic["depth"])
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    what = "fine-tuned on digits 5-9" if regime == "finetune" else "from scratch"
    ax.set_title(f"Digits ViT {what}, 2 processes x 1 thread")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", default="scratch", choices=["scratch", "finetune"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="training epochs (default: scratch 20, finetune 10)",
    )
    parser.add_argument(
        "--pretrain-epochs", type=int, default=20, help="finetune: the pretraining job's epochs"
    )
    parser.add_argument("--policy", default="gradient", choices=["gradient", "schedule"])
    parser.add_argument("--alpha", type=float, default=0.25)
    parser.add_argument(
        "--threshold",
        type=float,
        default=0.2,
        help="freeze.threshold: a block has converged once its gradient norm is at most this "
        "fraction of its peak",
    )
    parser.add_argument("--warmup", type=int, default=0, help="freeze.warmup_decisions")
    parser.add_argument(
        "--keep-trainable",
        type=int,
        default=1,
        help="freeze.keep_trainable: top blocks never frozen",
    )
    args = parser.parse_args()
    epochs = args.epochs or (10 if args.regime == "finetune" else 20)
    freeze = {
        "policy": args.policy,
        "alpha": args.alpha,
        "threshold": args.threshold,
        "warmup_decisions": args.warmup,
        "keep_trainable": args.keep_trainable,
    }
    per_seed = []
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pretrained = None
        if args.regime == "finetune":
            progress(f"pretraining on all ten digits ({args.pretrain_epochs} epochs) ...")
            pretrained = _pretrain(tmp, args.pretrain_epochs)
        for seed in args.seeds:
            runs = {}
            for elastic in (False, True):
                name = "elastic" if elastic else "static"
                progress(f"seed {seed}: training ({name}) ...")
                spec = _spec(tmp / f"{name}-{seed}.yaml", seed, epochs, elastic, freeze, pretrained)
                workdir = tmp / f"{name}-{seed}"
                _run(workdir, spec, f"{name}-{seed}", tmp / "profile-cache")
                store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
                runs[name] = _history(store, f"{name}-{seed}")
                store.close()
            a, b = runs["static"], runs["elastic"]
            half = next((s for s, f in b["freezes"] if f >= b["depth"] / 2), None)
            ratio = _throughput(b, half) / _throughput(a, half) if half else None
            t_a = _time_to(a, a["final_accuracy"])
            t_b = _time_to(b, a["final_accuracy"])
            row = {
                "seed": seed,
                "half_frozen_at_step": half,
                "throughput_ratio": ratio,
                "time_to_accuracy_ratio": (t_a / t_b) if t_a and t_b else None,
                "time_to_accuracy_s": {"static": t_a, "elastic": t_b},
                "wall_time_ratio": a["time"][-1] / b["time"][-1],
                "final_accuracy": {"static": a["final_accuracy"], "elastic": b["final_accuracy"]},
                "wall_s": {"static": a["time"][-1], "elastic": b["time"][-1]},
                "freezes": b["freezes"],
            }
            progress(
                f"seed {seed}: throughput x{ratio if ratio is None else round(ratio, 2)}, "
                f"accuracy {a['final_accuracy']:.3f} -> {b['final_accuracy']:.3f}, "
                f"wall {a['time'][-1]:.0f}s -> {b['time'][-1]:.0f}s, freezes {b['freezes']}"
            )
            per_seed.append(row)
            first = first or (a, b)

    def med(key: str):
        vals = [r[key] for r in per_seed if r[key] is not None]
        return statistics.median(vals) if vals else None

    suffix = "" if args.regime == "scratch" else f"-{args.regime}"
    png = out_dir() / f"elastic_speedup{suffix}.png"
    _plot(*first, png, args.regime)
    emit(
        {
            "benchmark": "elastic_speedup",
            "throughput_ratio": med("throughput_ratio"),
            "regime": args.regime,
            # (b)'s time is unbounded where it never gets there: ratio 0, not a dropped seed
            "time_to_accuracy_ratio": statistics.median(
                r["time_to_accuracy_ratio"] or 0.0 for r in per_seed
            ),
            "time_to_accuracy_reached": sum(
                r["time_to_accuracy_ratio"] is not None for r in per_seed
            ),
            "wall_time_ratio": med("wall_time_ratio"),
            "accuracy_delta_pp": 100
            * statistics.mean(
                r["final_accuracy"]["elastic"] - r["final_accuracy"]["static"] for r in per_seed
            ),
            "goals": {
                "throughput_ratio": 1.8,
                "time_to_accuracy_ratio": 1.3,
                "accuracy_delta_pp": -0.5,
            },
            "config": {
                "epochs": epochs,
                **freeze,
                **(
                    {
                        "pretrain_epochs": args.pretrain_epochs,
                        "classes": FINETUNE_CLASSES,
                        **FINETUNE,
                    }
                    if pretrained
                    else {}
                ),
            },
            "per_seed": per_seed,
            "plot": str(png),
            "environment": environment(),
        },
        save_as=f"elastic_speedup{suffix}.json",
    )


if __name__ == "__main__":
    main()
