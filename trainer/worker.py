"""The trainer process: one per accelerator, started by torchrun (`-m trainer.worker`).

It reads its job from etcd (spec, layout, assignment), trains its pipeline stage, and reports
progress back through etcd; the controller is the only writer of the SQL store. Rank 0 reads the
control key at step boundaries and broadcasts the decision over the control group, so every rank
acts on it at the same step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from orchestrator import keys
from orchestrator.etcd_client import EtcdClient, EtcdError
from orchestrator.forkserver import AGENT_PID_ENV
from orchestrator.manifest import read_meta, verify_checkpoint
from orchestrator.spec import JobSpec
from orchestrator.state import (
    EXIT_REFORM,
    Assignment,
    JoinRequest,
    Layout,
    StageLayout,
    WorkerEvent,
    parse_freeze_request,
)
from trainer.cache import ActivationCache, CachePolicy
from trainer.checkpoint import AsyncCheckpointer, CheckpointWriteError, checkpoint_due
from trainer.data import Dataset, Split, load_dataset
from trainer.failures import is_peer_loss
from trainer.failures import report_exit as on_worker_exit  # noqa: F401 (fork-server hook)
from trainer.freeze import (
    FreezeDecision,
    FreezeState,
    GradNormMeter,
    decide,
    is_decision_point,
)
from trainer.optim import lr_at, set_lr
from trainer.pipeline import RankPipeline
from trainer.profile import autopipe_layout, relayout_plan
from trainer.relayout import build_training
from trainer.sampler import IGNORE, ElasticSampler

log = logging.getLogger("pipetransformer.worker")
T = TypeVar("T")


class Reporter:
    """Puts WorkerEvents into the job's etcd event queue."""

    def __init__(self, etcd: EtcdClient, job_id: str, generation: int, rank: int):
        self.etcd, self.job_id, self.generation, self.rank = etcd, job_id, generation, rank
        self.seq = 0
        # a last word may come from the abort watch or the SIGTERM timer thread
        self._lock = threading.Lock()

    def emit(self, kind: str, **data: Any) -> None:
        event = WorkerEvent(kind=kind, rank=self.rank, generation=self.generation, data=data)
        with self._lock:
            key = keys.event(self.job_id, self.generation, self.rank, self.seq)
            self.etcd.put(key, event.model_dump_json())
            self.seq += 1

    def last_word(self, kind: str, **data: Any) -> None:
        """A final report on the way out (the process exits right after): best effort, so that
        the controller can tell this rank's end from a death; an etcd that does not answer
        within a second costs nothing but the report."""
        done = threading.Event()

        def put() -> None:
            try:
                self.emit(kind, **data)
            except Exception:  # leaving anyway: the report is best effort
                pass
            finally:
                done.set()

        threading.Thread(target=put, name="last-word", daemon=True).start()
        done.wait(1.0)


@dataclass
class Context:
    job_id: str
    spec: JobSpec
    layout: Layout
    assignment: Assignment
    rank: int
    stages: list[StageLayout]
    replica: int
    etcd: EtcdClient
    reporter: Reporter
    world: int


def _read_spec(etcd: EtcdClient, job_id: str, timeout: float = 60.0) -> JobSpec:
    """Wait for the controller to publish the spec (a torchx launch may start workers before
    the controller has written it)."""
    deadline = time.monotonic() + timeout
    while (raw := etcd.get(keys.spec(job_id))) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id!r} has no spec in etcd after {timeout}s")
        time.sleep(0.2)
    return JobSpec.model_validate_json(raw)


def node_id() -> str:
    """This worker's node: its torchrun agent, as "host:agent-pid" (host names alone repeat on
    one machine). A worker forked by the node's fork server is told its agent's pid."""
    agent = os.environ.get(AGENT_PID_ENV) or str(os.getppid())
    return f"{socket.gethostname()}:{agent}"


