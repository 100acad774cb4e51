"""MFU of a real job's training step, as the job reports it: `pipetransformer run` of ViT-B/16
(224x224 images, 16x16 patches, 12 blocks of width 768) on `synthetic` data on one GPU (1x1,
one micro-batch, compiled blocks, no freezing), at each precision and batch asked for. The
figure is the median over the steps after the first `--skip` (compilation, warm-up) of the MFU
and samples/s each step stored; bench/mfu.py measures the bare step beside it.

    .venv/bin/python bench/job_mfu.py [--precisions bf16 bf16-weights] [--batches 256 512]
        [--epochs 5] [--skip 10]
    .venv/bin/python bench/job_mfu.py --quick     # a small ViT on the CPU: the mechanics only

One JSON line (also bench/out/job_mfu.json).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _common import emit, environment, progress, run_cli_job

from pipetransformer.store import Store, sqlite_url

VIT_B16 = {
    "family": "vit",
    "image_size": 224,
    "patch_size": 16,
    "channels": 3,
    "dim": 768,
    "depth": 12,
    "heads": 12,
    "mlp_ratio": 4.0,
    "num_classes": 1000,
}
TINY = {"family": "vit", "image_size": 16, "patch_size": 4, "dim": 32, "depth": 2, "heads": 2}


def job_spec(name: str, precision: str, batch: int, epochs: int, quick: bool) -> dict[str, Any]:
    return {
        "name": name,
        "model": TINY if quick else VIT_B16,
        "data": {"dataset": "synthetic", "synthetic_samples": batch * 8},
        "training": {
            "epochs": epochs,
            "global_batch_size": batch,
            "lr": 0.001,
            "warmup_steps": 5,
            "precision": precision,
        },
        "parallel": {"stages": 1, "replicas": 1, "microbatches": 1, "compile": not quick},
        "freeze": {"policy": "off"},
        "runtime": {"device": "cpu" if quick else "cuda", "control_every_steps": 50},
        "checkpoint": {"every_epochs": 1000, "keep": 1},
    }


def run_job(workdir: Path, spec: dict[str, Any], skip: int) -> dict[str, Any]:
    """Run one job through the CLI; its reported per-step MFU and samples/s (medians)."""
    name = spec["name"]
    res, wall = run_cli_job(workdir, spec)
    if res.returncode != 0:
        return {"job": name, "error": (res.stdout + res.stderr)[-2000:]}
    store = Store.open(sqlite_url(workdir / name / "store.db"), migrate=False)
    try:
        steps = [m for m in store.metrics(name) if m.step > skip]
    finally:
        store.close()
    mfus = [m.mfu for m in steps if m.mfu is not None]
    return {
        "job": name,
        "precision": spec["training"]["precision"],
        "batch": spec["training"]["global_batch_size"],
        "steps_measured": len(steps),
        "mfu": statistics.median(mfus) if mfus else None,  # None: no known peak (CPU)
        "samples_per_s": statistics.median(m.samples_per_s for m in steps),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "bf16-weights"])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--skip", type=int, default=10, help="steps left out of the medians")
    parser.add_argument("--quick", action="store_true", help="a small ViT on the CPU")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.epochs, args.skip = [16], 2, 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batches:
            for precision in args.precisions:
                name = f"{precision}-b{batch}"
                spec = job_spec(name, precision, batch, args.epochs, args.quick)
                rows.append(run_job(Path(tmp), spec, args.skip))
                progress(f"{name}: {rows[-1]}")
    emit(
        {
            "benchmark": "job_mfu",
            "model": "vit-tiny" if args.quick else "vit-b16",
            "rows": rows,
            "environment": environment(),
        },
        save_as="job_mfu.json",
    )


if __name__ == "__main__":
    main()
