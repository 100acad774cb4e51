"""A controller pod's restarts, counted in the job's event log: how many in a row ended
uncleanly, and whether the job has already ended (a controller restarted after the end must not
start it again). Pure functions over the store's events; `cli.cmd_controller` records them.

Each controller start records `controller_started`; an exit the controller chose records
`controller_exited` with its status (orchestrator/exits.py), a crash `controller_crashed` with
the error. A start whose run ended otherwise (killed: out of memory, its node lost) left no
exit. Unclean restarts are counted since the last clean exit, a handover on SIGTERM: a pod
drained once a day never spends the budget, a pod that crashes at every start does.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetransformer.orchestrator.exits import (
    EXIT_COMPLETED,
    EXIT_JOB_FAILED,
    EXIT_SIGTERM,
    EXIT_STOPPED,
)
from pipetransformer.store.rows import EventRow, JobInfo

STARTED, EXITED, CRASHED = "controller_started", "controller_exited", "controller_crashed"
KINDS = (STARTED, EXITED, CRASHED)
END_KINDS = ("job_completed", "job_failed", "job_interrupted")


def _ordered(events: Sequence[EventRow]) -> list[EventRow]:
    return sorted(events, key=lambda e: (e.time, e.id))


def _launch(e: EventRow) -> str:
    return str((e.data or {}).get("launch", ""))


def unclean_restarts(events: Sequence[EventRow], launch: str) -> tuple[int, str]:
    """(starts in a row under `launch` that did not end in a clean exit, the last one's
    reason), from the controller's events (`KINDS`) in any order. A new launch (a new
    submission of the job) starts with a fresh budget."""
    count, reason = 0, ""
    pending = False  # a start whose end is not known yet
    for e in _ordered(events):
        if e.kind == STARTED:
            if _launch(e) != launch:
                count, reason, pending = 0, "", False
                continue
            if pending:  # the previous start left no word: killed
                count += 1
                reason = (
                    "the previous controller ended without a word (out of memory, or its node "
                    "lost?)"
                )
            pending = True
        elif e.kind == CRASHED:
            count += 1
            reason = e.message
            pending = False
        elif e.kind == EXITED:
            if (e.data or {}).get("status") == EXIT_SIGTERM:
                count, reason = 0, ""
            else:
                count += 1
                reason = e.message
            pending = False
    return count, reason


def ended_status(job: JobInfo, events: Sequence[EventRow], launch: str) -> int | None:
    """The status a controller restarted after its launch ended the job exits with at once, so
    that Volcano's policy ends the Volcano job (None: the job goes on: it has not ended, it was
    interrupted in a way a restart continues, or this is a new launch resuming it). `events`:
    the controller's (`KINDS`) and the job's ends (`END_KINDS`)."""
    ordered = _ordered(events)
    ends = [i for i, e in enumerate(ordered) if e.kind in END_KINDS]
    if not launch or not ends:
        return None
    starts = [e for e in ordered[: ends[-1]] if e.kind == STARTED]
    if not starts or _launch(starts[-1]) != launch:
        return None  # ended under another launch: this one resumes it
    if job.state == "completed":
        return EXIT_COMPLETED
    if job.state == "failed":
        return EXIT_JOB_FAILED
    if job.state == "interrupted" and (ordered[ends[-1]].data or {}).get("outcome") == "stopped":
        return EXIT_STOPPED
    return None
