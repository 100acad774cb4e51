"""Pipeline runtime for one rank: the training mesh for a layout, the rank's blocks (only those,
materialised from the meta device), its stages as `PipelineStage`s, the schedule from
`torch.distributed.pipelining`, and the per-step gradient work around it.

Process groups: the default group spans all ranks and is the stable *control* group (gloo, CPU
tensors, for the job's whole life). For each layout a `DeviceMesh` of shape (replicas, pipeline
ranks), dimensions named "dp" and "pp", gives the *training* groups: "pp" the P ranks of this
rank's replica (stage-to-stage sends), "dp" the R ranks holding the same stages in every replica
(gradient sync, through DDP). They use NCCL between GPUs and gloo between CPU processes, are
created on every rank in the same order (collective) and destroyed at the next re-layout; the
control group never shares a communicator with them, so aborting or destroying them leaves it
intact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
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
from torch.nn.parallel import DistributedDataParallel

from pipetransformer.core.handover import held_units
from pipetransformer.core.spec import SCHEDULES, ModelSpec, schedule_problem
from pipetransformer.core.state import Layout, StageLayout
from pipetransformer.core.tasks import Task, task_of
from pipetransformer.models.adapters import in_state
from pipetransformer.models.stage import (
    StageModule,
    stage_input_dtype,
    stage_input_shape,
    stage_output_shape,
    weights_dtype,
)
from pipetransformer.models.units import empty_unit, initial_units
from pipetransformer.trainer.cache import ActivationCache, FrozenPrefix
from pipetransformer.trainer.device import Compute
from pipetransformer.trainer.optim import MasterWeights
from pipetransformer.trainer.stage_clock import StageClock
from pipetransformer.trainer.tasks import loss_sum

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
# Zero-bubble schedules compute weight gradients in a separate pass after the input gradients;
# DDP's reducer fires in the first pass, before those gradients exist, so with these schedules
# the replicas' gradients are summed after the step instead (`_sum_replica_grads`).
SPLIT_BACKWARD = frozenset({"interleaved-zb", "zbv", "dualpipev"})


@dataclass
class TrainingGroups:
    mesh: DeviceMesh  # (replicas, pipeline ranks), dims "dp" and "pp"
    pipeline: dist.ProcessGroup  # this rank's replica: its P pipeline ranks
    data_parallel: dist.ProcessGroup | None  # same pipeline position in every replica (None if R=1)


def build_groups(layout: Layout, compute: Compute | None = None) -> TrainingGroups:
    """The layout's training mesh (collective: every rank calls it, in the same order). Rank
    r * P + p is pipeline position p of replica r, the mesh's row-major order."""
    compute = compute or Compute()
    backend = compute.backend
    # named backends for both dims: a dimension spanning the whole world would otherwise reuse
    # the default group, the control group, and be destroyed with the layout
    mesh = init_device_mesh(
        compute.device.type,
        (layout.replicas, layout.pipeline_ranks),
        mesh_dim_names=("dp", "pp"),
        backend_override={"dp": backend, "pp": backend},
    )
    dp = mesh.get_group("dp") if layout.replicas > 1 else None
    return TrainingGroups(mesh, mesh.get_group("pp"), dp)


UnitSource = Callable[[str], bool]


