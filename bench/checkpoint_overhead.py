"""Checkpoint overhead: mean training step time with a checkpoint every K steps, against none.

The 2-stage ViT pipeline of examples/vit-digits.yaml (8x8 images, 2 processes x 1 thread, gloo,
AdamW) with a wider and deeper model by default (--dim/--depth), so that a checkpoint is not
trivially small. The run is cut into blocks of K steps. Each block is of one mode:

    none    K steps, no checkpoint
    async   a checkpoint (AsyncCheckpointer, the worker's path) started at the block's first step
            boundary, polled after every step as the worker does, waited for at the block's end,
            so a write still running after K steps counts against async
    sync    the same with async_save=False: training waits for the whole write

Modes rotate block by block (none, async, sync, then sync, async, none, ...), so machine-load
drift hits all alike; block times are summed per mode over the rounds. On a shared 2-core
machine other work still blurs single blocks by 10-20%: read overhead_ratio together with
round_ratio_stderr, and raise --rounds for a sharper figure.

    overhead_ratio       mean step time async / none      (goal <= 1.03)
    sync_overhead_ratio  mean step time sync / none       (for comparison)
    round_ratio_*        median and standard error of the per-round block ratios (noise gauge)
    cpu_ratio            CPU time per step of both processes (background threads included)
    checkpoint_mb        size of one checkpoint (all shards + .metadata)
    blocked_ms           time the training thread spends starting an async checkpoint (snapshot)

The last line is one JSON object (also in bench/out/checkpoint_overhead.json).

    .venv/bin/python bench/checkpoint_overhead.py [--every 20] [--rounds 20] [--dim 128] [--depth 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import yaml
from _common import ROOT, emit, environment, out_dir, pin_threads, progress

from pipetransformer.core.planner import plan_layout  # noqa: E402
from pipetransformer.core.spec import JobSpec  # noqa: E402
from pipetransformer.trainer.checkpoint import AsyncCheckpointer  # noqa: E402
from pipetransformer.trainer.optim import build_optimizer  # noqa: E402
from pipetransformer.trainer.pipeline import build_rank_pipeline  # noqa: E402

WORLD = 2
MODES = ("none", "async", "sync")


def _spec(args: argparse.Namespace) -> JobSpec:
    data = yaml.safe_load((ROOT / "examples" / "vit-digits.yaml").read_text())
    data["model"].update(dim=args.dim, depth=args.depth, heads=args.heads)
    return JobSpec.model_validate(data)


def _order(rounds: int) -> list[str]:
    """none, async, sync, sync, async, none, ...: each mode as often early as late."""
    order: list[str] = []
    for r in range(rounds):
        order += list(MODES if r % 2 == 0 else reversed(MODES))
    return order


def _worker(rank: int, store_path: str, args: argparse.Namespace, ckpt_dir: str, out: str):
    pin_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, store=dist.FileStore(store_path, WORLD)
    )
    spec = _spec(args)
    batch = spec.training.global_batch_size
    pipe = build_rank_pipeline(spec.model, 0, plan_layout(spec).layout, rank, batch)
    opt = build_optimizer(pipe.model, spec.training)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)
    checkpointers = {"async": AsyncCheckpointer(), "sync": AsyncCheckpointer(async_save=False)}

    def step() -> None:
        pipe.train_step(x if pipe.is_first else None, y, batch)
        pipe.sync_and_clip(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    n = 0  # steps taken, names the checkpoints

    def block(mode: str) -> tuple[float, float, int, float]:
        """K steps in `mode`; returns (seconds, blocked seconds in start(), checkpoint bytes,
        CPU seconds of this process, background threads included)."""
        nonlocal n
        ckpt = checkpointers.get(mode)
        blocked, size = 0.0, 0
        dist.barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(args.every):
            step()
            n += 1
            if ckpt is None:
                continue
            if i == 0:
                path = Path(ckpt_dir) / f"step-{n:08d}"
                t = time.perf_counter()
                ckpt.start(path, pipe.model, opt, {"step": n})
                blocked = time.perf_counter() - t
            saved = ckpt.poll()  # the worker polls at every step boundary
            if saved is not None:
                size = saved.size_bytes
        if ckpt is not None and (saved := ckpt.wait()) is not None:
            size = saved.size_bytes
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if rank == 0 and size:
            shutil.rmtree(Path(ckpt_dir) / f"step-{n - args.every + 1:08d}", ignore_errors=True)
        return seconds, blocked, size, cpu

    for _ in range(3):  # warm-up: allocations, the checkpoint group, the first DCP plan
        step()
    for mode in ("async", "sync"):
        block(mode)
    totals = {m: 0.0 for m in MODES}
    cpu_s = {m: 0.0 for m in MODES}
    blocks: dict[str, list[float]] = {m: [] for m in MODES}
    blocked_s, sizes = [], []
    order = _order(args.rounds)
    for i, mode in enumerate(order):
        seconds, blocked, size, cpu = block(mode)
        totals[mode] += seconds
        cpu_s[mode] += cpu
        blocks[mode].append(seconds / args.every)
        if mode == "async":
            blocked_s.append(blocked)
        if size:
            sizes.append(size)
        if rank == 0:
            progress(
                f"block {i + 1:2d}/{len(order)} {mode:5s}: "
                f"{seconds / args.every * 1e3:7.1f} ms/step"
                + (f", start() blocked {blocked * 1e3:.1f} ms" if mode != "none" else "")
            )
    cpus: list = [None] * WORLD
    dist.all_gather_object(cpus, cpu_s)
    if rank == 0:
        steps = args.rounds * args.every
        Path(out).write_text(
            json.dumps(
                {
                    "mean_step_s": {m: totals[m] / steps for m in MODES},
                    "cpu_step_s": {m: sum(c[m] for c in cpus) / steps for m in MODES},
                    "block_step_s": blocks,
                    "blocked_s": blocked_s,
                    "size_bytes": max(sizes) if sizes else 0,
                }
            )
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=20, help="K: steps between checkpoints")
    parser.add_argument("--rounds", type=int, default=20, help="blocks of K steps per mode")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: bench/out)")
    args = parser.parse_args()
    pin_threads(1)  # here too: environment() reports it, and the workers inherit the variables
    spec = _spec(args)
    progress(
        f"ViT dim={args.dim} depth={args.depth} on {WORLD} stages, checkpoint every "
        f"{args.every} steps, {args.rounds} rounds of {', '.join(MODES)}"
    )
    ckpt_dir = tempfile.mkdtemp(prefix="ckpt-overhead-", dir=args.dir or out_dir())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.spawn(_worker, args=(os.path.join(tmp, "store"), args, ckpt_dir, out), nprocs=WORLD)
            r = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    mean = r["mean_step_s"]
    blocks = r["block_step_s"]  # round i's block of a mode against round i's `none` block
    ratios = {
        m: [a / n for a, n in zip(blocks[m], blocks["none"], strict=True)]
        for m in ("async", "sync")
    }
    cpu = r["cpu_step_s"]
    result = {
        "benchmark": "checkpoint_overhead",
        "overhead_ratio": mean["async"] / mean["none"],
        "goal": 1.03,
        "sync_overhead_ratio": mean["sync"] / mean["none"],
        # the spread of the per-round ratios shows how much the machine's load blurred them
        "round_ratio_median": {m: statistics.median(v) for m, v in ratios.items()},
        "round_ratio_stderr": {
            m: statistics.stdev(v) / len(v) ** 0.5 if len(v) > 1 else None
            for m, v in ratios.items()
        },
        # CPU seconds per step of both processes, background threads included
        "cpu_ratio": {m: cpu[m] / cpu["none"] for m in ("async", "sync")},
        "checkpoint_every_steps": args.every,
        "checkpoint_mb": r["size_bytes"] / 1e6,
        "blocked_ms": 1e3 * statistics.median(r["blocked_s"]),
        "step_ms": {m: 1e3 * v for m, v in mean.items()},
        "model": {
            "dim": args.dim,
            "depth": args.depth,
            "heads": args.heads,
            "batch": spec.training.global_batch_size,
            "microbatches": spec.parallel.microbatches,
            "stages": WORLD,
        },
        "rounds": args.rounds,
        "environment": environment(),
    }
    emit(result, save_as="checkpoint_overhead.json")


if __name__ == "__main__":
    main()
