"""The workers' reports into the store (`Reports`): `drain` moves every report queued in etcd
(metrics, stage times, traces in one statement each; the rest applied one by one, `_apply`), the
exit statuses the fork servers reaped, the rendezvous states an agent refused and the trainer
pods' refusals, then deletes them. Store writes are idempotent and a report's derived events are
keyed by its etcd key, so a controller that crashed between storing and deleting only replays.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pipetransformer.core import keys
from pipetransformer.core.postmortem import describe_status
from pipetransformer.core.protocol import (
    Aborted,
    BadReport,
    CacheDecided,
    CheckpointFailed,
    CheckpointWritten,
    DataOpened,
    Evaluated,
    Failed,
    Finished,
    FirstStep,
    FreezeDecided,
    FreezeSignal,
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
    WorkerEvent,
    WorkerExit,
    parse_event,
)
from pipetransformer.core.provenance import DATA_OPENED, data_text
from pipetransformer.core.state import Layout, TrainingState
from pipetransformer.core.tasks import task_of
from pipetransformer.orchestrator.controller.base import ControllerBase

log = logging.getLogger("pipetransformer.controller")

# How often the controller looks for rendezvous states an agent refused (`_drain_alerts`).
ALERT_POLL_S = 1.0


class Reports(ControllerBase):
    """Draining and applying the workers' reports."""

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
                if task_of(self.spec.model).targets_per_token:
                    p.token_loss = e.loss
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
            case FreezeSignal():  # what the policy read: the Freezing view draws it
                self.store.add_freeze_signal(self.job_id, e)
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
                if self.aborted_at is not None:
                    self.notices.append(
                        f"generation {e.generation} is training again: step {e.step}{since}"
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