class RankModel(nn.Module):
    """The blocks this rank owns, under the full model's parameter names (`embed.*`,
    `blocks.<i>.*`, `head.*`), for the optimizer, gradient work and checkpoints. The per-stage
    `StageModule`s that the schedule runs share these submodules.

    Only the owned units are built: on the meta device first (no memory), then materialised on
    `compute.device` by `materialise`, each unit from its seed-derived initialisation
    (`models.seeded.init_unit`, the same values `build_model` gives it) unless a checkpoint
    will fill it.

    With a freeze boundary F > 0 the embedding and blocks [0, F) are frozen: their parameters
    have `requires_grad=False`, so they are in no optimizer and no gradient sync. Where the
    first stage starts at F they are the frozen prefix, which belongs to the rank running the
    first stage of each replica, outside the pipeline; where it starts at block 0
    (`freeze.relayout: off`) they stay in their stages and run forward there."""

    def __init__(
        self,
        spec: ModelSpec,
        seed: int,
        stages: list[StageLayout],
        recompute: list[bool],
        freeze_boundary: int = 0,
        compute: Compute | None = None,
        fresh: UnitSource | None = None,
    ):
        super().__init__()
        compute = compute or Compute()
        self.spec, self.compute = spec, compute
        f = self.freeze_boundary = freeze_boundary
        # its stages' blocks; on stage 0's rank also the embedding and the blocks before stage 0
        # (the frozen prefix outside the pipeline); on the last stage's, the head
        held = held_units(stages, spec.depth)
        owns_prefix = "embed" in held
        self.embed = empty_unit(spec, "embed") if owns_prefix else None
        self.blocks = nn.ModuleDict(
            {
                u.removeprefix("blocks."): empty_unit(spec, u)
                for u in held
                if u.startswith("blocks.")
            }
        )
        self.head = empty_unit(spec, "head") if "head" in held else None
        self.materialise(seed, fresh)
        # a tied pair (a language model's input and output embeddings): one copy in the
        # embedding, one in the head (`Family.tied_parameters`)
        self.tied = spec.family_info.tied_parameters(spec)
        if f > 0:
            frozen = [self.embed] if self.embed is not None else []
            frozen += [self.blocks[str(i)] for i in range(f) if str(i) in self.blocks]
            for module in frozen:
                module.requires_grad_(False)
            if self.tied is not None and self.head is not None:
                # the pair freezes with the embedding, in the frozen prefix: one tensor
                self.head.get_parameter(self.tied[1][1]).requires_grad_(False)
        # bf16-weights: the float32 values just made become the masters, the model bf16 (before
        # compiling, DDP and the stages see it)
        dtype = weights_dtype(compute.precision)
        # with adapters, masters of the training state only: the base is never updated
        keep = in_state if spec.adapters is not None else None
        self.master = MasterWeights(self, dtype, keep) if dtype != torch.float32 else None
        if compute.compile:
            for block in self.blocks.values():
                block.compile()  # in place: the parameter names stay those of the model
        blocks = {int(k): m for k, m in self.blocks.items()}
        self.prefix = (
            FrozenPrefix(self.embed, {i: blocks[i] for i in range(f)}, precision=compute.precision)
            if owns_prefix and f > 0 and stages[0].start == f
            else None
        )
        parts = [
            StageModule(
                spec,
                s.start,
                s.end,
                self.embed,
                {i: blocks[i] for i in range(s.start, s.end)},
                self.head,
                recompute=flag,
                precision=compute.precision,
            )
            for s, flag in zip(stages, recompute, strict=True)
        ]
        # a plain list, not a ModuleList: the same parameters must not register twice
        self.stage_modules: list[StageModule] = parts

    def merge_frozen(self) -> None:
        """With adapters (`model.adapters`): merge each frozen block's adapters into its base
        weights (`models.adapters.merge`), once its adapters hold their trained values. The
        frozen prefix then computes, and AutoCache keeps, base + BA at the base's cost."""
        if self.spec.adapters is None:
            return
        from pipetransformer.models.adapters import merge

        for index, block in self.blocks.items():
            if int(index) < self.freeze_boundary:
                merge(block)

    @property
    def state_module(self) -> nn.Module:
        """What holds the training state under the model's parameter names, for the optimizer
        and checkpoints: the float32 masters under `bf16-weights`, else the model itself."""
        return self.master.module if self.master is not None else self

    def units(self) -> dict[str, nn.Module]:
        """The units this rank holds, by name (`embed`, `blocks.<i>`, `head`)."""
        out: dict[str, nn.Module] = {"embed": self.embed} if self.embed is not None else {}
        out |= {f"blocks.{k}": m for k, m in self.blocks.items()}
        if self.head is not None:
            out["head"] = self.head
        return out

    @torch.no_grad()
    def materialise(self, seed: int, fresh: UnitSource | None = None) -> None:
        """Allocate the units on the device; give those for which `fresh(unit)` holds (default:
        all) their initial weights (seed-derived, or the pretrained checkpoint's). The others are
        left for a checkpoint to fill."""
        device = self.compute.device
        held = self.units()
        wanted = [name for name in held if fresh is None or fresh(name)]
        initial = initial_units(self.spec, seed, wanted)
        for name, module in held.items():
            # buffers (BERT's position ids) are computed at build: keep them through to_empty
            buffers = {k: b.clone() for k, b in module.named_buffers() if b.device.type != "meta"}
            module.to_empty(device=device)
            for k, b in buffers.items():
                module.get_buffer(k).copy_(b)
            if name in initial:
                init = initial[name]
                for target, value in zip(module.parameters(), init.parameters(), strict=True):
                    target.copy_(value)


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
        self.spec_model = model_spec
        self.device = device = model.compute.device
        self.cache: ActivationCache | None = None  # attached by the trainer (AutoCache)
        # AutoCache's held-out rows: evaluation's frozen prefix outputs (attached with `cache`)
        self.heldout_cache: ActivationCache | None = None
        # where this rank's time goes (set by the trainer; a clock that measures nothing here)
        self.clock = StageClock(self.device, enabled=False)
        self.local = [s for s, _ in layout.placements(rank)]
        self.is_first = self.local[0].index == 0
        self.is_last = any(s.index == layout.num_stages - 1 for s in self.local)
        self.loss_fn = MaskedCrossEntropy(task_of(model_spec))
        self.tied = TiedGrads(model, layout, rank)
        mb = replica_batch // layout.microbatches
        dp = groups.data_parallel
        self.sync_after_step = dp is not None and layout.schedule in SPLIT_BACKWARD
        self.stages = []
        for stage, module in zip(self.local, model.stage_modules, strict=True):
            # Static example shapes: inferred shapes break with replica gradient sync (see
            # docs/architecture.md, "Known traps");
            # requires_grad marks the tensors that carry gradients between stages.
            example_in = torch.zeros(
                stage_input_shape(model_spec, stage.start, mb),
                dtype=stage_input_dtype(model_spec, stage.start),
                device=device,
            )
            if stage.index > 0 and carries_gradient(layout, stage.start):
                example_in.requires_grad_(True)
            example_out = torch.zeros(
                stage_output_shape(model_spec, stage.end, mb),
                requires_grad=carries_gradient(layout, stage.end),
                device=device,
            )
            self.stages.append(
                PipelineStage(
                    module if self.sync_after_step else replicate(module, dp, device),
                    stage_index=stage.index,
                    num_stages=layout.num_stages,
                    device=device,
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

    def attach_clock(self, clock: StageClock) -> None:
        """Time this layout's steps on `clock` (its stages' forward and backward included)."""
        self.clock = clock
        clock.wrap_stages(self.stages)

    def train_step(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        loss_count: int,
        indices: Sequence[int] | None = None,
    ) -> float | None:
        """Forward and backward of one replica batch, its summed loss divided by `loss_count`
        (the global batch's real samples, or a language model's counted tokens); returns this
        replica's loss share on the rank holding the last stage (sum over replicas = the global
        mean loss), None elsewhere.
        With R > 1 replicas, DDP sums the gradients over the replicas during the last
        micro-batch's backward."""
        self.loss_fn.denominator = loss_count
        losses: list[torch.Tensor] = []
        clock = self.clock
        args = ()
        if self.is_first:
            entry = "data_wait" if self.model.prefix is None else "frozen_prefix"
            with clock.measure(entry):
                args = (self._enter(inputs, indices),)
        if self.is_last:
            target = self.to_device(targets)
            with clock.schedule():
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            return float(sum(loss.detach() for loss in losses))
        with clock.schedule():
            self.schedule.step(*args)
        return None

    @torch.no_grad()
    def forward_only(
        self,
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        indices: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        """Logits for one replica batch on the last stage's rank (None elsewhere), in eval mode
        (no dropout: held-out accuracy is the model's, not a noisy sample of it) and without
        autograd; train mode is restored afterwards. The schedule evaluates its loss function
        too, so the last stage needs the targets. `indices`: the batch's rows in the held-out
        split, whose frozen prefix outputs `heldout_cache` then serves (`inputs` may be None
        where it holds every row)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                args = (self._enter(inputs, indices, heldout=True),) if self.is_first else ()
                if self.is_last:
                    return self.schedule.eval(*args, target=self.to_device(targets), losses=[])
                self.schedule.eval(*args)
                return None
        finally:
            self.model.train(was_training)

    def to_device(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """A batch tensor on this rank's device (from pinned memory without blocking on CUDA)."""
        if tensor is None or tensor.device == self.device:
            return tensor
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def release(self, keep_groups: bool = False) -> TrainingGroups | None:
        """Done with this layout: its stages and schedule go; its training groups are destroyed
        (`destroy_groups`), or, with `keep_groups`, returned for the next layout to reuse (a
        re-layout to the same mesh shape: creating groups, and NCCL its communicators, costs
        more than the rest of a re-layout)."""
        if not keep_groups:
            self.destroy_groups()
            return None
        self.stages, self.schedule = [], None
        return self.groups

    def destroy_groups(self) -> None:
        """Release this layout's training groups (the control group stays). Every group of the
        mesh is destroyed, including one-rank groups, so no communicator outlives its layout."""
        self.stages, self.schedule = [], None
        mesh = self.groups.mesh
        for name in mesh.mesh_dim_names or ():
            dist.destroy_process_group(mesh.get_group(name))

    def _enter(
        self,
        inputs: torch.Tensor | None,
        indices: Sequence[int] | None = None,
        heldout: bool = False,
    ) -> torch.Tensor:
        """What the first pipeline stage consumes: the inputs, or the frozen prefix's output,
        served from the activation cache (the held-out rows' with `heldout`) when one is
        attached and the samples are known (then `inputs` may be None: the cache holds every
        sample's row)."""
        prefix = self.model.prefix
        if prefix is None:
            return self.to_device(inputs)
        cache = self.heldout_cache if heldout else self.cache
        if cache is not None and indices is not None:
            return cache.get_or_compute(indices, inputs, prefix, self.device)
        return prefix.compute(self.to_device(inputs), self.layout.freeze_boundary)

    def sync_and_clip(
        self,
        max_norm: float,
        observe: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
    ) -> GradNorms:
        """Clip by the norm over *all* stages (the same norm a single process would compute) of
        the gradients DDP summed over the replicas during backward (under `bf16-weights`, the
        masters' float32 copies of them: `MasterWeights.load_grads` first). Returns that norm and
        the per-block gradient norms before clipping (what AutoFreeze watches), the same on every
        rank. `observe` is handed this rank's (name, gradient) pairs once they are summed over the
        replicas and before clipping (AutoFreeze's drift meter)."""
        named = [
            (n, p.grad) for n, p in self.model.state_module.named_parameters() if p.grad is not None
        ]
        grads = [g for _, g in named]
        if self.sync_after_step and grads:
            _sum_replica_grads(grads, self.groups.data_parallel)
        self.tied.sum(self.model.state_module, self.groups.pipeline)
        if observe is not None:  # the summed gradients, before clipping (what the norms measure)
            observe(named)
        # squared norms per block, plus one slot for the embedding and head, summed over the
        # pipeline in a single collective; a tied pair's tensor counted once (its embedding copy)
        depth = self.layout.num_blocks
        sq = torch.zeros(depth + 1, device=self.device)
        measured = [(n, g) for n, g in named if n != self.tied.copy]
        if measured:
            slots = [
                int(n.split(".")[1]) if n.startswith("blocks.") else depth for n, _ in measured
            ]
            norms = torch.stack(torch._foreach_norm([g for _, g in measured])).float()
            sq.index_add_(0, torch.tensor(slots, device=self.device), norms.square())
        dist.all_reduce(sq, group=self.groups.pipeline)
        sq = sq.cpu()
        norm = float(sq.sum().sqrt())
        if max_norm > 0 and grads:
            scale = min(1.0, max_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_'s rule
            if scale < 1.0:
                torch._foreach_mul_(grads, scale)
        return GradNorms(norm, sq[:depth].sqrt().tolist())


class TiedGrads:
    """A tied pair's gradient (`Family.tied_parameters`: a language model's output projection
    tied to its input embedding): the embedding and the head each hold a copy, and after the
    backward pass both copies get the sum of the two gradients, as Megatron sums its embedding
    group's, so the same optimizer step keeps them equal bit for bit (a + b is b + a in floating
    point). Both copies on this rank: added here; one here, the other on the rank of the other
    end of this replica's pipeline: exchanged with that rank (one send and one receive each).
    Nothing to do when no pair is tied, or once the pair is frozen (F > 0: it freezes with the
    embedding) or the rank holds neither copy. `copy` is the head's copy's name, which the
    gradient norm leaves out (the tensor counts once, as in a single model)."""

    def __init__(self, model: RankModel, layout: Layout, rank: int) -> None:
        self.local: list[str] = []
        self.peer: int | None = None
        self.copy: str | None = None
        pair = model.tied
        if pair is None or layout.freeze_boundary > 0:
            return
        held = model.units()
        self.copy = f"{pair[1][0]}.{pair[1][1]}"
        self.local = [f"{unit}.{name}" for unit, name in pair if unit in held]
        if len(self.local) == 1:
            replica = layout.placement(rank)[1]
            first, last = layout.stages[0].ranks[replica], layout.stages[-1].ranks[replica]
            self.peer = last if rank == first else first

    def sum(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        """Both copies' gradients (in `module`, the state module) become their sum."""
        grads = []
        for name in self.local:
            try:
                grads.append(module.get_parameter(name).grad)
            except AttributeError:  # bf16-weights with adapters: a frozen base pair, no master
                return
        if not grads or any(g is None for g in grads):
            return
        if len(grads) == 2:
            total = grads[0] + grads[1]
            for g in grads:
                g.copy_(total)
            return
        assert self.peer is not None
        mine = grads[0]
        theirs = torch.empty_like(mine)
        ops = [
            dist.P2POp(dist.isend, mine, self.peer, group),
            dist.P2POp(dist.irecv, theirs, self.peer, group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        mine.add_(theirs)


def carries_gradient(layout: Layout, cut: int) -> bool:
    """Whether the hidden states crossing a stage boundary before block `cut` carry a gradient
    back: only when a block before the cut trains. With blocks frozen in place
    (`freeze.relayout: off`) a boundary at or below F carries none: the stage after it neither
    computes nor sends an input gradient (autograd stops at its frozen blocks) and the stage
    before it, all frozen, waits for none. Zero-bubble schedules are the exception: they find a
    non-first stage's weight gradients from its input's autograd graph
    (`torch.distributed.pipelining`'s `stage_backward_input`), so that input must require grad
    whatever is frozen before it."""
    return cut > layout.freeze_boundary or layout.schedule in SPLIT_BACKWARD


def replicate(
    module: StageModule, group: dist.ProcessGroup | None, device: torch.device
) -> nn.Module:
    """`module` with its gradients summed over `group` (the replicas) by DDP, or as it is with a
    single replica. The stage's loss is already divided by the *global* batch's sample count, so
    the replicas' gradients add up (DDP's default hook averages: replaced by a sum). The pipeline
    stage drives DDP (no_sync for all but the last micro-batch's backward). A stage whose blocks
    are all frozen (`freeze.relayout: off`) has no gradient to sum, and DDP refuses it."""
    if group is None or not any(p.requires_grad for p in module.parameters()):
        return module
    ddp = DistributedDataParallel(
        module,
        process_group=group,
        device_ids=[device.index] if device.type == "cuda" else None,
        init_sync=False,  # every replica starts from the same weights (and there are no buffers)
        gradient_as_bucket_view=True,
    )
    ddp.register_comm_hook(group, _sum_hook)
    return ddp


def _sum_replica_grads(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum gradients over the replicas in one flat all-reduce (zero-bubble schedules only)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _sum_hook(group, bucket):  # noqa: ANN001, ANN202 (DDP checks the annotations' objects)
    buffer = bucket.buffer()
    if buffer.dtype == torch.float32:
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    # bf16 gradients (`bf16-weights`) are summed in float32 and rounded once, not at every add
    wide = buffer.float()
    work = dist.all_reduce(wide, group=group, async_op=True)
    return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0]))


class GradNorms(NamedTuple):
    """Gradient norms of one step, after the cross-replica all-reduce and before clipping."""

    total: float  # over every parameter of the model (what clipping uses)
    per_block: list[float]  # one per transformer block (0 for frozen ones)


class MaskedCrossEntropy:
    """The task's summed loss of the real samples (`trainer.tasks.loss_sum`) divided by the
    number of real samples in the whole global batch. With the schedule's own grad scaling off,
    summing this over micro-batches (and replicas) gives exactly the full-batch mean loss and its
    gradient."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.denominator = 1

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_sum(self.task, logits, target) / max(self.denominator, 1)


def build_rank_pipeline(
    spec_model: ModelSpec,
    seed: int,
    layout: Layout,
    rank: int,
    replica_batch: int,
    recompute: list[bool] | None = None,
    compute: Compute | None = None,
    fresh: UnitSource | None = None,
    groups: TrainingGroups | None = None,
) -> RankPipeline:
    """Mesh, model share and schedule for `rank` under `layout` (collective: every rank calls).
    `fresh(unit)` says which units get their seed-derived initialisation (default: all); the
    others are left for the caller to load from a checkpoint. `groups`: the previous layout's
    training groups, kept for a layout of the same mesh shape (replicas x pipeline ranks)."""
    compute = compute or Compute()
    if groups is not None:
        shape = tuple(groups.mesh.shape)
        if shape != (layout.replicas, layout.pipeline_ranks):
            raise ValueError(f"groups of a {shape} mesh cannot serve layout {layout.short}")
    else:
        groups = build_groups(layout, compute)
    local = [s for s, _ in layout.placements(rank)]
    flags = [recompute[s.index] for s in local] if recompute else [False] * len(local)
    model = RankModel(spec_model, seed, local, flags, layout.freeze_boundary, compute, fresh)
    return RankPipeline(model, spec_model, layout, rank, groups, replica_batch)
