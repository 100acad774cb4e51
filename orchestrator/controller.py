"""The job controller: the single writer of the SQL store for a job.

It publishes what the workers need in etcd, answers each rendezvous round's join request with a
generation (a layout planned for the workers that joined, and the last committed checkpoint to
resume from), drains the events workers put in etcd into the store, commits checkpoints only after
verifying them on disk, applies retention, watches the workers' leases and aborts a generation
that lost one, and turns the end of the job into a job state. It holds a lease on the job's
controller key, so two controllers never drive the same job; a restarted controller picks up the
running generation from etcd and the store (`attach`).

Its life is `Controller.run`: acquire the lease, attach or publish, launch, supervise, finish,
release; callers say how the workers are launched (`Workers`), never in which order these go.

Generations: every torchrun rendezvous round is one generation (orchestrator/generations.py holds
what the controller knows of each). Its rank 0 files a JoinRequest; the controller ends the
previous generation (aborted), plans for the new world and publishes the Assignment. A lost
worker (lease gone without a final report) gets the generation aborted: the survivors watch
`keys.abort` and leave their collectives at once, their agents re-rendezvous, and the next
round's join request starts the next generation.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from pydantic import ValidationError
from sqlalchemy.exc import OperationalError

from pipetransformer.core import keys
from pipetransformer.core.planner import PlanError, plan_layout
from pipetransformer.core.postmortem import PostMortem, describe_status
from pipetransformer.core.protocol import (
    Aborted,
    Assignment,
    BadReport,
    CacheDecided,
    CheckpointFailed,
    CheckpointWritten,
    Control,
    DataOpened,
    Evaluated,
    Failed,
    Finished,
    FirstStep,
    FreezeDecided,
    FreezeOutcome,
    FreezeRequest,
    JoinRequest,
    LayoutPlanned,
    Leaving,
    Left,
    Metrics,
    PeerLost,
    RelayoutCost,
    RendezvousRefused,
    StageTimes,
    Started,
    StepTrace,
    TrainerRefused,
    UnreadableRequest,
    WorkerEvent,
    WorkerExit,
    first_error,
    freeze_request_id,
    parse_event,
    read_freeze_request,
)
from pipetransformer.core.provenance import DATA_OPENED, data_text
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout, TrainingState
from pipetransformer.edge.etcd_client import EtcdClient, EtcdUnavailable, KeepAlive
from pipetransformer.edge.manifest import (
    CheckpointError,
    meta_boundary,
    read_meta,
    verify_checkpoint,
)
from pipetransformer.orchestrator.generations import Generation, Generations
from pipetransformer.orchestrator.roster import Roster
from pipetransformer.orchestrator.sources import resolve_submission
from pipetransformer.store import CheckpointInfo, Store, StoreUnavailable

log = logging.getLogger("pipetransformer.controller")


class ControllerError(RuntimeError):
    pass


# How often the controller looks for rendezvous states an agent refused (`_drain_alerts`).
ALERT_POLL_S = 1.0


class HandedOver(Exception):  # noqa: N818 (an outcome, not an error)
    """`run` left the job running on request (`Controller.leave`: a controller pod's stop), its
    lease revoked, for the next controller to take over."""


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


def controller_holder(etcd: EtcdClient, job_id: str) -> str | None:
    """Who controls the job now, as a person reads it ("pid 812 on node-a"): the holder of its
    controller lease, unless that is a dead process on this host (whose lease `acquire` takes
    over at once). None when nobody does."""
    holder = etcd.get(keys.controller(job_id))
    if holder is None or _is_dead_local_process(holder):
        return None
    try:
        who = json.loads(holder)
        return f"pid {int(who['pid'])} on {who['host']}"
    except (ValueError, KeyError, TypeError):
        return holder


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
    mfu: float | None = None  # the latest step's model FLOPs utilisation (a fraction)
    # the latest per-rank peak GPU memory (MiB, index = rank): kept until the next one, since
    # only steps at control points carry it
    peak_memory_mib: list[float | None] | None = None
    accuracy: float | None = None  # question answering: exact match
    f1: float | None = None  # question answering
    outcome: str | None = None  # done / stopped / failed, from the workers
    error: str | None = None
    layout: Layout | None = None
    waiting: str | None = None  # no layout fits the workers that joined: why


class ResumePoint(NamedTuple):
    """Where the next generation starts: the state, the checkpoint it loads (None: from
    scratch) and the freeze boundary that checkpoint continues with."""

    state: TrainingState
    checkpoint: CheckpointInfo | None
    boundary: int


class Workers(Protocol):
    """The workers a controller supervises, as whoever runs it launched them: local torchrun
    agents (`pipetransformer run`), trainer pods seen through etcd (the controller role), or
    simulated agents (the benchmarks)."""

    def poll(self) -> int | None:
        """None while they run; then their launchers' exit code."""

    def detail(self, code: int | None) -> str:
        """What the job's message should add when they ended with `code` ("" for nothing)."""

    def close(self) -> None:
        """After the job's end is recorded (or on an error): release what the launch holds."""


class Controller:
    """The job's controller. `run` is its whole life; the steps it takes are public for the
    tests and the benchmarks that drive them one at a time."""

    def __init__(self, store: Store, etcd: EtcdClient, job_id: str):
        self.store, self.etcd, self.job_id = store, etcd, job_id
        self.job = store.get_job(job_id)
        self.spec: JobSpec = self.job.spec
        self.layout: Layout | None = store.current_layout(job_id)
        self.progress = Progress()
        self.roster = Roster(store, job_id)  # the store's `workers` rows
        # the newest generation answered (None before the first), and every generation this
        # controller knows of by number: ended ones are still explained, and late reports of
        # their ranks still land in their post-mortems
        self.generations = Generations(
            store, roster=self.roster, job_id=job_id, explain_s=self.spec.runtime.lease_ttl_s + 3
        )
        self.aborted_at: float | None = None  # wall time of the last abort (for recovery timing)
        self._keepalive: KeepAlive | None = None
        self._audited: set[str] = set()  # freeze requests and join requests already recorded
        self._decided: set[str] = set()  # freeze requests whose fate is recorded (the first)
        self._outage: float | None = None  # since when etcd or the store has not answered
        self._report: str | None = None  # etcd key of the worker report being applied
        self._leaving = False  # `leave` was asked: hand the job over at the next safe point
        self._alerts_looked = -math.inf  # monotonic time of the last look for refused states
        # trainer pods' refusals to run the job where they landed (keys.refusal): past this
        # many the job fails (a controller role sets it to its restart budget; None: never)
        self.refusal_budget: int | None = None
        self._refusals = 0
        # called with the reports of each drain, once they are stored (TensorBoard's writer)
        self.observers: list[Callable[[list[WorkerEvent]], None]] = []

    @property
    def current(self) -> Generation | None:
        """The newest generation answered (None before the first)."""
        return self.generations.current

    @property
    def generation(self) -> int:
        """The newest generation's number (0 before the first)."""
        return self.current.number if self.current else 0

    @property
    def assignment(self) -> Assignment | None:
        """What the newest generation was assigned (None before the first)."""
        return self.current.assignment if self.current else None

    # -- lifecycle --------------------------------------------------------------------------

    def run(
        self,
        rdzv_id: str,
        launch: Callable[[bool], Workers],
        on_tick: Callable[[Progress], None] | None = None,
        attach: bool = False,
        interval: float = 0.1,
    ) -> str:
        """The controller's life, in its one order: take the job's lease; adopt the generation
        running in etcd (`attach`, when allowed: a restarted controller) or publish the job for
        a new launch at `rdzv_id`; `launch(attached)` the workers; supervise them until their
        launchers exit; record the job's end; let the lease go. Returns the job's state."""
        self.acquire()
        try:
            attached = attach and self.attach()
            if not attached:
                self.publish(rdzv_id)
            workers = launch(attached)
            try:
                code = self.supervise(workers.poll, on_tick, interval)
                return self.finish(code, workers.detail(code))
            finally:
                workers.close()
        finally:
            self.release()

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
        checked and pinned first, and a pretrained model and data files located (SpecError,
        nothing stored, if one cannot be used)."""
        spec = resolve_submission(spec)
        job_id = job_id or new_job_id(spec)
        store.create_job(job_id, spec, str(Path(workdir).resolve()))
        initial = plan_layout(spec)
        store.record_layout(job_id, initial.layout, reason=initial.reason)
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

    def resume_point(self) -> ResumePoint:
        """The last committed checkpoint that is intact on disk; corrupt ones are marked and
        skipped (the previous committed one is used). The freeze boundary is the checkpoint's
        own (the layout its meta records), so falling back to an older checkpoint takes its
        boundary back too: the steps after it are trained again, and the policy decides again."""
        for ckpt in self.store.checkpoints(self.job_id):
            try:
                verify_checkpoint(ckpt.path, ckpt.checksum)
                meta = read_meta(ckpt.path)  # covered by the manifest just verified
            except (CheckpointError, ValueError) as exc:
                self.store.set_checkpoint_state(ckpt.id, "corrupt")
                self.store.add_event(self.job_id, "checkpoint_corrupt", str(exc))
                continue
            frozen = meta_boundary(meta)
            state = TrainingState(
                epoch=ckpt.epoch,
                step=ckpt.step,
                samples_consumed=ckpt.samples_consumed,
                lr=self.job.lr,
                layout_version=ckpt.layout_version,
                checkpoint=ckpt.path,
            )
            return ResumePoint(state, ckpt, self.job.freeze_boundary if frozen is None else frozen)
        return ResumePoint(TrainingState(), None, 0)

    def publish(self, rdzv_id: str) -> None:
        """Prepare etcd for a launch of workers: the spec, the layout in force, the control key,
        and the rendezvous id the agents meet at. Stale keys of an earlier launch (a join
        request, an assignment, an abort, queued events) are cleared: they belong to dead
        processes."""
        for key in (keys.join(self.job_id), keys.assignment(self.job_id), keys.abort(self.job_id)):
            self.etcd.delete(key)
        self.drain()  # reports a dead launch left behind still count (idempotent)
        self.etcd.delete_prefix(keys.events(self.job_id))
        self.etcd.delete_prefix(keys.exits(self.job_id))
        self.etcd.delete_prefix(keys.alerts(self.job_id))
        self.etcd.delete_prefix(keys.refusals(self.job_id))
        self.layout = self.layout or plan_layout(self.spec).layout
        self.etcd.put(keys.spec(self.job_id), self.spec.to_json())
        self.etcd.put(keys.layout(self.job_id), self.layout.model_dump_json())
        self.etcd.put(keys.control(self.job_id), Control.RUN)
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
        running = [g for g in self.store.generations(self.job_id) if g.state == "running"]
        if not running or running[-1].number != a.generation:
            return False
        raw_join = self.etcd.get(keys.join(self.job_id))
        joined = JoinRequest.model_validate_json(raw_join) if raw_join else None
        if joined is not None and joined.id == a.request:
            pm = PostMortem.of(a.generation, joined.world, joined.pids, joined.nodes)
        else:  # ranks known by number only
            pm = PostMortem(a.generation, {}, a.layout.world_size if a.layout else 0)
            joined = None
        # open: the store says it is running (checked above). Its nodes are left unknown, as
        # the predecessor's view of membership changes is not this controller's to repeat.
        self.generations.open(Generation.answered(a, pm, nodes=[]))
        # rows the previous controller did not get to write, then what it wrote
        self.roster.assign(a.generation, pm.world, joined)
        self.roster.load(a.generation)
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
        try:
            request = JoinRequest.model_validate_json(raw)
        except ValueError as exc:  # not from a worker of this version: say so once, wait
            self._reject_join(raw, exc)
            return None
        answered = self.current.request if self.current else None
        if request.id != answered:
            self.drain()  # the last generation's failures decide whether there is a next one
        if request.id == answered or (self.current and self.current.fatal):
            return None  # a fatal failure is answered by the assignment already published
        return self.start_generation(request)

    def start_generation(self, request: JoinRequest) -> Assignment:
        """End the generation in force (aborted: its workers re-formed), plan a layout for the
        workers that joined, and publish their assignment: resume from the last committed
        checkpoint. If no layout fits, the assignment says why and the workers wait."""
        self.drain()  # commit what the previous generation reported first
        previous = self.current
        if previous is not None and previous.open:
            # re-formed before its lease loss was seen (the agents noticed first)
            self.generations.end(previous, "aborted", "re-formed by the agents")
            self.aborted_at = time.time()
        world = request.world
        start, ckpt, frozen = self.resume_point()
        layout, waiting = self.layout, None
        if layout is None or layout.world_size != world or layout.freeze_boundary != frozen:
            try:
                planned = plan_layout(self.spec, world=world, boundary=frozen, current=self.layout)
                layout, why = planned.layout, planned.reason
            except PlanError as exc:
                waiting = f"waiting for capacity: {exc}"
            else:
                self.store.record_layout(self.job_id, layout, reason=why)
                self.etcd.put(keys.layout(self.job_id), layout.model_dump_json())
                self.layout = layout
        number = self.store.start_generation(self.job_id, world)
        pm = PostMortem.of(number, request.world, request.pids, request.nodes)
        self.roster.assign(number, request.world, request)
        assignment = Assignment(
            generation=number,
            checkpoint_dir=str(self.checkpoint_dir),
            start=start,
            resume_checksum=ckpt.checksum if ckpt else None,
            request=request.id,
            layout=None if waiting else layout,
            waiting=waiting,
        )
        self._record_membership(previous.nodes if previous else [], request.nodes)
        self.generations.open(Generation.answered(assignment, pm, request.nodes))
        self.etcd.put(keys.control(self.job_id), Control.RUN)
        self.etcd.put(keys.assignment(self.job_id), assignment.model_dump_json())
        how = f"from checkpoint at step {start.step}" if ckpt else "from scratch"
        if waiting:
            self.store.set_job_state(self.job_id, "running", waiting)
            self.store.add_event(self.job_id, "waiting_for_capacity", waiting)
        else:
            self.store.set_job_state(self.job_id, "running")
            self.store.add_event(
                self.job_id,
                "generation_started",
                f"generation {number} with {world} workers, {how}",
                data={"layout": layout.describe(), "start": start.model_dump(), "world": world},
            )
        self.progress = Progress(step=start.step, epoch=start.epoch, layout=layout)
        self.progress.waiting = waiting
        return assignment

    def _record_membership(self, before: list[str], after: list[str]) -> None:
        """Nodes joined or left between generations: one worker event per node, and whether
        the job widened or shrank."""
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

    def _presence(self) -> dict[int, int | None]:
        """rank -> the generation its presence key (on its lease) holds now."""
        held: dict[int, int | None] = {}
        for key, value in self.etcd.get_prefix(keys.workers(self.job_id)):
            try:
                held[int(key.rsplit("/", 1)[1])] = json.loads(value).get("generation")
            except (ValueError, AttributeError):
                continue
        return held

    def check_workers(self) -> list[int]:
        """Abort the generation if a worker is gone without the generation having reported its
        end: it failed, lost a peer, was reaped dead by its fork server, or its lease lapsed
        (it died, hung or was cut off). Returns the ranks gone."""
        gen = self.current
        # nothing to watch, or its workers are leaving on purpose (SIGTERM). Whether it is still
        # open needs no store read: the controller is the store's single writer, which matters
        # because this runs every tick.
        if gen is None or not gen.watched or self.progress.outcome:
            return []
        alive = {r for r, g in self._presence().items() if g == gen.number}
        gen.seen |= alive
        self.roster.leases_held(gen.number, alive)
        pm = gen.postmortem
        ended = {r for r, e in pm.ends.items() if e.kind != "left"}
        gone = sorted((gen.seen - alive) | ended)
        if not gone:
            return []
        self.drain()  # a final report (done, stopped, leaving) may have raced the leases
        if self.progress.outcome or gen.leaving:
            return []
        for rank in sorted(gen.seen - alive):
            self.generations.vanished(pm, rank)
        self.abort(pm.summary())
        return gone

    def abort(self, reason: str) -> None:
        """Mark the generation in force aborted in etcd (its workers exit at once, their agents
        re-rendezvous) and in the store, saying why."""
        current = self.current
        if current is None:
            return
        gen = current.number
        self.aborted_at = time.time()
        self.etcd.put(keys.abort(self.job_id), str(gen))
        if current.open:
            self.generations.end(current, "aborted", reason)
        self.store.add_event(
            self.job_id,
            "generation_aborted",
            f"generation {gen} aborted: {reason}",
            data={"generation": gen, "reason": reason},
        )

    # -- post-mortems: which rank died and how (recorded by Generations) -----------------------

    def _follow_up(self) -> None:
        """Keep explaining ended generations (orchestrator/generations.py)."""
        if not self.generations.explaining():
            return
        held = self._presence()
        self.drain()  # after reading the keys: a report put before a lease was revoked counts
        self.generations.follow_up(held)

    def _apply_exit(self, report: WorkerExit) -> None:
        """How a worker process ended, from its fork server: into its generation's post-mortem,
        else an event (it died before its generation was formed: no rank to blame in one)."""
        if self.generations.exited(report):
            return
        rank = f"rank {report.rank} " if report.rank is not None else ""
        self.store.add_event(
            self.job_id,
            "worker_died",
            f"worker {rank}(pid {report.pid} on {report.host}) "
            f"{describe_status(report.exit_code, report.signal)} before joining a generation",
            rank=report.rank,
            data=report.model_dump(),
            key=f"exit:{report.host}:{report.pid}",
        )

    def _check_fatal(self, gen: Generation) -> None:
        """Every rank of the generation failed while starting, with the same error: a restart
        would fail the same way (a bad spec, a missing file), so the job fails now instead of
        burning runtime.max_restarts. The next rendezvous round's workers see the fatal
        assignment and exit 0, so their agents stop."""
        a = gen.assignment
        if gen is not self.current or a is None or gen.fatal:
            return
        error = gen.postmortem.deterministic_failure()
        if error is None:
            return
        gen.fatal = error
        message = f"every rank failed the same way while starting: {error}"
        # failed, whether or not the first failure reports already got it aborted
        self.store.end_generation(self.job_id, gen.number, "failed", reason=message)
        gen.open, gen.reason, gen.explain_until = False, message, None
        fatal = a.model_copy(update={"fatal": message, "layout": None})
        self.etcd.put(keys.assignment(self.job_id), fatal.model_dump_json())
        self.progress.outcome, self.progress.error = "failed", message
        self.store.add_event(
            self.job_id,
            "job_failed_at_start",
            f"{message}; not restarting (runtime.max_restarts is for failures a restart can fix)",
            data={"generation": gen.number, "error": error},
        )

    def request_stop(self, reason: str) -> None:
        """Ask workers to checkpoint and leave at their next control point."""
        self.etcd.put(keys.control(self.job_id), Control.STOP)
        self.store.add_event(self.job_id, "stop_requested", reason)

    def finish(self, exit_code: int | None, detail: str = "") -> str:
        """Turn the generation's end into a job state; returns it."""
        self.drain()
        p = self.progress
        if p.outcome in ("done", "target"):
            state, message = "completed", f"completed at step {p.step}"
        elif p.outcome == "stopped":
            state, message = "interrupted", f"stopped at step {p.step}; resume to continue"
        elif p.outcome == "failed":  # deterministic: a restart would fail the same way
            state = "failed"
            message = f"{p.error}; not restarted: fix the cause, then resume"
        else:
            why = p.error or (
                f"workers exited with code {exit_code}" if exit_code else "workers exited"
            )
            state = "failed" if p.error else "interrupted"
            message = f"{why}; resume continues from the last committed checkpoint"
            if detail:
                message += f"\n{detail}"
        if self.current is not None and self.current.open:
            self.store.end_generation(self.job_id, self.current.number, state)
            self.current.open = False
        self.store.set_job_state(self.job_id, state, message.splitlines()[0])
        # the outcome tells a restarted controller pod a user's stop from workers gone
        self.store.add_event(self.job_id, f"job_{state}", message, data={"outcome": p.outcome})
        return state

    # -- events -------------------------------------------------------------------------------

    def drain(self) -> list[WorkerEvent]:
        """Move every queued worker event into the store, then delete it from etcd. Store writes
        are idempotent, so a crash between the two only replays events."""
        self._audit_new_request()
        items = self.etcd.get_prefix(keys.events(self.job_id))
        self._drain_exits()
        self._drain_alerts()
        if not items:
            return []
        parsed: list[tuple[str, WorkerEvent]] = []
        for key, value in items:
            try:
                parsed.append((key, parse_event(value)))
            except BadReport as exc:
                self._reject_report(key, value, str(exc))
        events = [e for _, e in parsed]
        metrics = [e for e in events if isinstance(e, Metrics)]
        if metrics:
            self.store.add_metrics(self.job_id, metrics)
        times = [e for e in events if isinstance(e, StageTimes)]
        if times:  # one row per rank and interval, in one transaction (like the metrics)
            self.store.add_stage_times(self.job_id, times)
        traces = [e for e in events if isinstance(e, StepTrace)]
        if traces:
            self.store.add_step_traces(self.job_id, traces)
        self.roster.reported(events)  # last_report_at, one statement
        for key, e in parsed:
            self._report = key  # store events derived from a report are keyed by it: replay-safe
            try:
                self._apply(e)
            finally:
                self._report = None
        last = self._latest_state(events)
        if last is not None:
            self.store.update_progress(self.job_id, self._current(last))
        # one request per batch of keys, not per report: at hundreds of workers the deletes
        # were most of a drain (bench/control_plane_scale.py)
        self.etcd.delete_many([key for key, _ in items])
        for observe in self.observers:
            try:
                observe(events)
            except Exception as exc:  # an observer's trouble never stops the job's supervision
                log.warning("controller: an observer of the reports failed: %s", exc)
        return events

    def _reject_report(self, key: str, raw: str, error: str) -> None:
        """A queued report that is not a WorkerEvent (a worker of another version, or a hand-made
        key): said once in the log and the store, then dropped with the drained reports."""
        log.warning("controller: rejecting the malformed worker report under %s: %s", key, error)
        self.store.add_event(
            self.job_id,
            "worker_report_rejected",
            f"a worker report under {key} is not a valid event ({error}); ignored",
            data={"key": key, "error": error, "raw": raw[:200]},
            key=f"{key}:rejected",
        )

    def _reject_join(self, raw: str, exc: ValueError) -> None:
        error = first_error(exc) if isinstance(exc, ValidationError) else str(exc)
        if raw in self._audited:
            return
        self._audited.add(raw)
        log.warning("controller: ignoring a malformed join request: %s", error)
        self.store.add_event(
            self.job_id,
            "join_request_rejected",
            f"the join request in etcd is not a JoinRequest ({error}); ignored",
            data={"error": error, "raw": raw[:200]},
        )

    def _drain_exits(self) -> None:
        """Exit statuses the fork servers reaped (keys.exit_report): into the post-mortems."""
        for key, value in self.etcd.get_prefix(keys.exits(self.job_id)):
            try:
                report = WorkerExit.model_validate_json(value)
            except ValueError:
                log.warning("controller: ignoring a malformed exit report under %s", key)
            else:
                self._apply_exit(report)
            self.etcd.delete(key)

    def _drain_alerts(self) -> None:
        """Rendezvous states a torchrun agent refused (keys.alert): an event each, in the log
        and the store. The agent has already failed its rendezvous; this says why, and where.
        Looked for once every ALERT_POLL_S, not at every tick: it is rare, and every etcd
        request of the tick counts at cluster size (bench/control_plane_scale.py)."""
        now = time.monotonic()
        if now - self._alerts_looked < ALERT_POLL_S:
            return
        self._alerts_looked = now
        for key, value in self.etcd.get_prefix(keys.alerts(self.job_id)):
            try:
                alert = RendezvousRefused.model_validate_json(value)
            except ValueError:
                log.warning("controller: ignoring a malformed alert under %s", key)
            else:
                who = f"the torchrun agent pid {alert.pid} on {alert.host}"
                log.error("controller: %s refused the rendezvous state: %s", who, alert.reason)
                self.store.add_event(
                    self.job_id,
                    "rendezvous_refused",
                    f"{who} refused the rendezvous state at {alert.key}: {alert.reason}",
                    data=alert.model_dump(mode="json"),
                    key=f"{key}:{alert.run_id}",  # once per agent and run: it may say it again
                )
            self.etcd.delete(key)
        for key, value in self.etcd.get_prefix(keys.refusals(self.job_id)):
            if self.progress.outcome:
                # the job is ending: a refusal left untaken keeps its pod waiting (roles.py)
                # rather than failing once more, which would spend Volcano's maxRetry first
                break
            try:
                refused = TrainerRefused.model_validate_json(value)
            except ValueError:
                log.warning("controller: ignoring a malformed refusal under %s", key)
            else:
                self._trainer_refused(refused, key)
            self.etcd.delete(key)

    def _trainer_refused(self, refused: TrainerRefused, key: str) -> None:
        """A trainer pod could not run here: an event; once pods have refused `refusal_budget`
        times the job fails (each was replaced and refused again: restarting does not help)."""
        self._refusals += 1
        who = f"trainer pod {refused.host} (pid {refused.pid})"
        self.store.add_event(
            self.job_id,
            "trainer_refused",
            f"{who} cannot run the job: {refused.reason}",
            data=refused.model_dump(mode="json"),
            # a replaced pod has the same name and PID (1): once per refusal, not per key
            key=f"{key}:{refused.time}",
        )
        budget = self.refusal_budget
        if budget is not None and self._refusals >= max(1, budget) and not self.progress.outcome:
            message = (
                f"trainer pods refused to run the job {self._refusals} times: {refused.reason}"
            )
            log.error("controller: %s", message)
            self.progress.outcome, self.progress.error = "failed", message

    def _current(self, state: TrainingState) -> TrainingState:
        """A reported state, with the version of the layout in force: a checkpoint written just
        before a re-layout must not move the job's layout version back."""
        if self.layout is None:
            return state
        return state.model_copy(
            update={"layout_version": max(state.layout_version, self.layout.version)}
        )

    def _audit_new_request(self) -> None:
        """Record a manual freeze request filed in etcd (by the CLI or the dashboard) once."""
        raw = self.etcd.get(keys.freeze_override(self.job_id))
        if raw:
            self._audit_request(read_freeze_request(raw))

    def _audit_request(self, request: FreezeRequest | UnreadableRequest) -> None:
        """Record `request` as filed, once (by `freeze_request_id`, as the store keys it)."""
        rid = freeze_request_id(request)
        if isinstance(request, UnreadableRequest):
            message = (
                f"unreadable request {request.raw[:80]!r} ({request.error}); it will be rejected"
            )
        else:
            message = (
                f"request {rid} by {request.who}: freeze blocks below {request.layers} "
                f"({request.reason})"
            )
        if rid in self._audited:
            return
        self._audited.add(rid)
        self.store.add_event(
            self.job_id,
            "freeze_requested",
            message,
            data={"request": request.model_dump(mode="json")},
            key=f"freeze-request:{rid[:200]}",  # audited once, across controller restarts
        )

    def _latest_state(self, events: list[WorkerEvent]) -> TrainingState | None:
        m = [e for e in events if isinstance(e, Metrics)]
        if not m:
            return None
        last = m[-1]
        return TrainingState(
            epoch=last.epoch,
            step=last.step,
            samples_consumed=last.samples_consumed,
            lr=last.lr,
            layout_version=self.layout.version if self.layout else 1,
        )

    def _record_event(self, kind: str, message: str, **kw: Any) -> None:
        """An event derived from the worker report being applied: keyed by the report's etcd key
        (and kind), so a controller that crashed before deleting the report does not record it
        twice when it drains it again."""
        key = f"{self._report}:{kind}" if self._report else None
        self.store.add_event(self.job_id, kind, message, key=key, **kw)

    def _apply(self, e: WorkerEvent) -> None:
        """One worker report: progress for displays, facts for the store."""
        p = self.progress
        match e:
            case Metrics():
                p.step, p.epoch, p.loss, p.samples_per_s = e.step, e.epoch, e.loss, e.samples_per_s
                p.mfu = e.mfu
                if e.peak_memory_mib is not None:
                    p.peak_memory_mib = e.peak_memory_mib
            case Started():
                p.total_steps = e.total_steps
                self.roster.started(e)
                self._record_event(
                    "worker_started", f"rank {e.rank} started", rank=e.rank, data=e.payload()
                )
            case Evaluated():
                p.accuracy, p.f1 = e.accuracy, e.f1
                self.store.add_evaluation(
                    self.job_id, e.epoch, e.step, e.accuracy, e.loss, e.time, f1=e.f1
                )
            case CheckpointWritten():
                self._commit_checkpoint(e)
            case CheckpointFailed():  # nothing committed: the previous one still holds
                self._record_event(
                    "checkpoint_failed",
                    f"checkpoint at step {e.step} was not committed: {e.error}",
                    rank=e.rank,
                    data=e.payload(),
                )
            case LayoutPlanned():
                self._adopt_layout(e.layout, e.reason, e.seconds, e.cost, e.predicted_stage_s)
                self.roster.relaid(e.generation, e.layout)
            case FreezeDecided():
                self._record_freeze(e)
            case Finished():
                p.outcome = e.outcome
                self.roster.finished(e)
            case Failed():  # the agents restart the workers; the job fails when they stop
                p.error = e.error
                self._check_fatal(self.generations.rank_ended(e))
            case PeerLost() | Aborted() | Left():  # not this rank's fault
                self.generations.rank_ended(e)
            case CacheDecided():
                use = "serves" if e.use else "does not serve"
                self._record_event(
                    "cache_decided",
                    f"rank {e.rank}: AutoCache {use} the frozen prefix at F={e.boundary}: "
                    f"{e.reason}",
                    rank=e.rank,
                    data=e.payload(),
                )
            case DataOpened():
                self._record_event(
                    DATA_OPENED,
                    f"generation {e.generation} opened the data: {data_text(e.origin)}",
                    rank=e.rank,
                    data=e.payload(),
                )
            case FirstStep():
                since = (
                    f", {e.time - self.aborted_at:.1f}s after the abort" if self.aborted_at else ""
                )
                self._record_event(
                    "generation_resumed",
                    f"generation {e.generation} completed its first step ({e.step}){since}",
                    data=e.payload() | {"generation": e.generation, "aborted_at": self.aborted_at},
                )
                self.aborted_at = None
            case Leaving():
                if gen := self.generations.get(e.generation):
                    gen.leaving = True  # its leases go next: a re-formation, not a loss
                    # so no rank is taken for lost
                    gen.postmortem.leave(
                        f"re-formed: rank(s) {e.ranks} asked to leave (step {e.step})"
                    )
                self.roster.finished(e)
                self._record_event(
                    "worker_leaving",
                    f"rank(s) {e.ranks} asked to leave (SIGTERM); checkpointed at step {e.step}",
                    data=e.payload(),
                )

    def _adopt_layout(
        self,
        layout: Layout,
        reason: str,
        seconds: float | None,
        cost: RelayoutCost | None = None,
        predicted_stage_s: list[float] | None = None,
    ) -> None:
        """Workers planned a layout from measurement: record it and make it the current one, so
        a resumed generation starts with it instead of planning again. A re-layout's cost (where
        its pause went, how the state moved) is kept with the event."""
        self.store.record_layout(self.job_id, layout, reason=reason)
        self.etcd.put(keys.layout(self.job_id), layout.model_dump_json())
        self.layout = self.progress.layout = layout  # later progress updates carry its F
        if cost is not None:
            took = f" (re-laid out in {seconds:.2f}s, state moved by {cost.handover})"
        elif seconds is not None:
            took = f" (measured and planned in {seconds:.1f}s)"
        else:
            took = ""
        data: dict[str, Any] = {"layout": layout.describe(), "seconds": seconds}
        if cost is not None:
            data["cost"] = cost.model_dump()
        if predicted_stage_s is not None:  # the Pipeline view sets them beside the measured
            data["version"] = layout.version
            data["predicted_stage_s"] = predicted_stage_s
        self._record_event("layout_planned", f"layout v{layout.version}: {reason}{took}", data=data)

    def _record_freeze(self, e: FreezeDecided) -> None:
        """A decision point moved the boundary or answered a manual request: audit what became
        of the request (applied, superseded by the automatic decision, or rejected), and retire
        it so it is not applied twice."""
        rid = None if e.request is None else freeze_request_id(e.request)
        if e.request is not None and rid not in self._decided:
            # filed and answered between two of this controller's reads of the key (a busy
            # controller, decision points close together): audited here, before its fate
            self._audit_request(e.request)
            # only the first answer counts: a worker that read the request again before it was
            # retired here (a decision point soon after, a restarted worker) finds it superseded
            # by its own application
            self._decided.add(rid)
            outcome = e.outcome or FreezeOutcome.REJECTED
            why = e.outcome_reason or f"boundary {e.previous} -> {e.boundary}"
            if isinstance(e.request, UnreadableRequest):
                whose = f"unreadable request {e.request.raw[:80]!r}"
            else:
                r = e.request
                whose = f"request {r.id} by {r.who} (layers={r.layers})"
            self._record_event(
                f"freeze_{outcome}",
                f"{whose}: {why}",
                data={
                    "request": e.request.model_dump(mode="json"),
                    "step": e.step,
                    "outcome": outcome.value,
                    "boundary": e.boundary,
                },
            )
        if rid is not None:
            self._retire_request(rid)
        if e.boundary != e.previous:
            self._record_event(
                "freeze",
                f"{e.source}: blocks {e.previous}..{e.boundary - 1} frozen at step "
                f"{e.step} ({e.reason})",
                data=e.payload(),
            )

    def _retire_request(self, rid: str) -> None:
        """Take the answered request `rid` out of its key, and nothing else: a request filed
        since (the key freed by an earlier answer to `rid`, a second answer arriving now) waits
        for the next decision point."""
        key = keys.freeze_override(self.job_id)
        raw, revision = self.etcd.get_with_revision(key)
        if raw is not None and freeze_request_id(read_freeze_request(raw)) == rid:
            self.etcd.delete_at_revision(key, revision)  # unless replaced since this read

    def _commit_checkpoint(self, e: CheckpointWritten) -> None:
        state = e.state
        try:
            size = verify_checkpoint(e.path, e.checksum)
        except CheckpointError as exc:
            self._record_event("checkpoint_rejected", str(exc), rank=e.rank)
            return
        self.store.commit_checkpoint(
            self.job_id,
            step=state.step,
            epoch=state.epoch,
            layout_version=e.layout_version,
            path=e.path,
            size_bytes=size,
            checksum=e.checksum,
            samples_consumed=state.samples_consumed,
        )
        if state.step >= self.progress.step:  # an async commit lands after later metrics
            self.store.update_progress(self.job_id, self._current(state))
        self._record_event(
            "checkpoint_committed",
            f"step {state.step} ({size / 1e6:.1f} MB, {e.seconds:.2f}s)",
            data={"path": e.path, "step": state.step},
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
            try:
                code = poll_exit()
            except (EtcdUnavailable, StoreUnavailable, OperationalError) as exc:
                # nothing is known of the workers meanwhile (the trainer pods' launchers are
                # counted in etcd): ridden out like the tick's own reads, not the end of the job
                self._note_outage(exc)
                code = None
            self.tick()
            if on_tick:
                on_tick(self.progress)
            if code is not None:
                self.drain()
                return code
            if self._leaving and not self.progress.outcome:
                # between ticks: every report drained so far is applied and stored. A job
                # whose end was drained (outcome known) is finished first, or no one would
                # record it: its final reports are gone from etcd.
                raise HandedOver(
                    f"controller for job {self.job_id}: left on request; the job runs on for "
                    "the next controller to take over"
                )
            time.sleep(interval)

    def leave(self) -> None:
        """Ask `run` to hand the job over at its next safe point, between two ticks (callable
        from a signal handler): `run` then raises HandedOver with its lease revoked."""
        self._leaving = True

    def tick(self) -> None:
        """One round of supervision. Store or etcd trouble is ridden out (the work stays queued
        in etcd) and reported once it clears."""
        try:
            self.drain()
            self.answer_join()
            self.check_workers()
            self._follow_up()
        except (EtcdUnavailable, StoreUnavailable, OperationalError) as exc:
            self._note_outage(exc)
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

    def _note_outage(self, exc: Exception) -> None:
        """etcd or the store did not answer (within its client's retries): logged once; the
        next tick that gets through records how long it lasted."""
        if self._outage is None:
            self._outage = time.monotonic()
            log.warning("controller: %s unavailable, retrying: %s", _which(exc), exc)

    def workers_alive(self) -> int:
        return self.etcd.count_prefix(keys.workers(self.job_id))


def _which(exc: BaseException) -> str:
    return "etcd" if isinstance(exc, EtcdUnavailable) else "store"
