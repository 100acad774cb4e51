"""Answering the workers' rendezvous rounds (`Joins`): every torchrun round is one generation
(orchestrator/generations.py holds what the controller knows of each). Its rank 0 files a
JoinRequest; the controller ends the previous generation (aborted), plans for the new world and
publishes the Assignment (`answer_join`, `start_generation`). A lost worker (lease gone without a
final report) gets the generation aborted (`check_workers`, `abort`): the survivors watch
`keys.abort` and leave their collectives at once, their agents re-rendezvous, and the next
round's join request starts the next generation. A restarted controller takes over the running
generation instead (`attach`); every rank failing the same way at start fails the job
(`_check_fatal`).
"""

from __future__ import annotations

import json
import logging
import os
import time

from pydantic import ValidationError

from pipetransformer.core import keys
from pipetransformer.core.planner import PlanError, plan_layout
from pipetransformer.core.postmortem import PostMortem
from pipetransformer.core.protocol import Assignment, Control, JoinRequest, first_error
from pipetransformer.orchestrator.controller.base import ControllerBase
from pipetransformer.orchestrator.controller.job import Progress
from pipetransformer.orchestrator.generations import Generation

log = logging.getLogger("pipetransformer.controller")


class Joins(ControllerBase):
    """Join requests into generations, and the watch on their workers' leases."""

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
        self.progress = Progress(
            step=job.step, epoch=job.epoch, layout=self.layout, notices=self.notices
        )
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
            self.notices.append(f"generation {previous.number} re-formed by the agents")
        last_step = self.progress.step  # the newest step seen before this generation
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
                data={
                    "generation": number,
                    "layout": layout.describe(),
                    "start": start.model_dump(),
                    "world": world,
                },
            )
        if self.aborted_at is not None and not waiting:
            redo = last_step - start.step
            self.notices.append(
                f"generation {number} formed with {world} workers, {how}"
                + (f" ({redo} step{'s' if redo != 1 else ''} to redo)" if redo > 0 else "")
            )
        self.progress = Progress(
            step=start.step, epoch=start.epoch, layout=layout, notices=self.notices
        )
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
        self.notices.append(f"generation {gen} aborted: {reason}")

    def _follow_up(self) -> None:
        """Keep explaining ended generations (orchestrator/generations.py)."""
        if not self.generations.explaining():
            return
        held = self._presence()
        self.drain()  # after reading the keys: a report put before a lease was revoked counts
        self.generations.follow_up(held)

    def _check_fatal(self, gen: Generation) -> None:
        """Every rank of the generation failed while starting, with the same error: a restart
        would fail the same way (a bad spec, a missing file), so the job fails now instead of
        burning runtime.max_restarts. The next rendezvous round's workers see the fatal
        assignment and exit 0, so their agents stop."""
        a = gen.assignment
        if gen is not self.current or a is None or gen.fatal:
            return
        error, message = gen.postmortem.deterministic_failure(), gen.postmortem.fatal_text()
        if error is None or message is None:
            return
        gen.fatal = error
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
