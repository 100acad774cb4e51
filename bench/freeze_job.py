"""Freezing in a real one-GPU job: ViT-B/16 (224x224, 16x16 patches, 12 blocks of width 768) on
`synthetic` data, the same job without freezing and with the schedule policy (the frozen prefix
leaves the pipeline; AutoCache decides whether to serve it), one after the other. Per job: the
wall time of `pipetransformer run`, the final held-out accuracy, the median samples/s under each
freeze boundary, the layouts; and for the freezing job where its time went beside training (the
re-layouts' pauses, as the job's summary estimates them).

    .venv/bin/python bench/freeze_job.py [--epochs 8] [--batch 256] [--alpha 0.34]
    .venv/bin/python bench/freeze_job.py --quick     # a small ViT on the CPU: the mechanics only

One JSON line (also bench/out/freeze_job.json).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import job_mfu
from _common import emit, environment, progress, run_cli_job

from pipetransformer.store import Store, sqlite_url


def job_spec(name: str, freeze: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """bench/job_mfu.py's job (bf16-weights; fp32 for --quick) with 32 batches of data, 10
    classes, the given freeze section, and the control key read every 10 steps."""
    precision = "fp32" if args.quick else "bf16-weights"
    spec = job_mfu.job_spec(name, precision, args.batch, args.epochs, args.quick)
    spec["model"] = {**spec["model"], "num_classes": 10}
    spec["data"]["synthetic_samples"] = args.batch * 32
    spec["training"]["warmup_steps"] = 10
    spec["runtime"]["control_every_steps"] = 10
    spec["freeze"] = freeze
    return spec


def run_job(workdir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    name = spec["name"]
    started = time.time()
    res, wall = run_cli_job(workdir, spec)
    if res.returncode != 0:
        return {"job": name, "error": (res.stdout + res.stderr)[-2000:]}
    store = Store.open(sqlite_url(workdir / name / "store.db"), migrate=False)
    try:
        by_boundary: dict[int, list[float]] = {}
        for m in store.metrics(name):
            if m.step > 3 and m.samples_per_s:  # past the first steps (compilation)
                by_boundary.setdefault(m.frozen or 0, []).append(m.samples_per_s)
        evals = store.evaluations(name)
        layouts = [h.layout.short for h in store.layouts(name)]
        metrics = store.metrics(name)
        events = store.events(name)
    finally:
        store.close()
    lines = res.stdout.splitlines()
    bought = [line for line in lines if "estimated wall time" in line]
    cache = [line for line in lines if "AutoCache at F=" in line]
    # the first-to-last-step span; the rest of the wall time is start-up (etcd, controller,
    # workers, compilation before the first step) and the end (last evaluation, checkpoint)
    span = metrics[-1].time - metrics[0].time if len(metrics) > 1 else None
    return {
        "job": name,
        "wall_s": wall,
        "final_accuracy": evals[-1].accuracy if evals else None,
        "samples_per_s_by_boundary": {f: statistics.median(v) for f, v in by_boundary.items()},
        "layouts": layouts,
        "training_span_s": span,
        "outside_span_s": wall - span if span is not None else None,
        "phases_s": phases(started, events, metrics, evals),
        "summary_relayout_line": bought[0].strip() if bought else None,
        "summary_cache_line": cache[0].strip() if cache else None,
    }


def phases(started: float, events: list, metrics: list, evals: list) -> dict[str, float | None]:
    """Where a job's wall time went, from its events and rows (seconds after `started`, the
    `pipetransformer run` call's own start): the moments the job was created, its first
    generation started, the first worker began, the first and the last metrics rows (the first
    reporting interval holds the compilation of the blocks), the last evaluation, the last
    committed checkpoint and the job's completion."""

    def first(kind: str) -> float | None:
        times = [e.time for e in events if e.kind == kind]
        return round(min(times) - started, 2) if times else None

    def last(kind: str) -> float | None:
        times = [e.time for e in events if e.kind == kind]
        return round(max(times) - started, 2) if times else None

    return {
        "job_created": first("job_created"),
        "generation_started": first("generation_started"),
        "worker_started": first("worker_started"),
        "first_metrics_row": round(metrics[0].time - started, 2) if metrics else None,
        "first_metrics_step": metrics[0].step if metrics else None,
        "last_metrics_row": round(metrics[-1].time - started, 2) if metrics else None,
        "last_evaluation": round(evals[-1].time - started, 2) if evals else None,
        "last_checkpoint": last("checkpoint_committed"),
        "job_completed": last("job_completed"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--alpha", type=float, default=0.34)
    parser.add_argument("--quick", action="store_true", help="a small ViT on the CPU")
    parser.add_argument(
        "--freezing-first",
        action="store_true",
        help="run the freezing job first (the first job fills the compilation caches)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.batch = 4, 16
    freezing = {
        "policy": "schedule",
        "alpha": args.alpha,
        "warmup_decisions": 1,
        "keep_trainable": 1 if args.quick else 2,
        "cache": "auto",
    }
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [("no-freezing", {"policy": "off"}), ("freezing", freezing)]
        for name, freeze in reversed(jobs) if args.freezing_first else jobs:
            rows[name] = run_job(Path(tmp), job_spec(name, freeze, args))
            progress(f"{name}: {rows[name]}")
    walls = [rows[n].get("wall_s") for n in ("no-freezing", "freezing")]
    emit(
        {
            "benchmark": "freeze_job",
            "model": "vit-tiny" if args.quick else "vit-b16",
            "wall_time_speedup": walls[0] / walls[1] if all(walls) else None,
            "rows": rows,
            "config": {
                "epochs": args.epochs,
                "batch": args.batch,
                "alpha": args.alpha,
                "first": "freezing" if args.freezing_first else "no-freezing",
            },
            "environment": environment(),
        },
        save_as="freeze_job.json",
    )


if __name__ == "__main__":
    main()
