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
from pathlib import Path
from typing import Any

import job_mfu
from _common import emit, environment, progress, run_cli_job

from store import Store, sqlite_url


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
    finally:
        store.close()
    lost = [line for line in res.stdout.splitlines() if "estimated wall time lost" in line]
    return {
        "job": name,
        "wall_s": wall,
        "final_accuracy": evals[-1].accuracy if evals else None,
        "samples_per_s_by_boundary": {f: statistics.median(v) for f, v in by_boundary.items()},
        "layouts": layouts,
        "summary_relayout_line": lost[0].strip() if lost else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--alpha", type=float, default=0.34)
    parser.add_argument("--quick", action="store_true", help="a small ViT on the CPU")
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
        for name, freeze in (("no-freezing", {"policy": "off"}), ("freezing", freezing)):
            rows[name] = run_job(Path(tmp), job_spec(name, freeze, args))
            progress(f"{name}: {rows[name]}")
    walls = [rows[n].get("wall_s") for n in ("no-freezing", "freezing")]
    emit(
        {
            "benchmark": "freeze_job",
            "model": "vit-tiny" if args.quick else "vit-b16",
            "wall_time_speedup": walls[0] / walls[1] if all(walls) else None,
            "rows": rows,
            "config": {"epochs": args.epochs, "batch": args.batch, "alpha": args.alpha},
            "environment": environment(),
        },
        save_as="freeze_job.json",
    )


if __name__ == "__main__":
    main()
