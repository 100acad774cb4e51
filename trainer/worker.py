"""The trainer process: one per accelerator, started by torchrun (`-m trainer.worker`).

It reads its job from etcd (spec, layout, assignment), trains its pipeline stage, and reports
progress back through etcd; the controller is the only writer of the SQL store. Rank 0 reads the
control key at step boundaries and broadcasts the decision over the control group, so every rank
acts on it at the same step.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orchestrator import keys
from orchestrator.etcd_client import EtcdClient
from orchestrator.manifest import verify_checkpoint
from orchestrator.spec import JobSpec
from orchestrator.state import Assignment, Layout, StageLayout, TrainingState, WorkerEvent
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.data import Dataset, Split, load_dataset
from trainer.optim import build_optimizer, lr_at, set_lr
from trainer.pipeline import RankPipeline, build_rank_pipeline
from trainer.profile import autopipe_layout
from trainer.sampler import IGNORE, ElasticSampler

log = logging.getLogger("pipetransformer.worker")


class Reporter:
    """Puts WorkerEvents into the job's etcd event queue."""

    def __init__(self, etcd: EtcdClient, job_id: str, generation: int, rank: int):
        self.etcd, self.job_id, self.generation, self.rank = etcd, job_id, generation, rank
        self.seq = 0

    def emit(self, kind: str, **data: Any) -> None:
        event = WorkerEvent(kind=kind, rank=self.rank, generation=self.generation, data=data)
        key = keys.event(self.job_id, self.generation, self.rank, self.seq)
        self.etcd.put(key, event.model_dump_json())
        self.seq += 1


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


def _read_job(etcd: EtcdClient, job_id: str, timeout: float = 60.0):
    """Wait for the controller to publish spec, layout and assignment (a torchx launch may start
    workers before the controller has written them)."""
    deadline = time.monotonic() + timeout
    while True:
        raw = [
            etcd.get(k) for k in (keys.spec(job_id), keys.layout(job_id), keys.assignment(job_id))
        ]
        if all(raw):
            return (
                JobSpec.model_validate_json(raw[0]),
                Layout.model_validate_json(raw[1]),
                Assignment.model_validate_json(raw[2]),
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"job {job_id!r} has no spec/layout/assignment in etcd after {timeout}s"
            )
        time.sleep(0.2)


def _control(ctx: Context) -> str:
    """Rank 0 reads the control key; everyone gets its answer at the same step."""
    box = [None]
    if ctx.rank == 0:
        raw = ctx.etcd.get(keys.control(ctx.job_id))
        box[0] = raw or "run"
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def _replica_inputs(ctx: Context, pipe: RankPipeline, split: Split, indices, valid):
    images = split.inputs[indices] if pipe.is_first else None
    targets = None
    if pipe.is_last:
        targets = split.labels[indices].clone()
        targets[~torch.from_numpy(valid)] = IGNORE
    return images, targets


def evaluate(ctx: Context, pipe: RankPipeline, data: Dataset) -> tuple[float, float] | None:
    """Held-out (accuracy, mean loss), known on the last stage (None elsewhere)."""
    spec, layout = ctx.spec, ctx.layout
    sampler = ElasticSampler(len(data.test), spec.training.global_batch_size, seed=0)
    correct = torch.zeros(2)  # correct count, summed loss
    cursor = 0
    while cursor < len(data.test):
        b = sampler.batch(0, cursor, layout.replicas, ctx.replica)
        images, targets = _replica_inputs(ctx, pipe, data.test, b.indices, b.valid)
        logits = pipe.forward_only(images, targets)
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


def _checkpoint(
    ctx: Context, module, optimizer, state: TrainingState, reason: str
) -> TrainingState:
    name = f"step-{state.step:08d}"
    path = Path(ctx.assignment.checkpoint_dir) / name
    meta = state.model_dump() | {"layout_version": ctx.layout.version, "reason": reason}
    t0 = time.monotonic()
    saved = save_checkpoint(path, module, optimizer, meta)
    if saved is not None:
        ctx.reporter.emit(
            "checkpoint",
            path=saved.path,
            size_bytes=saved.size_bytes,
            checksum=saved.checksum,
            seconds=time.monotonic() - t0,
            state=state.model_dump(),
            layout_version=ctx.layout.version,
        )
    return state.model_copy(update={"checkpoint": str(path)})


