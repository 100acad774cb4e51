"""Pipeline efficiency per schedule, against GPipe's theory.

For S=2 pipeline ranks on 2 processes (1 thread each), and m in {2, 4, 8} micro-batches, it runs
each schedule that fits and measures the step time. In the same run, each rank measures its
stages' forward+backward compute in isolation at the same micro-batch size (no communication).

    ideal step      = (sum over stages of m * isolated stage compute) / S
    efficiency      = ideal / measured step time
    theory (GPipe)  = m / (m + S - 1)          (fill-drain bubble (S-1)/(m+S-1))
    ratio           = efficiency / theory

The last line is one JSON object; `efficiency_vs_theory` is GPipe's ratio, the median over m.
A PNG of efficiency against m per schedule lands in bench/out/.

    .venv/bin/python bench/pipeline_efficiency.py [--steps 6] [--dim 128] [--depth 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from _common import emit, environment, out_dir, pin_threads, progress
from baselines import balanced_partition  # noqa: E402

from pipetransformer.core.spec import SCHEDULES, ModelSpec, schedule_problem  # noqa: E402
from pipetransformer.core.state import Layout  # noqa: E402
from pipetransformer.trainer.pipeline import build_rank_pipeline  # noqa: E402

S = 2
MICROBATCHES = (2, 4, 8)


def _layout(model: ModelSpec, schedule: str, m: int) -> Layout | None:
    rule = SCHEDULES[schedule]
    virtual = rule.min_virtual
    if schedule_problem(schedule, S, virtual, m) or S * virtual > model.depth:
        return None
    # embedding and head ride on the end stages: count them as about one block each
    costs = [1.0] * model.depth
    costs[0] += 0.5
    costs[-1] += 0.5
    return Layout.build(
        balanced_partition(costs, S * virtual),
        num_blocks=model.depth,
        replicas=1,
        microbatches=m,
        schedule=schedule,
        virtual_stages=virtual,
        placement=rule.placement,
    )


def _isolated(pipe, model: ModelSpec, m: int, mb: int):
    """A callable running this rank's stages on m micro-batches of `mb` samples, forward and
    backward, with no communication: the compute a pipeline step needs from this rank."""
    from pipetransformer.models.stage import stage_input_dtype, stage_input_shape

    inputs = []
    for stage in pipe.local:
        shape = stage_input_shape(model, stage.start, mb)
        dtype = stage_input_dtype(model, stage.start)
        x = torch.randn(shape) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
        inputs.append(x.requires_grad_(stage.index > 0))

    def run() -> None:
        for x, module in zip(inputs, pipe.model.stage_modules, strict=True):
            for _ in range(m):
                module(x).float().pow(2).mean().backward()
        pipe.model.zero_grad(set_to_none=True)

    return run


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _worker(rank: int, store_path: str, args: argparse.Namespace, out: str) -> None:
    pin_threads(1)
    store = dist.FileStore(store_path, S)
    dist.init_process_group("gloo", rank=rank, world_size=S, store=store)
    model = ModelSpec(image_size=16, patch_size=2, dim=args.dim, depth=args.depth, heads=args.heads)
    batch = args.batch
    x = torch.randn(batch, 1, 16, 16)
    y = torch.randint(0, 10, (batch,))
    results = []
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            layout = _layout(model, schedule, m)
            if layout is None:
                continue
            pipe = build_rank_pipeline(model, 0, layout, rank, batch)

            def step(pipe=pipe) -> None:
                pipe.train_step(x if pipe.is_first else None, y, batch)
                pipe.model.zero_grad(set_to_none=True)

            isolated = _isolated(pipe, model, m, batch // m)
            step()  # warm-up (first step allocates buffers)
            isolated()
            # interleaved repeats: machine-load drift hits both measurements alike
            steps, computes = [], []
            for _ in range(args.steps):
                steps.append(_timed(step))
                computes.append(_timed(isolated))
            measured = statistics.median(steps)
            per_rank = [None] * S
            dist.all_gather_object(per_rank, statistics.median(computes))
            if rank == 0:
                ideal = sum(per_rank) / S
                eff = ideal / measured
                theory = m / (m + S - 1)
                row = {
                    "schedule": schedule,
                    "m": m,
                    "virtual_stages": layout.virtual_stages,
                    "step_s": measured,
                    "stage_compute_s": per_rank,
                    "ideal_s": ideal,
                    "efficiency": eff,
                    "theory": theory,
                    "ratio": eff / theory,
                }
                results.append(row)
                progress(
                    f"{schedule:17s} m={m}: step {measured * 1e3:7.1f} ms, "
                    f"ideal {ideal * 1e3:7.1f} ms, efficiency {eff:.2f} "
                    f"(theory {theory:.2f}, ratio {eff / theory:.2f})"
                )
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ms = list(MICROBATCHES)
    ax.plot(ms, [m / (m + S - 1) for m in ms], "k--", label="GPipe theory m/(m+S-1)")
    for schedule in SCHEDULES:
        pts = [(r["m"], r["efficiency"]) for r in rows if r["schedule"] == schedule]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=schedule)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("efficiency (ideal / measured step)")
    ax.set_title(f"Pipeline efficiency, S={S}, 2 processes x 1 thread")
    ax.set_xticks(ms)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), args, out), nprocs=S)
        rows = json.loads(Path(out).read_text())
    png = out_dir() / "pipeline_efficiency.png"
    _plot(rows, png)
    per_schedule = {}
    for schedule in SCHEDULES:
        mine = [r for r in rows if r["schedule"] == schedule]
        if mine:
            per_schedule[schedule] = {
                "efficiency_vs_theory": statistics.median(r["ratio"] for r in mine),
                "by_m": {str(r["m"]): round(r["ratio"], 3) for r in mine},
            }
    result = {
        "benchmark": "pipeline_efficiency",
        "stages": S,
        "model": {"dim": args.dim, "depth": args.depth, "batch": args.batch},
        "efficiency_vs_theory": per_schedule["gpipe"]["efficiency_vs_theory"],
        "goal": 0.8,
        "per_schedule": per_schedule,
        "rows": rows,
        "plot": str(png),
        "environment": environment(),
    }
    emit(result, save_as="pipeline_efficiency.json")


if __name__ == "__main__":
    main()
