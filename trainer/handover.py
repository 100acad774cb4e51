"""An in-memory re-layout: the old layout's weights and optimizer state go to their new owners
directly, rank to rank, instead of through a checkpoint written to storage and read back.

`core.handover.plan_handover` says what each rank keeps and which units move between which
ranks. A kept unit is copied on the rank's device from its old tensors into the new layout's;
a moved unit is sent point to point (`torch.distributed.batch_isend_irecv`) over the handover
group, a group of every rank made once per process on the training backend (NCCL between GPUs,
gloo between CPU processes), apart from the control group. Every tensor goes into its place in
the new model and optimizer as it is, so the result is bit for bit what loading the same state
from a checkpoint gives: the same tensors, moved. Optimizer state moves only with the units
that still train; frozen blocks keep their exact values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from pipetransformer.core.handover import Handover, Move, plan_handover
from pipetransformer.core.state import Layout
from pipetransformer.trainer.cache import FrozenPrefix
from pipetransformer.trainer.checkpoint import state_tensors, unit_of


@dataclass
class Previous:
    """The layout being replaced and its live state on this rank (the state module, i.e. the
    float32 masters under bf16-weights, and its optimizer), kept until the new one is filled."""

    layout: Layout
    module: nn.Module
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup | None  # the handover group (None: a one-rank job moves nothing)
    device: torch.device  # the training device, where the handover group's messages live
    prefix: FrozenPrefix | None = None  # the frozen prefix it ran (its weight digests carry over)
    moved_bytes: int = field(default=0, init=False)  # what this rank received over the wire


def handover_group(world: int, backend: str, device: torch.device) -> dist.ProcessGroup | None:
    """A group over every rank on the training backend, for the handover's sends (collective:
    every rank calls it, once per process). None for a single rank. One all-reduce over it at
    once: NCCL creates a group's communicator at its first collective, and a batch of sends
    that only some ranks join must not be that first one."""
    if world == 1:
        return None
    group = dist.new_group(backend=backend)
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    return group


def _unit_tensors(
    state: dict[str, dict[str, torch.Tensor]],
    unit: str,
    with_optimizer: bool,
    stateless: Sequence[str] = (),
) -> list[torch.Tensor]:
    """A unit's tensors as they move, in the order both ends enumerate them: its weights (and
    buffers) by name, then, when its optimizer state comes along, that state by name, less the
    state of the parameters in `stateless` (frozen on one side of the re-layout, in a unit
    that trains on both)."""
    skip = tuple(f"state.{name}." for name in stateless)
    out = [state["model"][name] for name in sorted(state["model"]) if unit_of(name) == unit]
    if with_optimizer:
        out += [
            state["optim"][name]
            for name in sorted(state["optim"])
            if unit_of(name) == unit and not name.startswith(skip)
        ]
    return out


def receive_state(
    previous: Previous,
    new: Layout,
    rank: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    stateless: Sequence[str] = (),
) -> Handover:
    """Fill `module` and `optimizer` (built for `new`, their tensors allocated but not set)
    from `previous`: kept units copied here, moved units sent and received over the handover
    group. `stateless`: parameters whose optimizer state does not carry over (they train in
    one of the layouts only: a tied output projection frozen with the embedding); every rank
    passes the same. Collective over that group (every rank calls it at the same re-layout)."""
    plan = plan_handover(previous.layout, new)
    old = state_tensors(previous.module, previous.optimizer)
    state_tensors(module, optimizer)  # a fresh optimizer: this creates its state
    fresh = state_tensors(module, optimizer)  # now the optimizer's own tensors, to fill
    with torch.no_grad():
        for unit in plan.keeps[rank]:
            with_opt = plan.with_optimizer(unit)
            src = _unit_tensors(old, unit, with_opt, stateless)
            dst = _unit_tensors(fresh, unit, with_opt, stateless)
            _check(unit, src, dst)
            for s, d in zip(src, dst, strict=True):
                d.copy_(s)
        previous.moved_bytes = _exchange(
            plan, rank, old, fresh, previous.group, previous.device, stateless
        )
    return plan


def _exchange(
    plan: Handover,
    rank: int,
    old: dict[str, dict[str, torch.Tensor]],
    fresh: dict[str, dict[str, torch.Tensor]],
    group: dist.ProcessGroup | None,
    device: torch.device,
    stateless: Sequence[str] = (),
) -> int:
    """This rank's sends and receives of `plan`, in one batch; returns the bytes received."""
    sends, receives = plan.sends(rank), plan.receives(rank)
    if not sends and not receives:
        return 0
    if group is None:
        raise RuntimeError("units move between ranks but there is no handover group")
    ops: list[dist.P2POp] = []
    landing: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received into, its real place)
    tags: dict[tuple[int, int], int] = {}  # per pair, a running tag (gloo matches on it)
    received = 0

    def tag(move: Move) -> int:
        key = (move.src, move.dst)
        tags[key] = tags.get(key, -1) + 1
        return tags[key]

    # every rank enumerates the moves in the same (src, dst, unit) order, so both ends of a pair
    # issue its messages in the same order with the same tags
    for move in plan.moves:
        if move.src != rank and move.dst != rank:
            continue
        if move.src == rank:
            for t in _unit_tensors(old, move.unit, move.optimizer, stateless):
                wire = t if _on(t, device) else t.detach().to(device).contiguous()
                ops.append(
                    dist.P2POp(dist.isend, wire, group=group, group_peer=move.dst, tag=tag(move))
                )
        else:
            for t in _unit_tensors(fresh, move.unit, move.optimizer, stateless):
                wire = t if _on(t, device) else torch.empty(t.shape, dtype=t.dtype, device=device)
                if wire is not t:
                    landing.append((wire, t))
                ops.append(
                    dist.P2POp(dist.irecv, wire, group=group, group_peer=move.src, tag=tag(move))
                )
                received += t.numel() * t.element_size()
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for wire, t in landing:
        t.copy_(wire)
    return received


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` can go on the wire as it is: on the group's device, contiguous (AdamW's step
    counters live on the CPU beside moments on the GPU unless the optimizer is fused)."""
    return t.device.type == device.type and t.is_contiguous()


def _check(unit: str, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """A kept unit has the same tensors before and after (the same model, the same optimizer)."""
    shapes = [(tuple(t.shape), t.dtype) for t in src]
    if shapes != [(tuple(t.shape), t.dtype) for t in dst]:
        raise RuntimeError(
            f"{unit}: its tensors differ between the layouts: {shapes} before, "
            f"{[(tuple(t.shape), t.dtype) for t in dst]} after"
        )
