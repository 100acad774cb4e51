"""The job controller: the single writer of the SQL store for a job.

It publishes what the workers need in etcd, answers each rendezvous round's join request with a
generation (a layout planned for the workers that joined, and the last committed checkpoint to
resume from), drains the events workers put in etcd into the store, commits checkpoints only after
verifying them on disk, applies retention, watches the workers' leases and aborts a generation
that lost one, and turns the end of the job into a job state. It holds a lease on the job's
controller key, so two controllers never drive the same job; a restarted controller picks up the
running generation from etcd and the store (`attach`).

Generations: every torchrun rendezvous round is one generation. Its rank 0 files a JoinRequest;
the controller ends the previous generation (aborted), plans for the new world and publishes the
Assignment. A lost worker (lease gone without a final report) gets the generation aborted: the
survivors watch `keys.abort` and leave their collectives at once, their agents re-rendezvous, and
the next round's join request starts the next generation.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.exc import OperationalError

from orchestrator import keys
from orchestrator.etcd_client import EtcdClient, EtcdUnavailable, KeepAlive
from orchestrator.manifest import CheckpointError, read_meta, verify_checkpoint
from orchestrator.pretrained import resolve_init
from orchestrator.spec import JobSpec
from orchestrator.state import Assignment, JoinRequest, Layout, TrainingState, WorkerEvent
from orchestrator.store import CheckpointInfo, Store, StoreUnavailable

# the pure planner: the one trainer import allowed here
from trainer.partition import PlanError, plan_for_world, plan_layout

log = logging.getLogger("pipetransformer.controller")

TERMINAL = ("completed", "failed", "interrupted")


class ControllerError(RuntimeError):
    pass


# Job ids name directories, etcd keys and Kubernetes objects: DNS-label characters only.
_JOB_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def new_job_id(spec: JobSpec) -> str:
    return f"{spec.name}-{uuid.uuid4().hex[:6]}"


def check_job_id(job_id: str) -> str:
    """A user-chosen job id, or ControllerError naming `--job-id` and what is allowed."""
    if not _JOB_ID_RE.match(job_id):
        raise ControllerError(
            f"--job-id {job_id!r} must be 1-63 lowercase letters, digits or '-', starting and "
            "ending with a letter or digit (it names directories, etcd keys and Kubernetes objects)"
        )
    return job_id


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
    waiting: str | None = None  # no layout fits the workers that joined: why


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
        self.assignment: Assignment | None = None  # the generation in force (None between them)
        self._answered: str | None = None  # id of the last join request answered
        self._seen: set[int] = set()  # ranks of this generation whose lease was seen
        self._nodes: list[str] = []  # node of each rank of the previous generation
        self.aborted_at: float | None = None  # wall time of the last abort (for recovery timing)
        self._open: int | None = None  # generation this controller opened in the store, until ended
        self._outage: float | None = None  # since when etcd or the store has not answered
        self._report: str | None = None  # etcd key of the worker report being applied
        self._leaving: int | None = None  # generation whose workers leave gracefully

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
        """Record a new job (pending) with its initial layout. A fine-tuning spec's checkpoint is
        checked and pinned first (SpecError, nothing stored, if it cannot be used)."""
        spec = resolve_init(spec)
        job_id = job_id or new_job_id(spec)
        store.create_job(job_id, spec, str(Path(workdir).resolve()))
        store.record_layout(job_id, plan_layout(spec), reason="initial")
        init = spec.init
        source = f", initialised from {init.checkpoint}" if init.checkpoint else ""
        store.add_event(
            job_id,
            "job_created",
            f"job {job_id} created from spec {spec.name!r}{source}",
            data={"init": init.model_dump()} if init.checkpoint else None,
        )
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
        skipped (the previous committed one is used). The freeze boundary is the checkpoint's
        own: falling back to an older one takes its boundary back too (the steps after it are
        trained again, and the freeze policy decides again)."""
        for ckpt in self.store.checkpoints(self.job_id):
            try:
                verify_checkpoint(ckpt.path, ckpt.checksum)
                meta = read_meta(ckpt.path)  # covered by the manifest just verified
            except (CheckpointError, ValueError) as exc:
                self.store.set_checkpoint_state(ckpt.id, "corrupt")
                self.store.add_event(self.job_id, "checkpoint_corrupt", str(exc))
                continue
            frozen = (meta.get("freeze") or {}).get("boundary", self.job.freeze_boundary)
            state = TrainingState(
                epoch=ckpt.epoch,
                step=ckpt.step,
                samples_consumed=ckpt.samples_consumed,
                lr=self.job.lr,
                freeze_boundary=frozen,
                layout_version=ckpt.layout_version,
                checkpoint=ckpt.path,
            )
            return state, ckpt
        return TrainingState(), None

    def publish(self, rdzv_id: str) -> None:
        """Prepare etcd for a launch of workers: the spec, the layout in force, the control key,
        and the rendezvous id the agents meet at. Stale keys of an earlier launch (a join
        request, an assignment, an abort, queued events) are cleared: they belong to dead
        processes."""
        for key in (keys.join(self.job_id), keys.assignment(self.job_id), keys.abort(self.job_id)):
            self.etcd.delete(key)
        self.drain()  # reports a dead launch left behind still count (idempotent)
        self.etcd.delete_prefix(keys.events(self.job_id))
        self.layout = self.layout or plan_layout(self.spec)
        self.etcd.put(keys.spec(self.job_id), self.spec.to_json())
        self.etcd.put(keys.layout(self.job_id), self.layout.model_dump_json())
        self.etcd.put(keys.control(self.job_id), "run")
        self.etcd.put(keys.launch(self.job_id), json.dumps({"rdzv_id": rdzv_id}))
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.store.set_job_state(self.job_id, "running", "waiting for workers to join")

    def attach(self) -> bool:
        """A restarted controller: adopt the generation running in etcd if the store agrees it
        is running, so workers carry on undisturbed. Returns whether there was one."""
        raw = self.etcd.get(keys.assignment(self.job_id))
        if raw is None or self.etcd.get(keys.launch(self.job_id)) is None:
            return False
        a = Assignment.model_validate_json(raw)
        running = [g for g in self.store.generations(self.job_id) if g["state"] == "running"]
        if not running or running[-1]["number"] != a.generation:
            return False
        self.assignment, self.generation, self._answered = a, a.generation, a.request
        self._open = a.generation  # the store says it is running (checked above)
        self.layout = a.layout or self.layout
        job = self.store.get_job(self.job_id)
        self.progress = Progress(step=job.step, epoch=job.epoch, layout=self.layout)
        self.progress.waiting = a.waiting
        self.store.add_event(
            self.job_id,
            "controller_attached",
            f"controller (pid {os.getpid()}) took over generation {a.generation} at step "
            f"{job.step}",
        )
        return True

    def answer_join(self) -> Assignment | None:
        """Answer a new rendezvous round's join request with the next generation (None if there
        is no new request)."""
        raw = self.etcd.get(keys.join(self.job_id))
        if raw is None:
            return None
        request = JoinRequest.model_validate_json(raw)
        if request.id == self._answered:
            return None
        return self.start_generation(request)

    def start_generation(self, request: JoinRequest) -> Assignment:
        """End the generation in force (aborted: its workers re-formed), plan a layout for the
        workers that joined, and publish their assignment: resume from the last committed
        checkpoint. If no layout fits, the assignment says why and the workers wait."""
        self.drain()  # commit what the previous generation reported first
        previous = self.assignment
        if previous is not None and self._generation_running():
            # re-formed before its lease loss was seen (the agents noticed first)
            self.store.end_generation(self.job_id, previous.generation, "aborted")
            self._open = None
            self.aborted_at = time.time()
        world = request.world
        start, ckpt = self.resume_point()
        frozen = start.freeze_boundary
        layout, waiting = self.layout, None
        if layout is None or layout.world_size != world or layout.freeze_boundary != frozen:
            try:
                layout = plan_for_world(self.spec, world, frozen, self.layout)
            except PlanError as exc:
                waiting = f"waiting for capacity: {exc}"
            else:
                why = f"re-formed for {world} worker(s)"
                if self.layout is not None and self.layout.freeze_boundary != frozen:
                    why += f" at the resumed checkpoint's freeze boundary {frozen}"
                self.store.record_layout(self.job_id, layout, reason=why)
                self.etcd.put(keys.layout(self.job_id), layout.model_dump_json())
                self.layout = layout
        self.generation = self._open = self.store.start_generation(self.job_id, world)
        assignment = Assignment(
            generation=self.generation,
            checkpoint_dir=str(self.checkpoint_dir),
            start=start,
            resume_checksum=ckpt.checksum if ckpt else None,
            request=request.id,
            layout=None if waiting else layout,
            waiting=waiting,
        )
        self._record_membership(request)
        self.etcd.put(keys.control(self.job_id), "run")
        self.etcd.put(keys.assignment(self.job_id), assignment.model_dump_json())
        self.assignment, self._answered, self._seen = assignment, request.id, set()
        how = f"from checkpoint at step {start.step}" if ckpt else "from scratch"
        if waiting:
            self.store.set_job_state(self.job_id, "running", waiting)
            self.store.add_event(self.job_id, "waiting_for_capacity", waiting)
        else:
            self.store.set_job_state(self.job_id, "running")
            self.store.add_event(
                self.job_id,
                "generation_started",
                f"generation {self.generation} with {world} workers, {how}",
                data={"layout": layout.describe(), "start": start.model_dump(), "world": world},
            )
        self.progress = Progress(step=start.step, epoch=start.epoch, layout=layout)
        self.progress.waiting = waiting
        return assignment

    def _record_membership(self, request: JoinRequest) -> None:
        """Nodes joined or left between generations: one worker event per node, and whether
        the job widened or shrank."""
        before, after = self._nodes, request.nodes
        if before:
            for node in sorted(set(after) - set(before)):
                self.store.add_event(
                    self.job_id,
                    "worker_joined",
                    f"node {node} joined with {after.count(node)} worker(s)",
                    data={"node": node},
                )
            for node in sorted(set(before) - set(after)):
                self.store.add_event(
                    self.job_id, "worker_left", f"node {node} left the job", data={"node": node}
                )
            if len(after) != len(before):
                verb = "widened" if len(after) > len(before) else "shrank"
                self.store.add_event(
                    self.job_id,
                    f"job_{verb}",
                    f"job {verb} from {len(before)} to {len(after)} workers",
                    data={"before": len(before), "after": len(after)},
                )
        self._nodes = list(after)

    def _generation_running(self) -> bool:
        """Whether this controller's generation is still open (running) in the store. The
        controller is the store's single writer, so it knows without asking the store, which
        matters because the lease watch calls this every tick."""
        return self._open is not None

    def check_workers(self) -> list[int]:
        """Abort the generation if a worker that registered has lost its lease (it died, hung
        or was cut off) without the generation having reported its end. Returns lost ranks."""
        a = self.assignment
        if a is None or a.waiting or self.progress.outcome or self._leaving == a.generation:
            return []  # nothing to watch, or its workers are leaving on purpose (SIGTERM)
        if not self._generation_running():
            return []
        alive = set()
        for key, value in self.etcd.get_prefix(keys.workers(self.job_id)):
            try:
                if json.loads(value).get("generation") == a.generation:
                    alive.add(int(key.rsplit("/", 1)[1]))
            except (ValueError, AttributeError):
                continue
        self._seen |= alive
        lost = sorted(self._seen - alive)
        if not lost:
            return []
        self.drain()  # a final report (done, stopped, leaving) may have raced the leases
        if self.progress.outcome or self._leaving == a.generation:
            return []
        self.abort(f"lost rank(s) {', '.join(map(str, lost))}: lease expired or worker exited")
        return lost

    def abort(self, reason: str) -> None:
        """Mark the generation in force aborted in etcd (its workers exit at once, their agents
        re-rendezvous) and in the store."""
        if self.assignment is None:
            return
        gen = self.assignment.generation
        self.aborted_at = time.time()
        self.etcd.put(keys.abort(self.job_id), str(gen))
        if self._generation_running():
            self.store.end_generation(self.job_id, gen, "aborted")
            self._open = None
        self.store.add_event(
            self.job_id, "generation_aborted", f"generation {gen} aborted: {reason}"
        )

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
        if self._generation_running():
            self.store.end_generation(self.job_id, self.generation, state)
            self._open = None
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
        for (key, _), e in zip(items, events, strict=True):
            self._report = key  # store events derived from a report are keyed by it: replay-safe
            try:
                self._apply(e)
            finally:
                self._report = None
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
            key=f"freeze-request:{request['id']}",  # audited once, across controller restarts
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

    def _record_event(self, kind: str, message: str, **kw: Any) -> None:
        """An event derived from the worker report being applied: keyed by the report's etcd key
        (and kind), so a controller that crashed before deleting the report does not record it
        twice when it drains it again."""
        key = f"{self._report}:{kind}" if self._report else None
        self.store.add_event(self.job_id, kind, message, key=key, **kw)

    def _apply(self, e: WorkerEvent) -> None:
        p, d = self.progress, e.data
        if e.kind == "metrics":
            p.step, p.epoch = d["step"], d["epoch"]
            p.loss, p.samples_per_s = d["loss"], d["samples_per_s"]
        elif e.kind == "started":
            p.workers_started += 1
            p.total_steps = d.get("total_steps", p.total_steps)
            self._record_event("worker_started", f"rank {e.rank} started", rank=e.rank, data=d)
        elif e.kind == "eval":
            p.accuracy = d["accuracy"]
            self.store.add_evaluation(
                self.job_id, d["epoch"], d["step"], d["accuracy"], d["loss"], e.time
            )
        elif e.kind == "checkpoint":
            self._commit_checkpoint(e)
        elif e.kind == "checkpoint_failed":  # nothing committed: the previous one still holds
            self._record_event(
                "checkpoint_failed",
                f"checkpoint at step {d['step']} was not committed: {d['error']}",
                rank=e.rank,
                data=d,
            )
        elif e.kind == "layout":
            self._adopt_layout(Layout.model_validate(d["layout"]), d["reason"], d.get("seconds"))
        elif e.kind == "freeze":
            self._record_freeze(d)
        elif e.kind in ("done", "stopped"):
            p.outcome = d.get("outcome", e.kind)
        elif e.kind == "failed":  # the agents restart the workers; the job fails when they stop
            p.error = d.get("error", "worker failed")
            self._record_event("worker_failed", p.error, rank=e.rank, data=d)
        elif e.kind == "first_step":
            since = (
                f", {d['time'] - self.aborted_at:.1f}s after the abort" if self.aborted_at else ""
            )
            self._record_event(
                "generation_resumed",
                f"generation {e.generation} completed its first step ({d['step']}){since}",
                data=d | {"generation": e.generation, "aborted_at": self.aborted_at},
            )
            self.aborted_at = None
        elif e.kind == "leaving":
            self._leaving = e.generation  # its leases go next: a re-formation, not a loss
            self._record_event(
                "worker_leaving",
                f"rank(s) {d['ranks']} asked to leave (SIGTERM); checkpointed at step {d['step']}",
                data=d,
            )

    def _adopt_layout(self, layout: Layout, reason: str, seconds: float | None) -> None:
        """Workers planned a layout from measurement: record it and make it the current one, so
        a resumed generation starts with it instead of planning again."""
        self.store.record_layout(self.job_id, layout, reason=reason)
        self.etcd.put(keys.layout(self.job_id), layout.model_dump_json())
        self.layout = self.progress.layout = layout  # later progress updates carry its F
        took = f" (measured and planned in {seconds:.1f}s)" if seconds is not None else ""
        self._record_event(
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
            self._record_event(
                outcome,
                f"request {request['id']} by {request['who']} (layers={request['layers']}): {why}",
                data={"request": request, "step": d["step"]},
            )
            self.etcd.delete(keys.freeze_override(self.job_id))
        if d["boundary"] != d["previous"]:
            self._record_event(
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
            self._record_event("checkpoint_rejected", str(exc), rank=e.rank)
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
        if state.step >= self.progress.step:  # an async commit lands after later metrics
            self.store.update_progress(self.job_id, self._current(state))
        self._record_event(
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
        interval: float = 0.1,
    ) -> int | None:
        """Until the worker launchers exit (poll_exit returns their code): drain events, answer
        join requests, watch leases."""
        while True:
            code = poll_exit()
            self.tick()
            if on_tick:
                on_tick(self.progress)
            if code is not None:
                self.drain()
                return code
            time.sleep(interval)

    def tick(self) -> None:
        """One round of supervision. Store or etcd trouble is ridden out (the work stays queued
        in etcd) and reported once it clears."""
        try:
            self.drain()
            self.answer_join()
            self.check_workers()
        except (EtcdUnavailable, StoreUnavailable, OperationalError) as exc:
            if self._outage is None:
                self._outage = time.monotonic()
                log.warning("controller: %s unavailable, retrying: %s", _which(exc), exc)
            return
        if self._outage is not None:
            took = time.monotonic() - self._outage
            self._outage = None
            self.store.add_event(
                self.job_id,
                "control_plane_recovered",
                f"store/etcd answered again after {took:.1f}s",
            )
        for service, recoveries in (
            ("etcd", self.etcd.recoveries),
            ("store", self.store.recoveries),
        ):
            while recoveries:  # outages the client rode out inside one call
                op, took = recoveries.popleft()
                self.store.add_event(
                    self.job_id,
                    "control_plane_recovered",
                    f"{service} answered again after {took:.1f}s (during {op})",
                    data={"service": service, "seconds": took},
                )

    def workers_alive(self) -> int:
        return self.etcd.count_prefix(keys.workers(self.job_id))


def _which(exc: BaseException) -> str:
    return "etcd" if isinstance(exc, EtcdUnavailable) else "store"
