"""One rank's training run: the train loop and what it does at step boundaries.

    step -> (first step: report) -> leave? -> end of epoch: evaluate, target reached?
         -> periodic checkpoint -> decision point: AutoFreeze, re-layout if the boundary moved
         -> control point: stop?

Every rank runs the same loop and reaches every collective at the same step; decisions are taken
on one rank and agreed over the control group (`trainer.collective`). The collaborators are
explicit: `TrainState` (where training is, under which layout), `Checkpointing`, `Freezing`, and
the `RankPipeline` + optimizer built for the layout in force (`trainer.relayout`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from pipetransformer.core import keys
from pipetransformer.core.flops import mfu, peak_flops, training_flops_per_sample
from pipetransformer.core.freeze import is_decision_point, policy_in_force
from pipetransformer.core.planner import Planned, needs_measurement
from pipetransformer.core.protocol import (
    Assignment,
    CacheDecided,
    Control,
    DataOpened,
    DataOrigin,
    Evaluated,
    FirstStep,
    LayoutPlanned,
    Leaving,
    Metrics,
    RelayoutCost,
    RunOutcome,
    StageTimes,
    Started,
    StepTrace,
    read_trace_request,
)
from pipetransformer.core.provenance import describe_data
from pipetransformer.core.readings import perplexity as perplexity_of
from pipetransformer.core.sampler import IGNORE, Batch, ElasticSampler
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout, StageLayout
from pipetransformer.core.tasks import task_of
from pipetransformer.core.train_state import TrainState
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.edge.manifest import read_meta
from pipetransformer.trainer.cache import (
    DEFAULT_RAM_BYTES,
    ActivationCache,
    CachePolicy,
    choose_memory,
)
from pipetransformer.trainer.checkpointing import Checkpointing
from pipetransformer.trainer.collective import flag_from, from_rank0, ranks_where
from pipetransformer.trainer.data import Split, load_dataset, onto_device
from pipetransformer.trainer.device import (
    Compute,
    local_placement,
    peak_memory_mib,
    reset_peak_memory,
)
from pipetransformer.trainer.feed import Feed
from pipetransformer.trainer.freezing import Freezing
from pipetransformer.trainer.handover import Previous, handover_group
from pipetransformer.trainer.optim import lr_at, set_lr
from pipetransformer.trainer.output_probe import OutputProbe
from pipetransformer.trainer.pipeline import RankPipeline, TrainingGroups
from pipetransformer.trainer.process import LeaveRequest, Reporter, node_id, stdout_log
from pipetransformer.trainer.profile import measured_layout
from pipetransformer.trainer.relayout import build_training, verify_once_per_node
from pipetransformer.trainer.stage_clock import StageClock
from pipetransformer.trainer.tasks import loss_sum, scorer

if TYPE_CHECKING:
    from pipetransformer.trainer.sources.qa import QASplit
    from pipetransformer.trainer.sources.splits import SourceSplit

log = logging.getLogger("pipetransformer.worker")


def activation_cache_dir(job_id: str, checkpoint_dir: str | Path) -> Path:
    """$PIPETRANSFORMER_ACTIVATION_CACHE/<job>, else the job's directory's `cache`."""
    if root := os.environ.get(keys.ACTIVATION_CACHE_ENV):
        return Path(root) / job_id
    return Path(checkpoint_dir).parent / "cache"


def cache_disk_budget() -> int | None:
    """The bytes one boundary's AutoCache files may take: half the node's cap
    ($PIPETRANSFORMER_ACTIVATION_CACHE_BYTES; two boundaries' files coexist while the next is
    built from the previous), None without a cap. Every process of a node reads the same value:
    it is part of the files' key."""
    text = os.environ.get(keys.ACTIVATION_CACHE_BYTES_ENV, "").strip()
    if not text:
        return None
    try:
        cap = int(text)
    except ValueError:
        cap = -1
    if cap < 0:
        raise ValueError(
            f"${keys.ACTIVATION_CACHE_BYTES_ENV}={text!r}: give a number of bytes (0 or more)"
        )
    return cap // 2


