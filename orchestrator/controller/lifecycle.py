"""The controller's life (`Controller.run`): acquire the job's lease, attach or publish, launch,
supervise, finish, release; callers say how the workers are launched (`Workers`), never in which
order these go. `Controller` is every part of orchestrator/controller/ over one state.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.exc import OperationalError

from pipetransformer.core import keys
from pipetransformer.core.planner import plan_layout
from pipetransformer.core.protocol import Control
from pipetransformer.core.spec import JobSpec
from pipetransformer.edge.etcd_client import EtcdClient, EtcdUnavailable
from pipetransformer.orchestrator.controller.checkpoints import Checkpoints
from pipetransformer.orchestrator.controller.freeze_requests import FreezeRequests
from pipetransformer.orchestrator.controller.job import (
    ControllerError,
    HandedOver,
    Progress,
    Submission,
    Workers,
    is_dead_local_process,
    new_job_id,
    submit,
)
from pipetransformer.orchestrator.controller.joins import Joins
from pipetransformer.orchestrator.controller.reports import Reports
from pipetransformer.store import Store, StoreUnavailable

log = logging.getLogger("pipetransformer.controller")


class Controller(Joins, Reports, FreezeRequests, Checkpoints):
    """The job's controller. `run` is its whole life; the steps it takes are public for the
    tests and the benchmarks that drive them one at a time."""

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
        spec: JobSpec | Submission,
        workdir: str | Path,
        job_id: str | None = None,
    ) -> Controller:
        """Record a new job (pending) with its initial layout. A spec handed over unresolved is
        resolved here, once (`submit`: a fine-tuning spec's checkpoint checked and pinned, a
        pretrained model and data files located; SpecError, nothing stored, if one cannot be
        used); a `Submission` was resolved when it was made and is stored as it is."""
        spec = submit(spec).spec
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
            if holder is not None and is_dead_local_process(holder):
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
