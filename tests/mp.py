"""Run a function in N real processes joined by a gloo process group (FileStore rendezvous)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store_path: str, fn: Callable, args: tuple, out_dir: str) -> None:
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
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "store"), fn, args, tmp), nprocs=world)
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world)]