def train(ctx: Context) -> str:
    spec, layout, tspec = ctx.spec, ctx.layout, ctx.spec.training
    data = load_dataset(spec.data, spec.model)
    replica_batch = tspec.global_batch_size // layout.replicas
    recompute = [spec.parallel.recompute_for(i) for i in range(layout.num_stages)]
    pipe = build_rank_pipeline(spec.model, tspec.seed, layout, ctx.rank, replica_batch, recompute)
    module, groups = pipe.model, pipe.groups
    optimizer = build_optimizer(module, tspec)
    state = ctx.assignment.start
    if state.checkpoint:
        if ctx.assignment.resume_checksum:
            verify_checkpoint(state.checkpoint, ctx.assignment.resume_checksum)
        load_checkpoint(state.checkpoint, module, optimizer)
        log.info("rank %d resumed from %s at step %d", ctx.rank, state.checkpoint, state.step)
    sampler = ElasticSampler(len(data.train), tspec.global_batch_size, tspec.seed)
    total_steps = tspec.epochs * sampler.steps_per_epoch()
    if tspec.max_steps:
        total_steps = min(total_steps, tspec.max_steps)
    reports = ctx.replica == 0 and pipe.is_last  # one rank owns the loss of the global batch
    ctx.reporter.emit(
        "started",
        stages=[s.index for s in ctx.stages],
        replica=ctx.replica,
        pid=os.getpid(),
        host=socket.gethostname(),
        total_steps=total_steps,
    )

    epoch, step, cursor = state.epoch, state.step, state.samples_consumed
    saved_step = step if state.checkpoint else -1

    def checkpoint(reason: str) -> None:
        nonlocal state, saved_step
        if saved_step != step:
            state = _checkpoint(ctx, module, optimizer, state, reason)
            saved_step = step

    while epoch < tspec.epochs and step < total_steps:
        t0 = time.perf_counter()
        b = sampler.batch(epoch, cursor, layout.replicas, ctx.replica)
        images, targets = _replica_inputs(ctx, pipe, data.train, b.indices, b.valid)
        lr = lr_at(step, total_steps, tspec)
        set_lr(optimizer, lr)
        loss = pipe.train_step(images, targets, b.global_valid)
        pipe.sync_and_clip(tspec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, cursor = step + 1, b.next_cursor
        if pipe.is_last and groups.data_parallel is not None:
            total = torch.tensor([loss])
            dist.all_reduce(total, group=groups.data_parallel)
            loss = float(total)
        epoch_done = cursor >= len(data.train)
        if epoch_done:
            epoch, cursor = epoch + 1, 0
        state = state.model_copy(
            update={"epoch": epoch, "step": step, "samples_consumed": cursor, "lr": lr}
        )
        if reports:
            ctx.reporter.emit(
                "metrics",
                step=step,
                epoch=epoch,
                samples_consumed=cursor,
                loss=loss,
                lr=lr,
                samples_per_s=b.global_valid / (time.perf_counter() - t0),
            )
        if epoch_done:
            result = evaluate(ctx, pipe, data)
            if result is not None and ctx.replica == 0:
                ctx.reporter.emit(
                    "eval", epoch=epoch, step=step, accuracy=result[0], loss=result[1]
                )
            if _broadcast_reached(ctx, pipe, result):
                checkpoint("target")
                return "target"
            if epoch % spec.checkpoint.every_epochs == 0:
                checkpoint("epoch")
        if step % spec.runtime.control_every_steps == 0 or epoch_done:
            if _control(ctx) == "stop":
                checkpoint("stop")
                return "stopped"
    checkpoint("end")
    return "done"


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
    box: list = [None]
    if rank == 0:
        t0 = time.monotonic()
        planned, reason = autopipe_layout(spec, layout)
        box[0] = (planned.model_dump_json(), reason, time.monotonic() - t0)
    dist.broadcast_object_list(box, src=0)
    planned_json, reason, seconds = box[0]
    planned = Layout.model_validate_json(planned_json)
    if rank == 0:
        reporter.emit("layout", layout=planned.model_dump(), reason=reason, seconds=seconds)
    return planned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer.worker", description=__doc__)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--etcd", required=True, help="etcd endpoint HOST:PORT")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [rank {os.environ.get('RANK', '?')}] %(message)s"
    )
    etcd = EtcdClient(args.etcd)
    spec, layout, assignment = _read_job(etcd, args.job_id)
    torch.set_num_threads(spec.runtime.threads_per_worker)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world_size:
        raise SystemExit(f"layout v{layout.version} needs {layout.world_size} ranks, got {world}")
    reporter = Reporter(etcd, args.job_id, assignment.generation, rank)
    p = spec.parallel
    if (p.partition == "autopipe" or p.microbatches == "auto") and layout.planner != "autopipe":
        layout = _measured_layout(spec, layout, rank, reporter)
    placements = layout.placements(rank)
    stages, replica = [s for s, _ in placements], placements[0][1]
    lease = etcd.lease(spec.runtime.lease_ttl_s)
    etcd.put(keys.worker(args.job_id, rank), str(os.getpid()), lease=lease)
    keepalive = etcd.keep_alive(lease)
    ctx = Context(args.job_id, spec, layout, assignment, rank, stages, replica, etcd, reporter)
    try:
        outcome = train(ctx)
        dist.barrier()
        if rank == 0:
            reporter.emit("stopped" if outcome == "stopped" else "done", outcome=outcome)
    except Exception as exc:
        reporter.emit("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        keepalive.stop(revoke=True)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
