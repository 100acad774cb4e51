"""The pause a re-layout costs a real job, with the state moved in memory between the running
ranks (`freeze.handover: memory`) and through a checkpoint written and read back
(`checkpoint`), side by side: the same job, rounds interleaved, medians.

A pause is what the job's summary measures for each switch (orchestrator/summary.py): the gap
from the last step under the old layout to the first step under the new one, less the new
layout's median step time. The freeze schedule is fixed (`policy: schedule`, a decision every K
steps, away from epoch ends), so every run re-lays out at the same steps and no evaluation falls
into a pause. Beside the pauses: where each re-layout's time went, as rank 0 reported it
(`RelayoutCost`: planning, the checkpoint, rebuilding and filling the new layout, AutoCache's
decision), the bytes moved between ranks, and each run's wall time and final accuracy.

    .venv/bin/python bench/relayout_pause.py                       # the CPU digits job (2 ranks)
    .venv/bin/python bench/relayout_pause.py --workload vit-gpu    # examples/vit-gpu.yaml, 1 GPU
    .venv/bin/python bench/relayout_pause.py --workload vit-l      # a ViT-L-shaped model, 1 GPU

One JSON line (also bench/out/relayout_pause-<workload>.json) with `pause_s_p50` and
`pause_s_max` per handover, and a PNG of every pause (bench/out/relayout_pause-<workload>.png).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _common import ROOT, emit, environment, out_dir, progress, rotated, run_cli_job

from pipetransformer.orchestrator.summary import history_from_store
from pipetransformer.store import Store, sqlite_url

HANDOVERS = ("memory", "checkpoint")
VIT_L = {  # ViT-L/16's blocks (24 x width 1024, 16 heads) on 64x64 images in 8x8 patches
    "family": "vit",
    "image_size": 64,
    "patch_size": 8,
    "channels": 3,
    "dim": 1024,
    "depth": 24,
    "heads": 16,
    "mlp_ratio": 4.0,
    "num_classes": 10,
}


def workload_spec(workload: str, handover: str, epochs: int | None) -> dict[str, Any]:
    """The job of `workload` with a fixed freeze schedule and the given handover."""
    if workload == "digits":
        spec = yaml.safe_load((ROOT / "examples" / "vit-digits-elastic.yaml").read_text())
        spec["training"]["epochs"] = epochs or 4
        every, keep = 10, 1  # 23 steps an epoch: decisions at 10, 20, 30, ... miss epoch ends
    elif workload == "vit-gpu":
        spec = yaml.safe_load((ROOT / "examples" / "vit-gpu.yaml").read_text())
        spec["training"]["epochs"] = epochs or 6
        every, keep = 8, 2  # 7 steps an epoch (the last one short)
    elif workload == "vit-l":
        spec = yaml.safe_load((ROOT / "examples" / "vit-gpu.yaml").read_text())
        spec["model"] = dict(VIT_L)
        spec["training"]["epochs"] = epochs or 5
        every, keep = 6, 4
    else:
        raise SystemExit(f"--workload: one of digits, vit-gpu, vit-l (got {workload!r})")
    spec["name"] = f"pause-{workload}-{handover}"
    spec["freeze"] = {
        "policy": "schedule",
        "alpha": 0.3,
        "every": every,
        "warmup_decisions": 1,
        "keep_trainable": keep,
        "cache": "auto",
        "relayout": "elastic",
        "handover": handover,
    }
    # no periodic checkpoints: a background write would compete with the switches it overlaps
    # (the end-of-run checkpoint stays, the same for both handovers)
    spec["checkpoint"] = {"every_epochs": 1000, "keep": 1}
    return spec


def run_one(workdir: Path, spec: dict[str, Any], job: str, warm: bool) -> dict[str, Any]:
    # a fresh profile store per run: each pays AutoPipe's measurements at its first re-layout
    # alike, as a first run on a machine does (`plan_s`); with `warm`, one store for every run:
    # the first measures, the others reuse it, as later runs on a machine do
    store_dir = workdir / ("profiles" if warm else f"{job}/profiles")
    res, wall = run_cli_job(
        workdir, spec, job_id=job, env={"PIPETRANSFORMER_CACHE": str(store_dir)}
    )
    if res.returncode != 0:
        return {"job": job, "error": (res.stdout + res.stderr)[-3000:]}
    store = Store.open(sqlite_url(workdir / job / "store.db"), migrate=False)
    try:
        history, _ = history_from_store(store, job)
        events = store.events(job, limit=10_000, kinds=["layout_planned"])
        evals = store.evaluations(job)
    finally:
        store.close()
    costs = [e.data["cost"] for e in sorted(events, key=lambda e: e.time) if e.data.get("cost")]
    switches = [p for p in history[1:] if p.pause_s is not None]
    return {
        "job": job,
        "wall_s": wall,
        "final_accuracy": evals[-1].accuracy if evals else None,
        "layouts": [p.layout.short for p in history if p.steps],
        "pauses_s": [p.pause_s for p in switches],
        "step_s": [p.step_s for p in switches],
        "costs": costs,
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pauses over every switch of every run of one handover; its costs' medians."""
    pauses = [p for r in runs for p in r.get("pauses_s", [])]
    costs = [c for r in runs for c in r.get("costs", [])]
    med = statistics.median
    parts = ("plan_s", "checkpoint_s", "build_s", "cache_s")
    return {
        "pause_s_p50": med(pauses) if pauses else None,
        "pause_s_max": max(pauses) if pauses else None,
        "switches": len(pauses),
        "cost_p50": {k: med(c[k] for c in costs) for k in parts} if costs else None,
        "moved_bytes_p50": med(c["moved_bytes"] for c in costs) if costs else None,
        "wall_s_p50": med(r["wall_s"] for r in runs if "wall_s" in r) if runs else None,
        "final_accuracy": [r.get("final_accuracy") for r in runs],
        "errors": [r["error"] for r in runs if "error" in r],
    }


