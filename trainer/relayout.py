"""Building (and rebuilding) a rank's share of training for a layout. A re-layout is: commit
state under the old layout, rebuild for the new one, load each block's weights and optimizer
state from that checkpoint (resharded by block name). The same function starts and resumes a job."""

from __future__ import annotations

import torch

from core.manifest import verify_checkpoint
from core.planner import recompute_flags
from core.spec import JobSpec
from core.state import Layout
from trainer.checkpoint import load_checkpoint, load_weights
from trainer.collective import once_per_node
from trainer.device import Compute
from trainer.optim import build_optimizer
from trainer.pipeline import RankPipeline, UnitSource, build_rank_pipeline
from trainer.process import node_id


def build_training(
    spec: JobSpec,
    layout: Layout,
    rank: int,
    load_from: str | None = None,
    compute: Compute | None = None,
) -> tuple[RankPipeline, torch.optim.Optimizer]:
    """This rank's pipeline (mesh, stages, schedule) and optimizer under `layout`; with
    `load_from`, weights and optimizer state come from that checkpoint, written under any layout;
    without it, a fine-tuning spec (`init`) takes the weights of its pretrained checkpoint
    (verified once per node against its pinned checksum). Only units no checkpoint fills get
    their seed-derived initialisation. Frozen blocks (below the layout's boundary) are in no
    optimizer. Collective."""
    compute = compute or Compute.for_spec(spec)  # the spec's precision and compile, on the CPU
    recompute = recompute_flags(spec, layout)
    replica_batch = spec.training.global_batch_size // layout.replicas
    init = spec.init
    if init.checkpoint and init.checksum and not load_from:
        verify_once_per_node(rank, init.checkpoint, init.checksum)
    pipe = build_rank_pipeline(
        spec.model,
        spec.training.seed,
        layout,
        rank,
        replica_batch,
        recompute,
        compute,
        fresh=_fresh_units(load_from, spec),
    )
    state = pipe.model.state_module  # the float32 masters under bf16-weights
    optimizer = build_optimizer(state, spec.training)
    if load_from:
        load_checkpoint(load_from, state, optimizer)
    elif init.checkpoint:
        load_weights(init.checkpoint, state, init.skip)
    if pipe.model.master is not None and (load_from or init.checkpoint):
        pipe.model.master.write_back(everything=True)
    return pipe, optimizer


def _fresh_units(load_from: str | None, spec: JobSpec) -> UnitSource | None:
    """Which units start from their seed-derived initialisation: none when resuming (the
    checkpoint holds every unit), those in `init.skip` when fine-tuning, all otherwise."""
    if load_from:
        return lambda unit: False
    if spec.init.checkpoint:
        skip = set(spec.init.skip)
        return lambda unit: unit in skip
    return None


def verify_once_per_node(rank: int, path: str, checksum: str) -> None:
    """Check a checkpoint's files against its pinned checksum, hashing them once per node (its
    ranks read the same files) rather than once per rank. Collective over the control group."""
    once_per_node(rank, node_id(), lambda: verify_checkpoint(path, checksum))
