"""Building (and rebuilding) a rank's share of training for a layout. The same function starts
and resumes a job (state from a checkpoint, or a fine-tuning job's pretrained weights) and
re-lays it out in the running processes: rebuild for the new layout, then fill each block's
weights and optimizer state from the old layout's live state, moved between ranks
(`trainer.handover`, `freeze.handover: memory`), or from a checkpoint committed under the old
layout and resharded by block name (`freeze.handover: checkpoint`)."""

from __future__ import annotations

import torch

from pipetransformer.core.planner import recompute_flags
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout
from pipetransformer.edge.manifest import verify_checkpoint
from pipetransformer.trainer.checkpoint import load_checkpoint, load_weights, tied_names
from pipetransformer.trainer.collective import once_per_node
from pipetransformer.trainer.device import Compute
from pipetransformer.trainer.handover import Previous, receive_state
from pipetransformer.trainer.optim import build_optimizer
from pipetransformer.trainer.pipeline import (
    RankPipeline,
    TrainingGroups,
    UnitSource,
    build_rank_pipeline,
)
from pipetransformer.trainer.process import node_id


def build_training(
    spec: JobSpec,
    layout: Layout,
    rank: int,
    load_from: str | None = None,
    compute: Compute | None = None,
    previous: Previous | None = None,
    groups: TrainingGroups | None = None,
) -> tuple[RankPipeline, torch.optim.Optimizer]:
    """This rank's pipeline (mesh, stages, schedule) and optimizer under `layout`; with
    `previous` (an in-memory re-layout), weights and optimizer state come from the layout it
    replaces, moved between the ranks; with `load_from`, from that checkpoint, written under any
    layout; with neither, a fine-tuning spec (`init`) takes the weights of its pretrained
    checkpoint (verified once per node against its pinned checksum). Only units nothing fills
    get their seed-derived initialisation. Frozen blocks (below the layout's boundary) are in no
    optimizer. `groups`: the previous layout's training groups, reused where the mesh shape
    is the same. Collective."""
    compute = compute or Compute.for_spec(spec)  # the spec's precision and compile, on the CPU
    recompute = recompute_flags(spec, layout)
    replica_batch = spec.training.global_batch_size // layout.replicas
    init = spec.init
    filled = bool(load_from or previous)  # every unit comes from the state training had
    if init.checkpoint and init.checksum and not filled:
        verify_once_per_node(rank, init.checkpoint, init.checksum)
    pipe = build_rank_pipeline(
        spec.model,
        spec.training.seed,
        layout,
        rank,
        replica_batch,
        recompute,
        compute,
        fresh=_fresh_units(filled, spec),
        groups=groups,
    )
    state = pipe.model.state_module  # the float32 masters under bf16-weights
    optimizer = build_optimizer(state, spec.training)
    if previous is not None:
        receive_state(previous, layout, rank, state, optimizer, _stateless(spec, previous, layout))
    elif load_from:
        load_checkpoint(load_from, state, optimizer, tied=tied_names(spec.model))
    elif init.checkpoint:
        load_weights(init.checkpoint, state, init.skip, tied=tied_names(spec.model))
    if pipe.model.master is not None and (filled or init.checkpoint):
        pipe.model.master.write_back(everything=True)
    pipe.model.merge_frozen()  # adapters: once they hold what training had
    return pipe, optimizer


def _stateless(spec: JobSpec, previous: Previous, layout: Layout) -> tuple[str, ...]:
    """The parameters whose optimizer state an in-memory re-layout does not move: a tied
    output projection (`Family.tied_parameters`) frozen on either side (it freezes with the
    embedding while the rest of the head trains on)."""
    tied = spec.model.family_info.tied_parameters(spec.model)
    frozen = previous.layout.freeze_boundary > 0 or layout.freeze_boundary > 0
    return (f"{tied[1][0]}.{tied[1][1]}",) if tied is not None and frozen else ()


def _fresh_units(filled: bool, spec: JobSpec) -> UnitSource | None:
    """Which units start from their seed-derived initialisation: none when resuming or
    re-laying out (the checkpoint or the previous layout holds every unit), those in
    `init.skip` when fine-tuning, all otherwise. With adapters, all: the base weights come from
    the pretrained checkpoint every time (what fills them holds only the adapters)."""
    if spec.model.adapters is not None:
        return None
    if filled:
        return lambda unit: False
    if spec.init.checkpoint:
        skip = set(spec.init.skip)
        return lambda unit: unit in skip
    return None


def verify_once_per_node(rank: int, path: str, checksum: str) -> None:
    """Check a checkpoint's files against its pinned checksum, hashing them once per node (its
    ranks read the same files) rather than once per rank. Collective over the control group."""
    once_per_node(rank, node_id(), lambda: verify_checkpoint(path, checksum))
