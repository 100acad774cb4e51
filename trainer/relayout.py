"""Building (and rebuilding) a rank's share of training for a layout. A re-layout is: commit
state under the old layout, rebuild for the new one, load each block's weights and optimizer
state from that checkpoint (resharded by block name). The same function starts and resumes a job."""

from __future__ import annotations

import torch

from orchestrator.spec import JobSpec
from orchestrator.state import Layout
from trainer.checkpoint import load_checkpoint, load_weights
from trainer.optim import build_optimizer
from trainer.pipeline import RankPipeline, build_rank_pipeline
from trainer.planner import recompute_flags


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
