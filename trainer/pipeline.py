"""Pipeline runtime for one rank: training process groups for a layout, the rank's stages as
`PipelineStage`s, the schedule from `torch.distributed.pipelining`, and the per-step gradient work
around it (replica all-reduce, global gradient clipping).

Process groups: the default group spans all ranks and is the stable *control* group. For each
layout we build *training* groups: one pipeline group per replica (its P ranks) and one
data-parallel group per pipeline position (the R ranks that run the same stages). `new_group`
must be called by every rank for every group, in the same order, so all are created everywhere
and each rank keeps its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from orchestrator.spec import SCHEDULES, ModelSpec, schedule_problem
from orchestrator.state import Layout, StageLayout
from trainer.cache import ActivationCache, FrozenPrefix
from trainer.models import (
    StageModule,
    build_model,
    stage_input_dtype,
    stage_input_shape,
    stage_output_shape,
)
from trainer.sampler import IGNORE

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "looped-bfs": ScheduleLoopedBFS,
    "interleaved-zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
assert set(SCHEDULE_CLASSES) == set(SCHEDULES), "spec rules and runtime classes must agree"


@dataclass
class TrainingGroups:
    pipeline: dist.ProcessGroup  # this rank's replica: its P pipeline ranks
    data_parallel: dist.ProcessGroup | None  # same pipeline position in every replica (None if R=1)


def build_groups(layout: Layout, rank: int) -> TrainingGroups:
    p, r_count = layout.pipeline_ranks, layout.replicas
    # every rank creates every group, in the same order (new_group is collective)
    pipes = [dist.new_group(list(range(r * p, (r + 1) * p))) for r in range(r_count)]
    # a one-rank group would only cost a no-op collective; skip it
    dps = [
        dist.new_group([r * p + pos for r in range(r_count)]) if r_count > 1 else None
        for pos in range(p)
    ]
    replica, position = divmod(rank, p)
    return TrainingGroups(pipes[replica], dps[position])


class RankModel(nn.Module):
    """The blocks this rank owns, under the full model's parameter names (`embed.*`,
    `blocks.<i>.*`, `head.*`), for the optimizer, gradient work and checkpoints. The per-stage
    `StageModule`s that the schedule runs share these submodules.

    With a freeze boundary F > 0, the frozen prefix (embedding and blocks [0, F)) belongs to the
    rank running the first stage of each replica, outside the pipeline; its parameters have
    `requires_grad=False`, so they are in no optimizer and no gradient all-reduce."""

    def __init__(
        self,
        spec: ModelSpec,
        seed: int,
        stages: list[StageLayout],
        recompute: list[bool],
        freeze_boundary: int = 0,
    ):
        super().__init__()
        full = build_model(spec, seed)  # same init on every rank, whatever the layout
        f = freeze_boundary
        owns_prefix = stages[0].index == 0
        owned = {i for s in stages for i in range(s.start, s.end)}
        if owns_prefix:
            owned |= set(range(f))
        self.embed = full.embed if owns_prefix else None
        self.blocks = nn.ModuleDict({str(i): full.blocks[str(i)] for i in sorted(owned)})
        self.head = full.head if any(s.end == spec.depth for s in stages) else None
        if f > 0:
            frozen = [self.embed] if self.embed is not None else []
            frozen += [self.blocks[str(i)] for i in range(f) if str(i) in self.blocks]
            for module in frozen:
                module.requires_grad_(False)
        self.prefix = (
            FrozenPrefix(full.embed, {i: full.blocks[str(i)] for i in range(f)})
            if owns_prefix and f > 0 and stages[0].start == f
            else None
        )
        parts = [
            StageModule(
                spec,
                s.start,
                s.end,
                full.embed,
                {i: full.blocks[str(i)] for i in range(s.start, s.end)},
                full.head,
                recompute=flag,
            )
            for s, flag in zip(stages, recompute, strict=True)
        ]
        # a plain list, not a ModuleList: the same parameters must not register twice
        self.stage_modules: list[StageModule] = parts


class RankPipeline:
    """This rank's stages of one pipeline replica, and the schedule that runs them."""

    def __init__(
        self,
        model: RankModel,
        model_spec: ModelSpec,
        layout: Layout,
        rank: int,
        groups: TrainingGroups,
        replica_batch: int,
    ):
        problem = schedule_problem(
            layout.schedule, layout.pipeline_ranks, layout.virtual_stages, layout.microbatches
        )
        if problem:
            raise ValueError(problem)
        if replica_batch % layout.microbatches:
            raise ValueError(
                f"replica batch {replica_batch} is not divisible by {layout.microbatches} micro-batches"
            )
        self.model, self.layout, self.groups = model, layout, groups
        self.cache: ActivationCache | None = None  # attached by the trainer (AutoCache)
        self.local = [s for s, _ in layout.placements(rank)]
        self.is_first = self.local[0].index == 0
        self.is_last = any(s.index == layout.num_stages - 1 for s in self.local)
        self.loss_fn = MaskedCrossEntropy()
        mb = replica_batch // layout.microbatches
        self.stages = []
        for stage, module in zip(self.local, model.stage_modules, strict=True):
            # Static example shapes: inferred shapes break with replica gradient sync (see
            # docs/architecture.md, "Known traps");
            # requires_grad marks the tensors that carry gradients between stages.
            example_in = torch.zeros(
                stage_input_shape(model_spec, stage.start, mb),
                dtype=stage_input_dtype(model_spec, stage.start),
            )
            if stage.index > 0:
                example_in.requires_grad_(True)
            example_out = torch.zeros(
                stage_output_shape(model_spec, stage.end, mb), requires_grad=True
            )
            self.stages.append(
                PipelineStage(
                    module,
                    stage_index=stage.index,
                    num_stages=layout.num_stages,
                    device=torch.device("cpu"),
                    input_args=(example_in,),
                    output_args=(example_out,),
                    group=groups.pipeline,
                )
            )
        cls = SCHEDULE_CLASSES[layout.schedule]
        single = SCHEDULES[layout.schedule].max_virtual == 1
        self.schedule = cls(
            self.stages[0] if single else self.stages,
            n_microbatches=layout.microbatches,
            loss_fn=self.loss_fn,
            scale_grads=False,
        )

    def train_step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        global_valid: int,
        indices: Sequence[int] | None = None,
    ) -> float | None:
        """Forward and backward of one replica batch; returns this replica's loss share on the
        rank holding the last stage (sum over replicas = the global mean loss), None elsewhere."""
        self.loss_fn.denominator = global_valid
        losses: list[torch.Tensor] = []
        args = (self._enter(inputs, indices),) if self.is_first else ()
        if self.is_last:
            self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
            return float(sum(loss.detach() for loss in losses))
        self.schedule.step(*args)
        return None

    @torch.no_grad()
    def forward_only(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Logits for one replica batch on the last stage's rank (None elsewhere), in eval mode
        (no dropout: held-out accuracy is the model's, not a noisy sample of it) and without
        autograd; train mode is restored afterwards. The schedule evaluates its loss function
        too, so the last stage needs the targets."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                args = (self._enter(inputs),) if self.is_first else ()
                if self.is_last:
                    return self.schedule.eval(*args, target=targets, losses=[])
                self.schedule.eval(*args)
                return None
        finally:
            self.model.train(was_training)

    def destroy_groups(self) -> None:
        """Release this layout's training groups (the control group stays)."""
        for group in (self.groups.pipeline, self.groups.data_parallel):
            if group is not None:
                dist.destroy_process_group(group)

    def _enter(self, inputs: torch.Tensor, indices: Sequence[int] | None = None) -> torch.Tensor:
        """What the first pipeline stage consumes: the inputs, or the frozen prefix's output,
        served from the activation cache when one is attached and the samples are known."""
        prefix = self.model.prefix
        if prefix is None:
            return inputs
        if self.cache is not None and indices is not None:
            return self.cache.get_or_compute(indices, inputs, prefix)
        return prefix.compute(inputs, self.layout.freeze_boundary)

    def sync_and_clip(self, max_norm: float) -> GradNorms:
        """All-reduce gradients across replicas, then clip by the norm over *all* stages (the same
        norm a single process would compute). Returns that norm and the per-block gradient norms
        before clipping (what AutoFreeze watches), the same on every rank."""
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        grads = [g for _, g in named]
        if self.groups.data_parallel is not None and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.groups.data_parallel)  # sum: loss shares add up
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        # squared norms per block, plus one slot for the embedding and head, summed over the
        # pipeline in a single collective
        depth = self.layout.num_blocks
        sq = torch.zeros(depth + 1)
        for name, g in named:
            parts = name.split(".")
            slot = int(parts[1]) if parts[0] == "blocks" else depth
            sq[slot] += g.pow(2).sum()
        dist.all_reduce(sq, group=self.groups.pipeline)
        norm = float(sq.sum().sqrt())
        if max_norm > 0:
            scale = min(1.0, max_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
            for g in grads:
                g.mul_(scale)
        return GradNorms(norm, sq[:depth].sqrt().tolist())


class GradNorms(NamedTuple):
    """Gradient norms of one step, after the cross-replica all-reduce and before clipping."""

    total: float  # over every parameter of the model (what clipping uses)
    per_block: list[float]  # one per transformer block (0 for frozen ones)


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


def build_rank_pipeline(
    spec_model: ModelSpec,
    seed: int,
    layout: Layout,
    rank: int,
    replica_batch: int,
    recompute: list[bool] | None = None,
) -> RankPipeline:
    """Groups, model share and schedule for `rank` under `layout` (collective: every rank calls)."""
    groups = build_groups(layout, rank)
    local = [s for s, _ in layout.placements(rank)]
    flags = [recompute[s.index] for s in local] if recompute else [False] * len(local)
    model = RankModel(spec_model, seed, local, flags, layout.freeze_boundary)
    return RankPipeline(model, spec_model, layout, rank, groups, replica_batch)
