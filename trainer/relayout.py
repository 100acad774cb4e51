"""Building (and rebuilding) a rank's share of training for a layout. A re-layout is: commit
state under the old layout, rebuild for the new one, load each block's weights and optimizer
state from that checkpoint (resharded by block name). The same function starts and resumes a job."""

from __future__ import annotations

import torch

from orchestrator.spec import JobSpec
from orchestrator.state import Layout
from trainer.checkpoint import load_checkpoint, load_weights
from trainer.optim import build_optimizer
from trainer.partition import plan_layout
from trainer.pipeline import RankPipeline, build_rank_pipeline


def recompute_flags(spec: JobSpec, layout: Layout) -> list[bool]:
    """Activation recomputation per stage of `layout`. A per-stage list in the spec is written
    for the spec's own stages; once a re-layout or a recovery changes the stages, it carries
    over by block: a new stage recomputes if any of its blocks was in a recomputing stage."""
    flags = spec.parallel.recompute
    if isinstance(flags, bool):
        return [flags] * layout.num_stages
    original = plan_layout(spec)  # the stages the list was written for
    per_block = [False] * layout.num_blocks
    for stage, flag in zip(original.stages, flags, strict=True):
        for block in range(stage.start, stage.end):
            per_block[block] = flag
    return [any(per_block[s.start : s.end]) for s in layout.stages]


def build_training(
    spec: JobSpec, layout: Layout, rank: int, load_from: str | None = None
) -> tuple[RankPipeline, torch.optim.Optimizer]:
    """This rank's pipeline (groups, stages, schedule) and optimizer under `layout`; with
    `load_from`, weights and optimizer state come from that checkpoint, written under any layout;
    without it, a fine-tuning spec (`init`) takes the weights of its pretrained checkpoint.
    Frozen blocks (below the layout's boundary) are in no optimizer. Collective."""
    recompute = recompute_flags(spec, layout)
    replica_batch = spec.training.global_batch_size // layout.replicas
    pipe = build_rank_pipeline(
        spec.model, spec.training.seed, layout, rank, replica_batch, recompute
    )
    optimizer = build_optimizer(pipe.model, spec.training)
    if load_from:
        load_checkpoint(load_from, pipe.model, optimizer)
    elif spec.init.checkpoint:
        init = spec.init
        load_weights(init.checkpoint, pipe.model, init.skip, checksum=init.checksum)
    return pipe, optimizer