def plot(workload: str, runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k, handover in enumerate(HANDOVERS):
        pauses = [p for r in runs[handover] for p in r.get("pauses_s", [])]
        ax.scatter([k] * len(pauses), pauses, alpha=0.6, label=handover)
        if pauses:
            m = statistics.median(pauses)
            ax.hlines(m, k - 0.25, k + 0.25, colors="black")
            ax.annotate(f"{m:.3f} s", (k + 0.28, m), va="center")
    ax.set_xticks(range(len(HANDOVERS)), [f"handover: {h}" for h in HANDOVERS])
    ax.set_yscale("symlog", linthresh=1.0)  # sub-second and ten-second pauses on one axis
    ax.set_xlim(-0.6, len(HANDOVERS) - 0.2)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("re-layout pause (s)")
    ax.set_title(f"Re-layout pauses, {workload} (every switch of every run; line: median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="digits", choices=("digits", "vit-gpu", "vit-l"))
    parser.add_argument("--rounds", type=int, default=3, help="runs of each handover")
    parser.add_argument("--epochs", type=int, default=None, help="override the workload's")
    parser.add_argument(
        "--handovers",
        default=",".join(HANDOVERS),
        help="which to run, comma-separated (default both: the comparison is side by side)",
    )
    parser.add_argument(
        "--warm-profiles",
        action="store_true",
        help="one AutoPipe profile store for every run (the first run's measurements reused), "
        "instead of a fresh one per run",
    )
    args = parser.parse_args(argv)
    chosen = [h for h in HANDOVERS if h in args.handovers.split(",")]
    if not chosen:
        raise SystemExit(f"--handovers: some of {', '.join(HANDOVERS)}")
    runs: dict[str, list[dict[str, Any]]] = {h: [] for h in HANDOVERS}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for handover in rotated(chosen, k):  # neither always goes first
                spec = workload_spec(args.workload, handover, args.epochs)
                row = run_one(Path(tmp), spec, f"{spec['name']}-{k}", args.warm_profiles)
                runs[handover].append(row)
                shown = {key: row.get(key) for key in ("wall_s", "pauses_s", "error")}
                progress(f"round {k} {handover}: {shown}")
    summary = {h: summarise(runs[h]) for h in HANDOVERS}
    mem, ckpt = (summary[h]["pause_s_p50"] for h in HANDOVERS)
    png = out_dir() / f"relayout_pause-{args.workload}.png"
    plot(args.workload, runs, png)
    emit(
        {
            "benchmark": "relayout_pause",
            "workload": args.workload,
            "pause_s_p50": mem,
            "pause_s_max": summary["memory"]["pause_s_max"],
            "checkpoint_pause_s_p50": ckpt,
            "checkpoint_pause_s_max": summary["checkpoint"]["pause_s_max"],
            "checkpoint_over_memory": ckpt / mem if mem and ckpt else None,
            "handovers": summary,
            "runs": runs,
            "figure": str(png),
            "config": {
                "rounds": args.rounds,
                "epochs": args.epochs,
                "handovers": chosen,
                "warm_profiles": args.warm_profiles,
            },
            "environment": environment(),
        },
        save_as=f"relayout_pause-{args.workload}.json",
    )


if __name__ == "__main__":
    main()