def _join(etcd: EtcdClient, job_id: str, rank: int, world: int) -> Assignment:
    """This rendezvous round asks the controller for its generation: rank 0 files a join
    request naming the round's world and nodes and waits for the assignment answering it (a
    controller being restarted answers when it is back); every rank gets the same answer."""
    me = [None] * world
    dist.all_gather_object(me, (node_id(), os.getpid()))

    def ask() -> Assignment:
        request = JoinRequest(
            id=uuid.uuid4().hex, world=world, nodes=[n for n, _ in me], pids=[p for _, p in me]
        )
        etcd.put(keys.join(job_id), request.model_dump_json())
        asked = time.monotonic()
        while True:
            raw = etcd.get(keys.assignment(job_id))
            if raw is not None:
                assignment = Assignment.model_validate_json(raw)
                if assignment.request == request.id or assignment.fatal:
                    return assignment
            if time.monotonic() - asked > 10:
                log.info("waiting for the controller to answer join request %s", request.id)
                asked = time.monotonic()
            time.sleep(0.05)

    return _from_rank0(rank, ask)


class AbortWatch:
    """Watches `keys.abort`: when the controller aborts this generation (a peer was lost), the
    process leaves at once with EXIT_REFORM, even from inside a collective that would otherwise
    wait for the dead peer until the collective timeout; its agent re-rendezvous. Polls (cheap,
    and immune to watch streams lost across an etcd restart). `before_exit` says its last word
    (so the controller knows this rank left as told rather than died)."""

    def __init__(
        self,
        etcd: EtcdClient,
        job_id: str,
        generation: int,
        every: float = 0.2,
        before_exit: Callable[[], None] | None = None,
    ):
        self.etcd, self.key, self.generation, self.every = (
            etcd,
            keys.abort(job_id),
            generation,
            every,
        )
        self.before_exit = before_exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abort-watch", daemon=True)

    def start(self) -> AbortWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                value = self.etcd.get(self.key)
            except EtcdError:
                continue  # etcd restarting: the lease outlives it, keep watching
            if value == str(self.generation):
                log.warning("generation %d aborted by the controller: leaving", self.generation)
                if self.before_exit is not None:
                    self.before_exit()
                logging.shutdown()
                os._exit(EXIT_REFORM)

    def stop(self) -> None:
        self._stop.set()