@dataclass(frozen=True)
class Context:
    """What a rank knows about its job and generation for its whole life."""

    job_id: str
    spec: JobSpec
    assignment: Assignment
    rank: int
    world: int
    etcd: EtcdClient
    reporter: Reporter
    compute: Compute = Compute()  # this rank's device, precision, compile


class Trainer:
    """One rank's training run. A re-layout swaps the pipeline, optimizer and placement in
    place; epoch, step, LR schedule position and the sampler cursor carry over."""

    def __init__(self, ctx: Context, layout: Layout, leave: LeaveRequest | None = None):
        self.ctx, self.spec, self.tspec = ctx, ctx.spec, ctx.spec.training
        self.leave = leave or LeaveRequest()
        self.data = load_dataset(self.spec.data, self.spec.model)
        if ctx.compute.cuda:  # built-in sets small enough live on the GPU (a batch is a gather)
            free = torch.cuda.mem_get_info(ctx.compute.device)[0]
            self.data = onto_device(self.data, ctx.compute.device, free)
        if ctx.rank == 0:  # where the data came from, once per generation
            ctx.reporter.emit(DataOpened, origin=self._data_origin())
        self.sampler = ElasticSampler(
            len(self.data.train),
            self.tspec.global_batch_size,
            self.tspec.seed,
            # a language model's loss is the mean over the global batch's counted tokens
            weights=getattr(self.data.train, "tokens", None),
        )
        self.feed = Feed(
            self.data.train,
            self.sampler,
            workers=self.spec.data.loader_workers,
            pin_memory=ctx.compute.device.type == "cuda",
            epochs=self.tspec.epochs,
        )
        total = self.tspec.epochs * self.sampler.steps_per_epoch()
        self.total_steps = min(total, self.tspec.max_steps or total)
        start = ctx.assignment.start
        self.state = TrainState.start(
            ctx.assignment, layout, read_meta(start.checkpoint) if start.checkpoint else None
        )
        self.checkpoints = Checkpointing(
            self.spec, ctx.rank, ctx.reporter, ctx.assignment.checkpoint_dir, start
        )
        probe = None
        if policy_in_force(self.spec.freeze) == "output":
            model = self.spec.model
            probe = OutputProbe(
                self.data.test,
                self.tspec.global_batch_size,
                model.depth,
                model.width,
                model.tokens,
                lambda pipe, b: _targets(pipe, self.data.test.labels, b),
            )
        self.freezing = Freezing(
            self.spec, ctx.rank, ctx.etcd, ctx.job_id, ctx.reporter, probe=probe
        )
        self.cache: ActivationCache | None = None
        self.heldout_cache: ActivationCache | None = None  # the held-out rows' (evaluation)
        # what MFU is measured against: every device of the job at the blocks' precision
        self.peak_flops = peak_flops(ctx.compute.name(), self.tspec.precision)
        self.flops_per_sample = 0.0
        self._cached_for: tuple[int, int] | None = None  # (epoch, layout version) checked
        self._cached = False  # every training input served from AutoCache (`_inputs_cached`)
        self._handover: dist.ProcessGroup | None = None  # made at the first re-layout
        self._handover_made = False
        # where this rank's time goes, reported every control_every_steps steps (StageTimes)
        self.clock = StageClock(ctx.compute.device, enabled=self.spec.runtime.stage_timing)
        self._timed_from = self.state.step  # the step the clock's interval began after
        self._build(load_from=start.checkpoint, checksum=ctx.assignment.resume_checksum)

    def _data_origin(self) -> DataOrigin:
        train, test = self.data.train, self.data.test
        task = task_of(self.spec.model)
        if not hasattr(train, "num_examples"):  # a sample per row
            return describe_data(self.spec.data, len(train), len(test), task=task)
        # question answering's splits are windows over their rows, a causal LM's packed
        # sequences of its documents
        samples = {"sequences" if task.vocab_outputs else "windows": (len(train), len(test))}
        return describe_data(
            self.spec.data, train.num_examples, test.num_examples, task=task, **samples
        )

    # -- where this rank sits in the layout in force ------------------------------------------------

    @property
    def layout(self) -> Layout:
        return self.state.layout

    @property
    def stages(self) -> list[StageLayout]:
        return [s for s, _ in self.layout.placements(self.ctx.rank)]

    @property
    def replica(self) -> int:
        return self.layout.placement(self.ctx.rank)[1]

    @property
    def reports_loss(self) -> bool:
        """One rank owns the loss of the global batch."""
        return self.replica == 0 and self.pipe.is_last

    def _build(
        self,
        load_from: str | None = None,
        checksum: str | None = None,
        previous: Previous | None = None,
        groups: TrainingGroups | None = None,
    ) -> float:
        """This rank's pipeline and optimizer for the layout in force, from a checkpoint, the
        previous layout's state or the job's initialisation (collective). Returns the seconds
        AutoCache's decision took."""
        ctx = self.ctx
        if load_from and checksum:
            verify_once_per_node(ctx.rank, load_from, checksum)
        self.pipe, self.optimizer = build_training(
            self.spec, self.layout, ctx.rank, load_from, ctx.compute, previous, groups
        )
        self.pipe.attach_clock(self.clock)
        prefix = self.pipe.model.prefix
        if previous is not None and previous.prefix is not None and prefix is not None:
            # the frozen weights moved bit for bit: AutoCache's fingerprints need no new hashing
            prefix.inherit_digests(previous.prefix)
        # dropout draws from torch's global generator, which a fresh process seeds at random
        # (building the model leaves it as it was): give each rank its own stream from here on
        # (stages and replicas draw different masks), the same whenever the run is repeated
        torch.manual_seed(dropout_seed(self.tspec.seed, ctx.rank, self.state.step))
        t0 = time.monotonic()
        self._attach_cache()
        cache_s = time.monotonic() - t0
        # MFU counts the frozen prefix's forward only where it is recomputed (collective)
        cached = bool(ranks_where(self.pipe.cache is not None, ctx.rank, ctx.world))
        self.flops_per_sample = training_flops_per_sample(
            self.spec.model, self.state.boundary, cached
        )
        reset_peak_memory(ctx.compute.device)  # each layout's peak is its own
        return cache_s

    def _attach_cache(self) -> None:
        """AutoCache on a rank that runs a frozen prefix: one cache per process (files shared by
        the node's processes), re-keyed at each boundary, used where it is measured cheaper."""
        prefix, mode = self.pipe.model.prefix, self.spec.freeze.cache
        if prefix is None or mode == "off":
            return
        f = self.state.boundary
        if not self.data.train.deterministic:
            reason = (
                "off: data.augment gives a sample new inputs every epoch, so a frozen "
                "prefix's outputs cannot be reused"
            )
            log.info("rank %d AutoCache at F=%d: %s", self.ctx.rank, f, reason)
            self.ctx.reporter.emit(CacheDecided, boundary=f, use=False, reason=reason)
            return
        directory = activation_cache_dir(self.ctx.job_id, self.ctx.assignment.checkpoint_dir)
        if self.cache is None:
            self.cache = self._new_cache(directory, len(self.data.train))
        self.cache.set_boundary(f, prefix.fingerprints(f))
        batch = self.tspec.global_batch_size // self.layout.replicas
        sample = self.data.train.read(np.arange(min(batch, len(self.data.train))))
        decision = self.cache.decide(CachePolicy(mode), prefix, sample, f)
        self.pipe.cache = self.cache if decision.use else None
        if decision.use and self.data.test.deterministic:
            # the held-out rows too: evaluation then runs only the blocks above the boundary
            if self.heldout_cache is None:
                held = self.cache
                reserved = held.ram_rows * held.row_bytes if held.memory == "device" else 0
                self.heldout_cache = self._new_cache(
                    directory / "heldout", len(self.data.test), reserved
                )
            self.heldout_cache.set_boundary(f, prefix.fingerprints(f))
            self.pipe.heldout_cache = self.heldout_cache
        log.info("rank %d AutoCache at F=%d: %s", self.ctx.rank, f, decision.reason)
        self.ctx.reporter.emit(CacheDecided, boundary=f, **decision.as_dict())

    def _new_cache(self, directory: Path, n: int, reserved: int = 0) -> ActivationCache:
        """An activation cache of the rank for `n` rows (the training split's, or the held-out
        split's, with `reserved` bytes of GPU memory promised to the training rows' tier, which
        is allocated when first used). On a GPU whose free memory holds every row twice over,
        its memory tier is on the GPU and holds every row (hits cost no copy, and nothing
        spills); otherwise the tier has the default budget (`DEFAULT_RAM_BYTES`), on the GPU
        where that fits in half of the free memory, else in pinned host memory (copies
        overlap); host memory on the CPU. Rows are written through to the node-local files only
        when other workers share the node (they may serve the same samples after a re-layout);
        a node's only worker keeps them in memory and spills to the files what does not fit."""
        device = self.ctx.compute.device
        rows = n * self.spec.model.tokens * self.spec.model.width * 4  # float32 rows
        free = None
        if device.type == "cuda":
            free = max(0, torch.cuda.mem_get_info(device)[0] - reserved)
        whole = free is not None and rows <= free // 2
        tier = rows if whole else min(DEFAULT_RAM_BYTES, rows)
        memory = choose_memory(device, tier, free)
        shared = local_placement()[1] > 1
        log.info(
            "rank %d AutoCache memory tier: %s, %.0f MiB (shared: %s)",
            self.ctx.rank,
            memory,
            tier / 2**20,
            shared,
        )
        return ActivationCache.for_model(
            directory,
            self.spec.model,
            n,
            ram_bytes=tier,
            disk_bytes=cache_disk_budget(),
            memory=memory,
            device=device,
            shared=shared,
        )

    def _checkpoint(
        self, reason: str, wait: bool = True, continues_under: Layout | None = None
    ) -> None:
        with self.clock.measure("checkpoint", on_device=False):
            self.checkpoints.save(
                self.state,
                self.pipe.model.state_module,
                self.optimizer,
                reason,
                wait,
                continues_under,
            )

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> RunOutcome:
        ctx = self.ctx
        ctx.reporter.emit(
            Started,
            stages=[s.index for s in self.stages],
            replica=self.replica,
            pid=os.getpid(),
            host=socket.gethostname(),
            node=node_id(),
            total_steps=self.total_steps,
            log=stdout_log(),
        )
        try:
            return self._loop()
        finally:
            self.feed.close()  # the data reader's processes

    def _loop(self) -> RunOutcome:
        ctx, spec, st = self.ctx, self.spec, self.state
        clock, every = self.clock, spec.runtime.control_every_steps
        first = True
        if not self._finished():
            self.freezing.start(self.pipe, self.layout, self.replica)  # policy 'output' probes
        clock.restart()  # the first interval begins with the first step, not the build
        trace: str | None = None  # a trace request read at the last control point
        while not self._finished():
            if trace is not None:
                clock.begin_trace()
            epoch_done = self.step()
            if trace is not None:
                self._report_trace(trace)
                trace = None
            if first and ctx.rank == 0:  # how long the (re)start took, for the record
                ctx.reporter.emit(FirstStep, step=st.step)
            first = False
            if self._leaving():
                return RunOutcome.LEAVE
            if epoch_done:
                with clock.measure("evaluation", on_device=False):
                    reached = self._evaluate_and_check_target()
                if reached:
                    self._checkpoint("target")
                    self._report_times()
                    return RunOutcome.TARGET
            with clock.measure("checkpoint", on_device=False):
                self.checkpoints.periodic(
                    st, self.pipe.model.state_module, self.optimizer, epoch_done
                )
            # decision points run with policy 'off' too: a manual override is applied there
            if not self._finished() and is_decision_point(spec.freeze, st.step, epoch_done):
                decision = self.freezing.decide(st, self.pipe, self.layout, self.replica)
                if decision.boundary > st.boundary:
                    self._report_times()  # an interval never spans two layouts
                    self.relayout(decision.boundary, decision.reason)
                    clock.restart()  # the pause is the layout's report (RelayoutCost)
            if st.step % every == 0 or epoch_done:
                control, trace = self._control()
                if control == Control.STOP:
                    self._checkpoint("stop")
                    self._report_times()
                    return RunOutcome.STOPPED
                if not clock.enabled:  # filing refuses it; an old request is left unserved
                    trace = None
            if st.step % every == 0:
                self._report_times()
        self._checkpoint("end")
        self._report_times()
        return RunOutcome.DONE

    def _report_times(self) -> None:
        """Report where this rank's time went since the last report (`StageTimes`), when it
        trained a step since (the clock begins a new interval either way)."""
        st = self.state
        if not self.clock.enabled or st.step <= self._timed_from:
            self.clock.restart()
            self._timed_from = st.step
            return
        seconds, wall = self.clock.take()
        self.ctx.reporter.emit(
            StageTimes,
            from_step=self._timed_from,
            to_step=st.step,
            layout_version=self.layout.version,
            stages=[s.index for s in self.stages],
            replica=self.replica,
            wall_s=wall,
            seconds=seconds,
            clock=self.clock.clock,
        )
        self._timed_from = st.step

    def _finished(self) -> bool:
        return self.state.epoch >= self.tspec.epochs or self.state.step >= self.total_steps

    def step(self) -> bool:
        """One optimizer step; returns whether it ended an epoch."""
        pipe, st = self.pipe, self.state
        t0 = time.perf_counter()
        p = st.progress
        at = (p.epoch, p.samples_consumed, self.layout.replicas, self.replica)
        b = self.sampler.batch(*at)
        clock = self.clock
        inputs = None
        if pipe.is_first and not self._inputs_cached():
            with clock.measure("data_wait", on_device=False):
                inputs = self.feed.inputs(*at, b)
        targets = _targets(pipe, self.data.train.labels, b)
        lr = lr_at(p.step, self.total_steps, self.tspec)
        set_lr(self.optimizer, lr)
        loss = pipe.train_step(inputs, targets, b.loss_count, indices=b.indices)
        drift = self.freezing.drift
        master = pipe.model.master  # bf16-weights: the step updates the float32 masters
        if master is not None:
            with clock.measure("optimizer"):
                master.load_grads()
        with clock.measure("grad_sync"):
            norms = pipe.sync_and_clip(self.tspec.grad_clip, drift.add if drift else None)
        with clock.measure("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if master is not None:
                master.write_back()
        self.freezing.observe(norms.per_block, lr)
        if pipe.is_last and pipe.groups.data_parallel is not None:
            with clock.measure("grad_sync"):
                total = torch.tensor([loss], device=pipe.device)
                dist.all_reduce(total, group=pipe.groups.data_parallel)
                loss = float(total)
        epoch_done = st.advance(cursor=b.next_cursor, epoch_len=len(self.data.train), lr=lr)
        rate = b.global_valid / (time.perf_counter() - t0)
        peaks = (
            self._peak_memory() if st.step % self.spec.runtime.control_every_steps == 0 else None
        )
        if self.reports_loss:
            self.ctx.reporter.emit(
                Metrics,
                step=st.step,
                epoch=st.epoch,
                samples_consumed=st.progress.samples_consumed,
                loss=loss,
                lr=lr,
                samples_per_s=rate,
                frozen=st.boundary,
                grad_norms=[n if math.isfinite(n) else None for n in norms.per_block],
                mfu=mfu(rate, self.flops_per_sample, self.ctx.world, self.peak_flops),
                peak_memory_mib=peaks,
            )
        return epoch_done

    def _inputs_cached(self) -> bool:
        """Whether AutoCache serves the frozen prefix's output of every training sample (held at
        the current boundary, or at the one below it to advance from), so that no input needs
        reading: decided when an epoch starts or the layout changes. The data reader's processes
        then stop, leaving their cores to training; they start again if an epoch is not
        covered (after a boundary the cache cannot advance to)."""
        key = (self.state.epoch, self.layout.version)
        if key == self._cached_for:
            return self._cached
        cache, n = self.pipe.cache, len(self.data.train)
        cached = cache is not None and bool(cache.servable(np.arange(n)).all())
        if cached and not self._cached:
            self.feed.close()
            log.info(
                "rank %d: AutoCache holds every training sample's output at F=%d: inputs are no "
                "longer read",
                self.ctx.rank,
                self.state.boundary,
            )
        self._cached_for, self._cached = key, cached
        return cached

    def _peak_memory(self) -> list[float | None] | None:
        """Every rank's peak GPU memory (MiB) since its layout was built, on every rank (a small
        gather over the control group); None on the CPU, without a collective."""
        device = self.ctx.compute.device
        if device.type != "cuda":
            return None
        mine = torch.tensor([peak_memory_mib(device) or 0.0], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(self.ctx.world)]
        dist.all_gather(every, mine)
        return [round(float(t), 1) for t in every]

    def _leaving(self) -> bool:
        """Whether any rank was asked to leave (SIGTERM) during this step: then everyone
        checkpoints this step and exits, and the agents re-form the job without the leaver."""
        ctx = self.ctx
        ranks = ranks_where(self.leave.requested, ctx.rank, ctx.world)
        if not ranks:
            return False
        self._checkpoint("leave")
        if ctx.rank == 0:
            ctx.reporter.emit(Leaving, ranks=ranks, step=self.state.step)
        return True

    def _evaluate_and_check_target(self) -> bool:
        """End of an epoch: held-out accuracy (reported from the last stage), and whether it
        reached the target (decided on the last stage, known everywhere)."""
        result = evaluate(
            self.pipe,
            self.data.test,
            self.tspec.global_batch_size,
            self.layout,
            self.replica,
            self.spec.data.loader_workers,
        )
        if result is not None and self.replica == 0:
            self.ctx.reporter.emit(
                Evaluated,
                epoch=self.state.epoch,
                step=self.state.step,
                accuracy=result.accuracy,
                loss=result.loss,
                f1=result.f1,
            )
        accuracy, perplexity = self.tspec.target_accuracy, self.tspec.target_perplexity
        if accuracy is None and perplexity is None:
            return False
        reached = result is not None and (
            (accuracy is not None and result.accuracy >= accuracy)
            or (perplexity is not None and perplexity_of(result.loss) <= perplexity)
        )
        return flag_from(self.layout.stages[-1].ranks[0], reached)

    def _control(self) -> tuple[Control, str | None]:
        """Rank 0 reads the control key and the trace request in one etcd request; everyone
        gets the same answers at the same step: run or stop, and a pending `TraceRequest` (its
        JSON) or None."""
        job = self.ctx.job_id

        def read() -> tuple[Control, str | None]:
            control, trace = self.ctx.etcd.get_many([keys.control(job), keys.trace_request(job)])
            return Control.read(control), trace if read_trace_request(trace) else None

        return from_rank0(self.ctx.rank, read)

    def _report_trace(self, raw: str) -> None:
        """The step just traced, as this rank's `StepTrace`; rank 0 marks the request served
        (unless it was replaced meanwhile: a new request is traced at the next control point)."""
        request = read_trace_request(raw)
        started, spans = self.clock.end_trace()
        if request is None:
            return
        st = self.state
        self.ctx.reporter.emit(
            StepTrace,
            request=request.id,
            step=st.step,
            started=started,
            layout_version=self.layout.version,
            stages=[s.index for s in self.stages],
            replica=self.replica,
            spans=spans,
            clock=self.clock.clock,
        )
        if self.ctx.rank == 0:
            served = request.model_copy(update={"served_step": st.step}).model_dump_json()
            self.ctx.etcd.compare_and_swap(keys.trace_request(self.ctx.job_id), raw, served)

    # -- AutoPipe + AutoDP ------------------------------------------------------------------------

    def relayout(self, boundary: int, why: str) -> None:
        """AutoPipe + AutoDP in the running processes: plan the layout for the new boundary
        (rank 0 measures; everyone adopts), rebuild the pipeline (the training groups only where
        the mesh shape changes), and give each block's weights and optimizer state to its new
        owner: moved between the ranks (`freeze.handover: memory`, `trainer.handover`) or
        committed in a checkpoint and read back (resharded by block name; `checkpoint`). Frozen
        blocks keep their exact values; where the pause went is reported with the layout
        (`RelayoutCost`). `freeze.relayout` picks the plan (core/planner.py): 'repartition' keeps the replicas;
        'off' measures nothing and keeps the stages, so the rebuild only freezes blocks in
        place (their optimizer state and gradient sync go)."""
        t0 = time.monotonic()
        planned = agree_on_layout(
            self.ctx.rank,
            lambda: measured_layout(
                self.spec,
                world=self.ctx.world,
                boundary=boundary,
                current=self.layout,
                device=self.ctx.compute.device,
            ),
        )
        t_plan = time.monotonic()
        handover = self.spec.freeze.handover
        previous, checkpoint_s = None, 0.0
        if handover == "checkpoint":
            self._checkpoint("relayout", continues_under=planned.layout)
            checkpoint_s = time.monotonic() - t_plan
        else:
            previous = Previous(
                self.layout,
                self.pipe.model.state_module,
                self.optimizer,
                self._handover_group(),
                self.ctx.compute.device,
                self.pipe.model.prefix,
            )
        new = planned.layout
        same_mesh = (new.replicas, new.pipeline_ranks) == (
            self.layout.replicas,
            self.layout.pipeline_ranks,
        )
        groups = self.pipe.release(keep_groups=same_mesh)
        self.state.adopt(new)
        if previous is None:
            cache_s = self._build(load_from=self.state.progress.checkpoint, groups=groups)
        else:
            cache_s = self._build(previous=previous, groups=groups)
        if not self.pipe.is_first:
            self.feed.close()  # no inputs to read any more: its reader would idle to the end
        # every rank is ready (this is the barrier), and what they received in all
        moved = torch.tensor([previous.moved_bytes if previous else 0], dtype=torch.int64)
        del previous  # the old layout's tensors go with it
        dist.all_reduce(moved)
        t_end = time.monotonic()
        cost = RelayoutCost(
            handover=handover,
            plan_s=t_plan - t0,
            checkpoint_s=checkpoint_s,
            build_s=max(0.0, t_end - t_plan - checkpoint_s - cache_s),
            cache_s=cache_s,
            moved_bytes=int(moved),
        )
        report_layout(self.ctx, planned, f"autofreeze ({why}); {planned.reason}", t_end - t0, cost)

    def _handover_group(self) -> dist.ProcessGroup | None:
        """The group in-memory re-layouts send state over: every rank, on the training backend,
        made at the first re-layout and kept for the process's life (None for one rank)."""
        if not self._handover_made:
            compute = self.ctx.compute
            self._handover = handover_group(self.ctx.world, compute.backend, compute.device)
            self._handover_made = True
        return self._handover


def agree_on_layout(rank: int, plan: Callable[[], Planned]) -> Planned:
    """Plan on rank 0 (it measures the model on its device), the same layout on every rank."""
    return from_rank0(rank, plan)


def report_layout(
    ctx: Context,
    planned: Planned,
    reason: str,
    seconds: float,
    cost: RelayoutCost | None = None,
) -> None:
    """Rank 0 tells the controller, which records the layout as the job's current one."""
    if ctx.rank == 0:
        predicted = planned.predicted_stage_s
        ctx.reporter.emit(
            LayoutPlanned,
            layout=planned.layout,
            reason=reason,
            seconds=seconds,
            cost=cost,
            predicted_stage_s=None if predicted is None else list(predicted),
        )


def startup_layout(ctx: Context, layout: Layout) -> Layout:
    """The layout to train under: the assigned one, or one planned from measurement when the
    spec asks for AutoPipe or an automatic micro-batch count and it was not measured yet."""
    if not needs_measurement(ctx.spec, layout):
        return layout
    t0 = time.monotonic()
    planned = agree_on_layout(
        ctx.rank,
        lambda: measured_layout(
            ctx.spec,
            world=ctx.world,
            boundary=layout.freeze_boundary,
            current=layout,
            device=ctx.compute.device,
        ),
    )
    report_layout(ctx, planned, planned.reason, time.monotonic() - t0)
    return planned.layout


def dropout_seed(seed: int, rank: int, step: int) -> int:
    """The seed of a rank's dropout masks from `step` on (a start, resume or re-layout): distinct
    per rank and per such point, the same whenever the run is repeated."""
    return ((seed * 1_000_003 + rank) * 1_000_003 + step) % (1 << 63)


def _targets(pipe: RankPipeline, labels: torch.Tensor, b: Batch) -> torch.Tensor | None:
    """The masked targets of a batch on the last stage (None elsewhere)."""
    if not pipe.is_last:
        return None
    targets = labels[b.indices].clone()
    targets[~torch.from_numpy(b.valid)] = IGNORE  # padding entries add no loss
    return targets


@dataclass(frozen=True)
class Evaluation:
    """Held-out results: accuracy (question answering: exact match) and mean loss, as fractions;
    F1 for question answering (SQuAD's token overlap), None otherwise."""

    accuracy: float
    loss: float
    f1: float | None = None


def evaluate(
    pipe: RankPipeline,
    test: Split | SourceSplit | QASplit,
    global_batch: int,
    layout: Layout,
    replica: int,
    loader_workers: int = 0,
) -> Evaluation | None:
    """Held-out results, known on the last stage (None elsewhere), scored as the job's task
    scores them (`trainer.tasks`): classification's accuracy; question answering's exact match
    (the accuracy) and F1."""
    task = task_of(pipe.spec_model)
    sampler = ElasticSampler(len(test), global_batch, seed=0)
    feed = Feed(test, sampler, workers=loader_workers, pin_memory=pipe.device.type == "cuda")
    summed_loss = torch.zeros(1, device=pipe.device)
    score = scorer(task, test, pipe.device) if pipe.is_last else None
    batches, cursor = [], 0
    while cursor < len(test):
        at = (0, cursor, layout.replicas, replica)
        batches.append((at, sampler.batch(*at)))
        cursor = batches[-1][1].next_cursor
    # AutoCache holds the frozen prefix's output of every row this replica evaluates: no input
    # is read (or decoded)
    cache = pipe.heldout_cache if pipe.is_first else None
    cached = cache is not None and all(bool(cache.servable(b.indices).all()) for _, b in batches)
    try:
        for at, b in batches:
            inputs = feed.inputs(*at, b) if pipe.is_first and not cached else None
            targets = pipe.to_device(_targets(pipe, test.labels, b))
            logits = pipe.forward_only(inputs, targets, b.indices)
            if score is not None:
                score.add(logits, targets, b.valid, b.indices)
                summed_loss += loss_sum(task, logits, targets)
    finally:
        feed.close()
    if score is None:
        return None
    if pipe.groups.data_parallel is not None:
        dist.all_reduce(summed_loss, group=pipe.groups.data_parallel)
        score.all_reduce(pipe.groups.data_parallel)
    metric, f1 = score.result()
    # the mean loss per sample, or per counted token for a language model (perplexity's)
    count = test.num_labels if task.targets_per_token else len(test)
    return Evaluation(metric, float(summed_loss) / max(count, 1), f1)
