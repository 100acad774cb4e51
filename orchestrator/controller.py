"""The job controller: the single writer of the SQL store for a job.

It plans and publishes what the workers need (spec, layout, assignment) in etcd, drains the
events workers put in etcd into the store, commits checkpoints only after verifying them on disk,
applies retention, and turns the end of a generation into a job state. It holds a lease on the
job's controller key, so two controllers never drive the same job.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orchestrator import keys
from orchestrator.etcd_client import EtcdClient, KeepAlive
from orchestrator.manifest import CheckpointError, verify_checkpoint
from orchestrator.spec import JobSpec
from orchestrator.state import Assignment, Layout, TrainingState, WorkerEvent
from orchestrator.store import CheckpointInfo, Store
from trainer.partition import plan_layout  # pure planner: the one trainer import allowed here

log = logging.getLogger("pipetransformer.controller")

TERMINAL = ("completed", "failed", "interrupted")


class ControllerError(RuntimeError):
    pass


def new_job_id(spec: JobSpec) -> str:
    return f"{spec.name}-{uuid.uuid4().hex[:6]}"


def _is_dead_local_process(holder_json: str) -> bool:
    try:
        holder = json.loads(holder_json)
        if holder.get("host") != socket.gethostname():
            return False
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (ValueError, KeyError, TypeError, PermissionError):
        return False
    return False


def job_dir(workdir: str | Path, job_id: str) -> Path:
    return Path(workdir).resolve() / "jobs" / job_id


@dataclass
class Progress:
    """What the controller has seen of the current generation (for displays and the outcome)."""

    step: int = 0
    epoch: int = 0
    total_steps: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    accuracy: float | None = None
    outcome: str | None = None  # done / stopped / failed, from the workers
    error: str | None = None
    workers_started: int = 0
    layout: Layout | None = None


class Controller:
    def __init__(self, store: Store, etcd: EtcdClient, job_id: str):
        self.store, self.etcd, self.job_id = store, etcd, job_id
        self.job = store.get_job(job_id)
        self.spec: JobSpec = self.job.spec
        self.generation = 0
        self.layout: Layout | None = store.current_layout(job_id)
        self.progress = Progress()
        self._keepalive: KeepAlive | None = None
        self._audited: set[str] = set()

    # -- lifecycle --------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        store: Store,
        etcd: EtcdClient,
        spec: JobSpec,
        workdir: str | Path,
        job_id: str | None = None,
    ) -> Controller:
        """Record a new job (pending) with its initial layout."""
        job_id = job_id or new_job_id(spec)
        store.create_job(job_id, spec, str(Path(workdir).resolve()))
        store.record_layout(job_id, plan_layout(spec), reason="initial")
        store.add_event(job_id, "job_created", f"job {job_id} created from spec {spec.name!r}")
        return cls(store, etcd, job_id)

    @property
    def checkpoint_dir(self) -> Path:
        return job_dir(self.job.workdir, self.job_id) / "checkpoints"

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the job's controller lease. A holder that is a dead process on this host is
        replaced at once; any other holder must let its lease expire within `wait_s` (default
        two lease TTLs), else this fails."""
        ttl = max(2, self.spec.runtime.lease_ttl_s)
        key = keys.controller(self.job_id)
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        deadline = time.monotonic() + (2 * ttl if wait_s is None else wait_s)
        lease = self.etcd.lease(ttl)
        while not self.etcd.put_if_absent(key, me, lease=lease):
            holder = self.etcd.get(key)
            if holder is not None and _is_dead_local_process(holder):
                self.etcd.delete(key)  # racing resumers still meet at put_if_absent
                continue
            if time.monotonic() > deadline:
                lease.revoke()
                raise ControllerError(f"job {self.job_id} is already controlled by {holder}")
            time.sleep(0.2)
        self._keepalive = self.etcd.keep_alive(lease)

    def release(self) -> None:
        if self._keepalive is not None:
            self._keepalive.stop(revoke=True)
            self._keepalive = None

    def resume_point(self) -> tuple[TrainingState, CheckpointInfo | None]:
        """The last committed checkpoint that is intact on disk; corrupt ones are marked and
        skipped (the previous committed one is used)."""
        for ckpt in self.store.checkpoints(self.job_id):
            try:
                verify_checkpoint(ckpt.path, ckpt.checksum)
            except CheckpointError as exc:
                self.store.set_checkpoint_state(ckpt.id, "corrupt")
                self.store.add_event(self.job_id, "checkpoint_corrupt", str(exc))
                continue
            state = TrainingState(
                epoch=ckpt.epoch,
                step=ckpt.step,
                samples_consumed=ckpt.samples_consumed,
                lr=self.job.lr,
                freeze_boundary=self.job.freeze_boundary,
                layout_version=ckpt.layout_version,
                checkpoint=ckpt.path,
            )
            return state, ckpt
        return TrainingState(), None

    def start_generation(self, world_size: int | None = None) -> Assignment:
        """Publish spec, layout and assignment for a new generation of workers."""
        layout = self.layout or plan_layout(self.spec)
        world = world_size or layout.world_size
        if world != layout.world_size:
            raise ControllerError(
                f"layout v{layout.version} needs {layout.world_size} workers, {world} available"
            )
        start, ckpt = self.resume_point()
        self.generation = self.store.start_generation(self.job_id, world)
        assignment = Assignment(
            generation=self.generation,
            checkpoint_dir=str(self.checkpoint_dir),
            start=start,
            resume_checksum=ckpt.checksum if ckpt else None,
        )
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.etcd.delete_prefix(keys.events(self.job_id))  # stale reports of a dead generation
        self.etcd.put(keys.spec(self.job_id), self.spec.to_json())
        self.etcd.put(keys.layout(self.job_id), layout.model_dump_json())
        self.etcd.put(keys.control(self.job_id), "run")
        self.etcd.put(keys.assignment(self.job_id), assignment.model_dump_json())
        self.store.set_job_state(self.job_id, "running")
        how = f"from checkpoint at step {start.step}" if ckpt else "from scratch"
        self.store.add_event(
            self.job_id,
            "generation_started",
            f"generation {self.generation} with {world} workers, {how}",
            data={"layout": layout.describe(), "start": start.model_dump()},
        )
        self.layout = layout
        self.progress = Progress(step=start.step, epoch=start.epoch, layout=layout)
        return assignment

    def request_stop(self, reason: str) -> None:
        """Ask workers to checkpoint and leave at their next control point."""
        self.etcd.put(keys.control(self.job_id), "stop")
        self.store.add_event(self.job_id, "stop_requested", reason)

    def finish(self, exit_code: int | None, detail: str = "") -> str:
        """Turn the generation's end into a job state; returns it."""
        self.drain()
        p = self.progress
        if p.outcome in ("done", "target"):
            state, message = "completed", f"completed at step {p.step}"
        elif p.outcome == "stopped":
            state, message = "interrupted", f"stopped at step {p.step}; resume to continue"
        else:
            why = p.error or (
                f"workers exited with code {exit_code}" if exit_code else "workers exited"
            )
            state = "failed" if p.error else "interrupted"
            message = f"{why}; resume continues from the last committed checkpoint"
            if detail:
                message += f"\n{detail}"
        self.store.end_generation(self.job_id, self.generation, state)
        self.store.set_job_state(self.job_id, state, message.splitlines()[0])
        self.store.add_event(self.job_id, f"job_{state}", message)
        return state

    # -- events -------------------------------------------------------------------------------

    def drain(self) -> list[WorkerEvent]:
        """Move every queued worker event into the store, then delete it from etcd. Store writes
        are idempotent, so a crash between the two only replays events."""
        self._audit_new_request()
        items = self.etcd.get_prefix(keys.events(self.job_id))
        if not items:
            return []
        events = [WorkerEvent.model_validate_json(v) for _, v in items]
        metrics = [e.data | {"time": e.time} for e in events if e.kind == "metrics"]
        if metrics:
            self.store.add_metrics(self.job_id, metrics)
        for e in events:
            self._apply(e)
        last = self._latest_state(events)
        if last is not None:
            self.store.update_progress(self.job_id, self._current(last))
        for key, _ in items:
            self.etcd.delete(key)
        return events

    def _current(self, state: TrainingState) -> TrainingState:
        """A reported state, with the boundary and version of the layout in force: a checkpoint
        written just before a re-layout must not move the job's freeze boundary back."""
        if self.layout is None:
            return state
        return state.model_copy(
            update={
                "freeze_boundary": max(state.freeze_boundary, self.layout.freeze_boundary),
                "layout_version": max(state.layout_version, self.layout.version),
            }
        )

    def _audit_new_request(self) -> None:
        """Record a manual freeze request filed in etcd (by the CLI or the dashboard) once."""
        raw = self.etcd.get(keys.freeze_override(self.job_id))
        if not raw:
            return
        request = json.loads(raw)
        if request["id"] in self._audited:
            return
        self._audited.add(request["id"])
        self.store.add_event(
            self.job_id,
            "freeze_requested",
            f"request {request['id']} by {request['who']}: freeze blocks below "
            f"{request['layers']} ({request['reason']})",
            data={"request": request},
        )

    def _latest_state(self, events: list[WorkerEvent]) -> TrainingState | None:
        m = [e for e in events if e.kind == "metrics"]
        if not m:
            return None
        d = m[-1].data
        return TrainingState(
            epoch=d["epoch"],
            step=d["step"],
            samples_consumed=d["samples_consumed"],
            lr=d["lr"],
            freeze_boundary=self.layout.freeze_boundary if self.layout else 0,
            layout_version=self.layout.version if self.layout else 1,
        )

    def _apply(self, e: WorkerEvent) -> None:
        p, d = self.progress, e.data
        if e.kind == "metrics":
            p.step, p.epoch = d["step"], d["epoch"]
            p.loss, p.samples_per_s = d["loss"], d["samples_per_s"]
        elif e.kind == "started":
            p.workers_started += 1
            p.total_steps = d.get("total_steps", p.total_steps)
            self.store.add_event(
                self.job_id, "worker_started", f"rank {e.rank} started", rank=e.rank, data=d
            )
        elif e.kind == "eval":
            p.accuracy = d["accuracy"]
            self.store.add_evaluation(
                self.job_id, d["epoch"], d["step"], d["accuracy"], d["loss"], e.time
            )
        elif e.kind == "checkpoint":
            self._commit_checkpoint(e)
        elif e.kind == "layout":
            self._adopt_layout(Layout.model_validate(d["layout"]), d["reason"], d.get("seconds"))
        elif e.kind == "freeze":
            self._record_freeze(d)
        elif e.kind in ("done", "stopped"):
            p.outcome = d.get("outcome", e.kind)
        elif e.kind == "failed":
            p.outcome, p.error = "failed", d.get("error", "worker failed")
            self.store.add_event(self.job_id, "worker_failed", p.error, rank=e.rank, data=d)

    def _adopt_layout(self, layout: Layout, reason: str, seconds: float | None) -> None:
        """Workers planned a layout from measurement: record it and make it the current one, so
        a resumed generation starts with it instead of planning again."""
        self.store.record_layout(self.job_id, layout, reason=reason)
        self.etcd.put(keys.layout(self.job_id), layout.model_dump_json())
        self.layout = self.progress.layout = layout  # later progress updates carry its F
        took = f" (measured and planned in {seconds:.1f}s)" if seconds is not None else ""
        self.store.add_event(
            self.job_id,
            "layout_planned",
            f"layout v{layout.version}: {reason}{took}",
            data={"layout": layout.describe()},
        )

    def _record_freeze(self, d: dict) -> None:
        """A decision point moved the boundary or answered a manual request: audit it, and
        retire the request so it is not applied twice."""
        request = d.get("request")
        if request is not None:
            outcome = "freeze_rejected" if d.get("rejected") else "freeze_applied"
            why = d.get("rejected") or f"boundary {d['previous']} -> {d['boundary']}"
            self.store.add_event(
                self.job_id,
                outcome,
                f"request {request['id']} by {request['who']} (layers={request['layers']}): {why}",
                data={"request": request, "step": d["step"]},
            )
            self.etcd.delete(keys.freeze_override(self.job_id))
        if d["boundary"] != d["previous"]:
            self.store.add_event(
                self.job_id,
                "freeze",
                f"{d['source']}: blocks {d['previous']}..{d['boundary'] - 1} frozen at step "
                f"{d['step']} ({d['reason']})",
                data=d,
            )

    def _commit_checkpoint(self, e: WorkerEvent) -> None:
        d = e.data
        state = TrainingState.model_validate(d["state"])
        try:
            size = verify_checkpoint(d["path"], d["checksum"])
        except CheckpointError as exc:
            self.store.add_event(self.job_id, "checkpoint_rejected", str(exc), rank=e.rank)
            return
        self.store.commit_checkpoint(
            self.job_id,
            step=state.step,
            epoch=state.epoch,
            layout_version=d["layout_version"],
            path=d["path"],
            size_bytes=size,
            checksum=d["checksum"],
            samples_consumed=state.samples_consumed,
        )
        self.store.update_progress(self.job_id, self._current(state))
        self.store.add_event(
            self.job_id,
            "checkpoint_committed",
            f"step {state.step} ({size / 1e6:.1f} MB, {d.get('seconds', 0):.2f}s)",
            data={"path": d["path"], "step": state.step},
        )
        self._retain()

    def _retain(self) -> None:
        """Keep the newest `checkpoint.keep` committed checkpoints; delete older ones."""
        committed = self.store.checkpoints(self.job_id)
        for old in committed[self.spec.checkpoint.keep :]:
            shutil.rmtree(old.path, ignore_errors=True)
            self.store.set_checkpoint_state(old.id, "deleted")

    # -- supervision ---------------------------------------------------------------------------

    def supervise(
        self,
        poll_exit: Callable[[], int | None],
        on_tick: Callable[[Progress], None] | None = None,
        interval: float = 0.25,
    ) -> int | None:
        """Drain events until the worker launcher exits (poll_exit returns its code)."""
        while True:
            code = poll_exit()
            self.drain()
            if on_tick:
                on_tick(self.progress)
            if code is not None:
                return code
            time.sleep(interval)

    def workers_alive(self) -> int:
        return self.etcd.count_prefix(keys.workers(self.job_id))