class LeaveRequest:
    """SIGTERM asks the worker to leave gracefully: finish the step, checkpoint with everyone,
    exit (EXIT_REFORM). If that cannot happen within `grace_s` (e.g. a peer is gone and a
    collective blocks), it exits anyway."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.requested = False
        self._lock = threading.Lock()
        # the last word before the grace runs out (set once the worker can report)
        self.before_exit: Callable[[], None] | None = None

    def install(self) -> LeaveRequest:
        """From the main thread. Python runs signal handlers only between the main thread's
        bytecodes, so a worker blocked in a collective or an RPC would not even start its grace
        timer; the C-level handler also writes the signal number to a wakeup fd, and a thread
        reading it starts the timer at once."""
        signal.signal(signal.SIGTERM, lambda signum, frame: self.request())
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="leave", daemon=True).start()
        return self

    def _watch(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):
            if signal.SIGTERM in data:
                self.request()

    def request(self) -> None:
        with self._lock:
            if self.requested:
                return
            self.requested = True
        timer = threading.Timer(self.grace_s, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self) -> None:
        if self.before_exit is not None:
            self.before_exit()
        os._exit(EXIT_REFORM)


def _from_rank0(rank: int, compute: Callable[[], T]) -> T:
    """`compute()` on rank 0, its result on every rank (over the control group), so that all
    ranks act on one decision at the same step."""
    box = [compute() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _control(ctx: Context) -> str:
    """Rank 0 reads the control key; everyone gets its answer at the same step."""
    return _from_rank0(ctx.rank, lambda: ctx.etcd.get(keys.control(ctx.job_id)) or "run")


def _replica_inputs(pipe: RankPipeline, split: Split, indices, valid):
    """The inputs (first stage) and masked targets (last stage) this rank needs for a batch."""
    inputs = split.inputs[indices] if pipe.is_first else None
    targets = None
    if pipe.is_last:
        targets = split.labels[indices].clone()
        targets[~torch.from_numpy(valid)] = IGNORE  # padding entries add no loss
    return inputs, targets


def evaluate(ctx: Context, pipe: RankPipeline, data: Dataset) -> tuple[float, float] | None:
    """Held-out (accuracy, mean loss), known on the last stage (None elsewhere)."""
    spec, layout = ctx.spec, ctx.layout
    sampler = ElasticSampler(len(data.test), spec.training.global_batch_size, seed=0)
    correct = torch.zeros(2)  # correct count, summed loss
    cursor = 0
    while cursor < len(data.test):
        b = sampler.batch(0, cursor, layout.replicas, ctx.replica)
        inputs, targets = _replica_inputs(pipe, data.test, b.indices, b.valid)
        logits = pipe.forward_only(inputs, targets)
        if pipe.is_last:
            mask = torch.from_numpy(b.valid)
            correct[0] += (logits.argmax(-1)[mask] == targets[mask]).sum()
            correct[1] += torch.nn.functional.cross_entropy(
                logits, targets, ignore_index=IGNORE, reduction="sum"
            )
        cursor = b.next_cursor
    if not pipe.is_last:
        return None
    if pipe.groups.data_parallel is not None:
        dist.all_reduce(correct, group=pipe.groups.data_parallel)
    return float(correct[0]) / len(data.test), float(correct[1]) / len(data.test)


class Trainer:
    """One rank's training run. A re-layout swaps the pipeline, optimizer and placement in
    place; epoch, step, LR schedule position and the sampler cursor carry over."""

    def __init__(self, ctx: Context, leave: LeaveRequest | None = None):
        self.ctx, self.spec, self.tspec = ctx, ctx.spec, ctx.spec.training
        self.leave = leave or LeaveRequest()
        self._stepped = False
        self.data = load_dataset(self.spec.data, self.spec.model)
        self.sampler = ElasticSampler(
            len(self.data.train), self.tspec.global_batch_size, self.tspec.seed
        )
        total = self.tspec.epochs * self.sampler.steps_per_epoch()
        self.total_steps = min(total, self.tspec.max_steps or total)
        self.state = ctx.assignment.start
        self.saved_step = self.state.step if self.state.checkpoint else -1
        self.freeze = FreezeState(boundary=ctx.layout.freeze_boundary)
        if self.state.checkpoint:
            saved = read_meta(self.state.checkpoint).get("freeze")
            if saved:
                self.freeze = FreezeState.from_dict(saved)
        if self.freeze.boundary < ctx.layout.freeze_boundary:
            # checkpointed just before a re-layout: the recorded layout's boundary holds
            self.freeze = dataclasses.replace(self.freeze, boundary=ctx.layout.freeze_boundary)
        self.meter = GradNormMeter(self.spec.model.depth)
        self.cache: ActivationCache | None = None
        self._build(load_from=self.state.checkpoint, checksum=ctx.assignment.resume_checksum)

    def _build(self, load_from: str | None, checksum: str | None = None) -> None:
        if load_from and checksum:
            verify_checkpoint(load_from, checksum)
        self.pipe, self.optimizer = build_training(
            self.spec, self.ctx.layout, self.ctx.rank, load_from
        )
        # dropout draws from torch's global generator, which a fresh process seeds at random
        # (building the model leaves it as it was): give each rank its own stream from here on
        # (stages and replicas draw different masks), the same whenever the run is repeated
        torch.manual_seed(dropout_seed(self.tspec.seed, self.ctx.rank, self.state.step))
        # one rank owns the loss of the global batch
        self.reports = self.ctx.replica == 0 and self.pipe.is_last
        self._attach_cache()

    def _attach_cache(self) -> None:
        """AutoCache on a rank that runs a frozen prefix: one cache per process (files shared by
        the node's processes), re-keyed at each boundary, used where it is measured cheaper."""
        prefix, mode = self.pipe.model.prefix, self.spec.freeze.cache
        if prefix is None or mode == "off":
            return
        f = self.pipe.model.freeze_boundary
        if self.cache is None:
            directory = Path(self.ctx.assignment.checkpoint_dir).parent / "cache"
            self.cache = ActivationCache.for_model(directory, self.spec.model, len(self.data.train))
        self.cache.set_boundary(f, prefix.fingerprints(f))
        batch = self.tspec.global_batch_size // self.ctx.layout.replicas
        sample = self.data.train.inputs[:batch]
        decision = self.cache.decide(CachePolicy(mode), prefix, sample, f)
        self.pipe.cache = self.cache if decision.use else None
        log.info("rank %d AutoCache at F=%d: %s", self.ctx.rank, f, decision.reason)
        self.ctx.reporter.emit("cache", boundary=f, **decision.as_dict())

    def checkpoint(self, reason: str, wait: bool = True) -> None:
        """Collective: snapshot the current state (once per step) and write it; rank 0 reports
        it (the `checkpoint` event the controller commits) once every shard is durable and the
        directory sealed. With `wait` (re-layout, stop, leave, end) it is complete and reported
        before this returns; otherwise (periodic, with checkpoint.async_save) training goes on
        while it persists and a later step boundary reports it."""
        ckpt = self._checkpointer()
        # at most one in flight: collect the previous (background) one first
        if not self._report_checkpoint(block=True, tolerate=True):
            if self.saved_step == self.state.step:  # it was this very step's: write it again
                self.saved_step = -1
        if self.saved_step != self.state.step:
            ctx, state = self.ctx, self.state
            path = Path(ctx.assignment.checkpoint_dir) / f"step-{state.step:08d}"
            meta = state.model_dump() | {
                "layout_version": ctx.layout.version,
                "reason": reason,
                "freeze": self.freeze.to_dict(),
                # what the weights are for: a fine-tuning job checks it at submission
                "model": self.spec.model.model_dump(),
            }
            ckpt.start(path, self.pipe.model, self.optimizer, meta)
            self._ckpt_state, self._ckpt_time = state, time.monotonic()
            self.saved_step = state.step
        if wait or not ckpt.async_save:
            self._report_checkpoint(block=True, tolerate=not wait)

    def _checkpointer(self) -> AsyncCheckpointer:
        """This process's checkpointer, made at the first checkpoint: a collective (it creates
        the gloo group the background writes use), reached by every rank at the same step."""
        ckpt = self.__dict__.get("_ckpt")
        if ckpt is None:
            ckpt = self._ckpt = AsyncCheckpointer(async_save=self.spec.checkpoint.async_save)
        return ckpt

    def _report_checkpoint(self, block: bool, tolerate: bool = True) -> bool:
        """Collect a checkpoint that has been sealed (wait for it if `block`): rank 0 emits the
        event with the state as of the step it snapshots; every rank records its path.

        A checkpoint that failed to write or seal was never committed. With `tolerate` (a
        background checkpoint) that is reported (`checkpoint_failed`) and training goes on: the
        last committed checkpoint stays the resume point and the next interval tries again.
        Returns False for such a failure."""
        ckpt = self.__dict__.get("_ckpt")
        try:
            saved = None if ckpt is None else (ckpt.wait() if block else ckpt.poll())
        except CheckpointWriteError as exc:
            if not tolerate:
                raise
            log.warning("rank %d: %s; training goes on", self.ctx.rank, exc)
            if self.ctx.rank == 0:
                self.ctx.reporter.emit(
                    "checkpoint_failed", step=self._ckpt_state.step, error=str(exc)
                )
            return False
        if saved is None:
            return True
        if self.ctx.rank == 0:
            self.ctx.reporter.emit(
                "checkpoint",
                path=saved.path,
                size_bytes=saved.size_bytes,
                checksum=saved.checksum,
                seconds=saved.seconds,
                blocked_s=saved.blocked_s,
                state=self._ckpt_state.model_dump(),
                layout_version=saved.meta["layout_version"],
            )
        self.state = self.state.model_copy(update={"checkpoint": saved.path})
        return True

    def _periodic_checkpoint(self, epoch_done: bool) -> None:
        """At every step boundary: report a checkpoint that finished sealing, and start the next
        one when an interval of `checkpoint` has elapsed (CheckpointSpec, checkpoint_due)."""
        self._report_checkpoint(block=False)
        spec, st = self.spec, self.state
        since = self.__dict__.setdefault("_ckpt_time", time.monotonic())
        seconds = None
        if spec.checkpoint.every_seconds is not None and (
            st.step % spec.runtime.control_every_steps == 0 or epoch_done
        ):
            # clocks differ between ranks: rank 0's decides, so every rank takes the same step
            seconds = _from_rank0(self.ctx.rank, lambda: time.monotonic() - since)
        due = checkpoint_due(
            spec.checkpoint,
            steps_since=st.step - max(self.saved_step, 0),
            epoch=st.epoch,
            epoch_end=epoch_done,
            seconds_since=seconds,
        )
        if due:
            self.checkpoint(due, wait=False)

    def step(self) -> bool:
        """One optimizer step; returns whether it ended an epoch."""
        ctx, pipe, st = self.ctx, self.pipe, self.state
        t0 = time.perf_counter()
        b = self.sampler.batch(st.epoch, st.samples_consumed, ctx.layout.replicas, ctx.replica)
        inputs, targets = _replica_inputs(pipe, self.data.train, b.indices, b.valid)
        lr = lr_at(st.step, self.total_steps, self.tspec)
        set_lr(self.optimizer, lr)
        loss = pipe.train_step(inputs, targets, b.global_valid, indices=b.indices)
        pipe.sync_and_clip(self.tspec.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.add(pipe.block_norms)
        if pipe.is_last and pipe.groups.data_parallel is not None:
            total = torch.tensor([loss])
            dist.all_reduce(total, group=pipe.groups.data_parallel)
            loss = float(total)
        epoch, cursor = st.epoch, b.next_cursor
        epoch_done = cursor >= len(self.data.train)
        if epoch_done:
            epoch, cursor = epoch + 1, 0
        self.state = st.model_copy(
            update={"epoch": epoch, "step": st.step + 1, "samples_consumed": cursor, "lr": lr}
        )
        if self.reports:
            ctx.reporter.emit(
                "metrics",
                step=st.step + 1,
                epoch=epoch,
                samples_consumed=cursor,
                loss=loss,
                lr=lr,
                samples_per_s=b.global_valid / (time.perf_counter() - t0),
                frozen=ctx.layout.freeze_boundary,
            )
        return epoch_done

    def run(self) -> str:
        ctx, spec = self.ctx, self.spec
        ctx.reporter.emit(
            "started",
            stages=[s.index for s in ctx.stages],
            replica=ctx.replica,
            pid=os.getpid(),
            host=socket.gethostname(),
            node=node_id(),
            total_steps=self.total_steps,
        )
        while self.state.epoch < self.tspec.epochs and self.state.step < self.total_steps:
            epoch_done = self.step()
            if not self._stepped:  # how long the (re)start took, for the record
                self._stepped = True
                if ctx.rank == 0:
                    ctx.reporter.emit("first_step", step=self.state.step, time=time.time())
            if self._leaving():
                return "leave"
            if epoch_done:
                result = evaluate(ctx, self.pipe, self.data)
                if result is not None and ctx.replica == 0:
                    ctx.reporter.emit(
                        "eval",
                        epoch=self.state.epoch,
                        step=self.state.step,
                        accuracy=result[0],
                        loss=result[1],
                    )
                if _broadcast_reached(ctx, self.pipe, result):
                    self.checkpoint("target")
                    return "target"
            self._periodic_checkpoint(epoch_done)
            finished = self.state.epoch >= self.tspec.epochs or self.state.step >= self.total_steps
            # decision points run with policy 'off' too: a manual override is applied there
            if not finished and is_decision_point(spec.freeze, self.state.step, epoch_done):
                self.decide_freeze()
            if self.state.step % spec.runtime.control_every_steps == 0 or epoch_done:
                if _control(ctx) == "stop":
                    self.checkpoint("stop")
                    return "stopped"
        self.checkpoint("end")
        return "done"

    def _leaving(self) -> bool:
        """Whether any rank was asked to leave (SIGTERM) during this step: then everyone
        checkpoints this step and exits, and the agents re-form the job without the leaver.
        One tiny all-reduce per step over the control group, so all ranks agree."""
        ctx = self.ctx
        asked = torch.zeros(ctx.world)
        asked[ctx.rank] = 1.0 if self.leave.requested else 0.0
        dist.all_reduce(asked)
        ranks = asked.nonzero().flatten().tolist()
        if not ranks:
            return False
        self.checkpoint("leave")
        if ctx.rank == 0:
            ctx.reporter.emit("leaving", ranks=ranks, step=self.state.step)
        return True

    # -- AutoFreeze and re-layout ---------------------------------------------------------------

    def decide_freeze(self) -> None:
        """A decision point: rank 0 decides (the automatic decision, raised to a pending manual
        request if that is further), everyone gets the same decision over the control group; a
        new boundary triggers a re-layout."""
        ctx = self.ctx
        decision, request = _from_rank0(ctx.rank, self._decision_on_rank0)
        self.meter.reset()
        self.freeze = decision.state
        if ctx.rank == 0 and (decision.changed or request is not None):
            ctx.reporter.emit(
                "freeze",
                step=self.state.step,
                previous=decision.previous,
                boundary=decision.boundary,
                source=decision.source,
                reason=decision.reason,
                request=request,
                outcome=decision.override,
                outcome_reason=decision.override_reason,
            )
        if decision.boundary > ctx.layout.freeze_boundary:
            self.relayout(decision.boundary, decision.reason)

    def _decision_on_rank0(self) -> tuple[FreezeDecision, dict | None]:
        ctx = self.ctx
        raw = ctx.etcd.get(keys.freeze_override(ctx.job_id))
        request = parse_freeze_request(raw) if raw else None
        norms = self.meter.means() if self.meter.steps else None
        depth, fspec = self.spec.model.depth, self.spec.freeze
        override = None if request is None else request.get("layers", "<missing>")
        return decide(fspec, self.freeze, norms, depth, override=override), request

    def relayout(self, boundary: int, why: str) -> None:
        """AutoPipe + AutoDP in the running processes: commit state, plan the layout for the new
        boundary (rank 0 measures; everyone adopts), rebuild the training groups, and load each
        block's weights and optimizer state onto its new owner from the committed checkpoint
        (resharded by block name). Frozen blocks keep their exact values."""
        ctx = self.ctx
        t0 = time.monotonic()
        planned, reason = _from_rank0(
            ctx.rank, lambda: relayout_plan(self.spec, ctx.layout, boundary, ctx.world)
        )
        self.checkpoint("relayout")
        self.pipe.destroy_groups()
        ctx.layout = planned
        placements = planned.placements(ctx.rank)
        ctx.stages, ctx.replica = [s for s, _ in placements], placements[0][1]
        self.state = self.state.model_copy(
            update={"freeze_boundary": boundary, "layout_version": planned.version}
        )
        self._build(load_from=self.state.checkpoint)
        dist.barrier()
        if ctx.rank == 0:
            ctx.reporter.emit(
                "layout",
                layout=planned.model_dump(),
                reason=f"autofreeze ({why}); {reason}",
                seconds=time.monotonic() - t0,
            )


def dropout_seed(seed: int, rank: int, step: int) -> int:
    """The seed of a rank's dropout masks from `step` on (a start, resume or re-layout): distinct
    per rank and per such point, the same whenever the run is repeated."""
    return ((seed * 1_000_003 + rank) * 1_000_003 + step) % (1 << 63)


def _broadcast_reached(ctx: Context, pipe: RankPipeline, result) -> bool:
    """Whether held-out accuracy reached the target; decided on the last stage, known everywhere."""
    target = ctx.spec.training.target_accuracy
    if target is None:
        return False
    last_rank = ctx.layout.stages[-1].ranks[0]
    flag = torch.tensor([1.0 if result is not None and result[0] >= target else 0.0])
    dist.broadcast(flag, src=last_rank)
    return bool(flag.item())


def _measured_layout(spec: JobSpec, layout: Layout, rank: int, reporter: Reporter) -> Layout:
    """AutoPipe at start-up: rank 0 measures the model on its device (cached per model and
    device) and plans; every rank adopts that one answer via the control group, and the
    controller records it as the next layout version."""
    t0 = time.monotonic()
    planned, reason = _from_rank0(rank, lambda: autopipe_layout(spec, layout))
    if rank == 0:
        seconds = time.monotonic() - t0
        reporter.emit("layout", layout=planned.model_dump(), reason=reason, seconds=seconds)
    return planned


def _hold(etcd: EtcdClient, assignment: Assignment, leave: LeaveRequest) -> int:
    """No layout fits this world: keep the lease and wait until the agents re-rendezvous (a
    node joined: they stop us) or we are told to leave."""
    log.warning("%s", assignment.waiting)
    while not leave.requested:
        time.sleep(0.2)
    return EXIT_REFORM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer.worker", description=__doc__)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--etcd", required=True, help="etcd endpoint HOST:PORT")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {os.environ.get('RANK', '?')}] %(message)s"
    )
    leave = LeaveRequest().install()
    etcd = EtcdClient(args.etcd)
    spec = _read_spec(etcd, args.job_id)
    torch.set_num_threads(spec.runtime.threads_per_worker)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assignment = _join(etcd, args.job_id, rank, world)
    if assignment.fatal:  # the job failed for good: exit 0 so that the agents stop restarting
        log.error("job %s failed: %s; not starting again", args.job_id, assignment.fatal)
        dist.destroy_process_group()
        return 0
    generation = assignment.generation
    reporter = Reporter(etcd, args.job_id, generation, rank)
    lease = etcd.lease(spec.runtime.lease_ttl_s)
    presence = {"generation": generation, "pid": os.getpid(), "host": socket.gethostname()}
    etcd.put(keys.worker(args.job_id, rank), json.dumps(presence), lease=lease)
    keepalive = etcd.keep_alive(lease)
    aborted = "the controller aborted the generation"
    watch = AbortWatch(
        etcd,
        args.job_id,
        generation,
        before_exit=lambda: reporter.last_word("aborted", why=aborted),
    ).start()
    leave.before_exit = lambda: reporter.last_word(
        "left", why=f"SIGTERM; the graceful leave did not finish within {leave.grace_s:g}s"
    )
    code, phase = 0, "build"  # build: everything before the first step
    try:
        if assignment.layout is None:
            return _hold(etcd, assignment, leave)
        layout = _startup_layout(spec, assignment.layout, world, rank, reporter)
        placements = layout.placements(rank)
        stages, replica = [s for s, _ in placements], placements[0][1]
        ctx = Context(
            args.job_id, spec, layout, assignment, rank, stages, replica, etcd, reporter, world
        )
        trainer = Trainer(ctx, leave)
        phase = "train"
        outcome = trainer.run()
        if outcome == "leave":
            code = EXIT_REFORM
        else:
            dist.barrier()
            if rank == 0:
                reporter.emit("stopped" if outcome == "stopped" else "done", outcome=outcome)
        dist.barrier()  # every final report is queued before any lease is revoked
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        if not is_peer_loss(exc):
            reporter.emit("failed", error=error, phase=phase)
            raise
        # not this rank's fault: say so, and leave to re-form without a traceback
        log.warning("rank %d lost a peer (%s); leaving to re-form", rank, error)
        reporter.emit("peer_lost", error=error, phase=phase)
        code = EXIT_REFORM
    finally:
        watch.stop()
        keepalive.stop(revoke=True)
        dist.destroy_process_group()
    return code


def _startup_layout(
    spec: JobSpec, layout: Layout, world: int, rank: int, reporter: Reporter
) -> Layout:
    """The layout to train under: the assigned one, or one planned from measurement when the
    spec asks for AutoPipe or an automatic micro-batch count and it was not measured yet."""
    p = spec.parallel
    if layout.planner == "autopipe" or (p.partition != "autopipe" and p.microbatches != "auto"):
        return layout
    if world == p.world_size and layout.freeze_boundary == 0:
        return _measured_layout(spec, layout, rank, reporter)
    # a re-formed world: plan S' x R' = world from measurement, as a re-layout does
    t0 = time.monotonic()
    planned, reason = _from_rank0(
        rank, lambda: relayout_plan(spec, layout, layout.freeze_boundary, world)
    )
    if rank == 0:
        seconds = time.monotonic() - t0
        reporter.emit("layout", layout=planned.model_dump(), reason=reason, seconds=seconds)
    return planned


if __name__ == "__main__":
    sys.exit(main())
