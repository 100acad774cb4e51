"""Run a function in N real processes joined by a gloo process group (FileStore rendezvous).

The processes are forked from a server (`multiprocessing`'s forkserver) that imported torch,
its distributed packages and the project's data plane once, not spawned afresh: each spawned
process would import them again, 3-4 s of CPU apiece, and the suite starts hundreds of them.
The server forks before any tensor work (no OpenMP pool to inherit), and each process takes the
caller's environment as it is at the call (`_entry`), not the server's from its start."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# what every distributed test imports anyway; the server imports it once per test process
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "transformers",
    "pipetransformer.trainer.pipeline",
    "pipetransformer.trainer.checkpoint",
    "pipetransformer.trainer.relayout",
    "tests.mp",
]


def _entry(
    rank: int,
    world: int,
    store_path: str,
    fn: Callable,
    args: tuple,
    out_dir: str,
    env: dict[str, str] | None = None,
) -> None:
    if env is not None:  # the caller's environment now (a forked server's is from its start)
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world: int, *args: Any) -> list[Any]:
    """Run fn(rank, world, *args) on `world` processes; return each rank's result (torch.save-able)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _entry,
            args=(world, os.path.join(tmp, "store"), fn, args, tmp, dict(os.environ)),
            nprocs=world,
            start_method="forkserver",
        )
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world)]
