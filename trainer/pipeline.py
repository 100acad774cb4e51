"""Pipeline runtime for one rank: training process groups for a layout, the `PipelineStage` and
schedule from `torch.distributed.pipelining`, and the per-step gradient work around it (replica
all-reduce, global gradient clipping).

Process groups: the default group spans all ranks and is the stable *control* group. For each
layout we build *training* groups: one pipeline group per replica (its S stages) and one
data-parallel group per stage (its R replicas). `new_group` must be called by every rank for every
group, in the same order, so all of them are created everywhere and each rank keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from orchestrator.spec import ModelSpec
from orchestrator.state import Layout, StageLayout
from trainer.models import StageModule, stage_input_shape, stage_output_shape
from trainer.sampler import IGNORE

SCHEDULES = {"gpipe": ScheduleGPipe}


@dataclass
class TrainingGroups:
    pipeline: dist.ProcessGroup  # this rank's replica: one rank per stage
    data_parallel: dist.ProcessGroup | None  # this rank's stage: one rank per replica (None if R=1)
    pipeline_ranks: list[int]
    data_parallel_ranks: list[int]


def build_groups(layout: Layout, rank: int) -> TrainingGroups:
    mine: TrainingGroups | None = None
    pipe_by_replica = []
    for r in range(layout.replicas):
        ranks = [s.ranks[r] for s in layout.stages]
        pipe_by_replica.append((ranks, dist.new_group(ranks)))
    dp_by_stage = []
    for s in layout.stages:
        # a one-rank group would only cost a no-op collective; skip it
        dp_by_stage.append((s.ranks, dist.new_group(s.ranks) if layout.replicas > 1 else None))
    stage, replica = layout.placement(rank)
    pipe_ranks, pipe_group = pipe_by_replica[replica]
    dp_ranks, dp_group = dp_by_stage[stage.index]
    mine = TrainingGroups(pipe_group, dp_group, pipe_ranks, dp_ranks)
    return mine


class MaskedCrossEntropy:
    """Sum of per-sample cross-entropy over real samples divided by the number of real samples in
    the whole global batch. With the schedule's own grad scaling off, summing this over
    micro-batches (and replicas) gives exactly the full-batch mean loss and its gradient."""

    def __init__(self) -> None:
        self.denominator = 1

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum") / max(
            self.denominator, 1
        )


class StagePipeline:
    """One rank's stage of a pipeline replica and its schedule."""

    def __init__(
        self,
        module: StageModule,
        model_spec: ModelSpec,
        stage: StageLayout,
        layout: Layout,
        groups: TrainingGroups,
        replica_batch: int,
    ):
        if replica_batch % layout.microbatches:
            raise ValueError(
                f"replica batch {replica_batch} is not divisible by {layout.microbatches} micro-batches"
            )
        self.module, self.stage_layout, self.layout, self.groups = module, stage, layout, groups
        self.is_first = stage.index == 0
        self.is_last = stage.index == layout.num_stages - 1
        self.loss_fn = MaskedCrossEntropy()
        mb = replica_batch // layout.microbatches
        # Static example shapes: inferred shapes break with replica gradient sync (DESIGN §5).
        example_in = torch.zeros(stage_input_shape(model_spec, stage.start, mb))
        # requires_grad on the examples tells the stage which tensors carry gradients back
        example_out = torch.zeros(stage_output_shape(model_spec, stage.end, mb), requires_grad=True)
        if not self.is_first:
            example_in.requires_grad_(True)
        self.stage = PipelineStage(
            module,
            stage_index=stage.index,
            num_stages=layout.num_stages,
            device=torch.device("cpu"),
            input_args=(example_in,),
            output_args=(example_out,),
            group=groups.pipeline,
        )
        schedule_cls = SCHEDULES[layout.schedule]
        self.schedule = schedule_cls(
            self.stage, n_microbatches=layout.microbatches, loss_fn=self.loss_fn, scale_grads=False
        )

    def train_step(
        self, images: torch.Tensor | None, targets: torch.Tensor | None, global_valid: int
    ) -> float | None:
        """Forward and backward of one global batch; returns this replica's loss share on the
        last stage (sum over replicas = the global mean loss), None elsewhere."""
        self.loss_fn.denominator = global_valid
        losses: list[torch.Tensor] = []
        args = (images,) if self.is_first else ()
        if self.is_last:
            self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
            return float(sum(loss.detach() for loss in losses))
        self.schedule.step(*args)
        return None

    @torch.no_grad()
    def forward_only(
        self, images: torch.Tensor | None, targets: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Logits for one replica batch on the last stage (None elsewhere), no autograd. The
        schedule evaluates its loss function too, so the last stage needs the targets."""
        args = (images,) if self.is_first else ()
        if self.is_last:
            return self.schedule.eval(*args, target=targets, losses=[])
        self.schedule.eval(*args)
        return None

    def sync_and_clip(self, max_norm: float) -> float:
        """All-reduce gradients across replicas, then clip by the norm over *all* stages (the same
        norm a single process would compute). Returns that norm."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if self.groups.data_parallel is not None and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.groups.data_parallel)  # sum: loss shares add up
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        sq = torch.zeros(1)
        for g in grads:
            sq += g.pow(2).sum()
        dist.all_reduce(sq, group=self.groups.pipeline)
        norm = float(sq.sqrt())
        if max_norm > 0:
            scale = min(1.0, max_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
            for g in grads:
                g.mul_(scale)
        return norm
