"""Agreement over the control group (the default process group, over every rank): one rank
decides, every rank acts on the same answer at the same step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def from_rank0(rank: int, compute: Callable[[], T]) -> T:
    """`compute()` on rank 0, its result on every rank."""
    box = [compute() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def ranks_where(flag: bool, rank: int, world: int) -> list[int]:
    """The ranks whose `flag` is set (one tiny all-reduce; every rank gets the same list)."""
    marks = torch.zeros(world)
    marks[rank] = 1.0 if flag else 0.0
    dist.all_reduce(marks)
    return marks.nonzero().flatten().tolist()


def flag_from(src: int, flag: bool) -> bool:
    """Rank `src`'s `flag`, on every rank."""
    value = torch.tensor([1.0 if flag else 0.0])
    dist.broadcast(value, src=src)
    return bool(value.item())


def once_per_node(rank: int, node: str, work: Callable[[], None]) -> None:
    """Run `work` on one rank of each node (the lowest), over the control group; every rank
    raises what its node's runner raised (as a RuntimeError with the same message). For checks of
    node-shared files (a checkpoint's hash) that would otherwise run once per rank."""
    nodes: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    leader = {}
    for r, n in enumerate(nodes):
        leader.setdefault(n, r)
    error: str | None = None
    if leader[node] == rank:
        try:
            work()
        except Exception as exc:  # reported to the node's other ranks, then raised here
            error = f"{type(exc).__name__}: {exc}"
    errors: list[str | None] = [None] * len(nodes)
    dist.all_gather_object(errors, error)
    if mine := errors[leader[node]]:
        raise RuntimeError(mine)
