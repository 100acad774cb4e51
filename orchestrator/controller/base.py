"""What every part of the controller holds (`ControllerBase`): its job, the store it writes and
the etcd it talks through, the layout in force, what it has seen of the workers' progress, the
generations it knows of and the bookkeeping of its reports. The parts, one concern each, are
mixins over it (orchestrator/controller/__init__.py lists them); `Controller` is all of them, and
the only one made: a part calls another's steps through `self` (`drain` before a generation is
answered, `resume_point` when it starts, `_commit_checkpoint` for a report).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pipetransformer.core.protocol import Assignment, WorkerEvent
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout
from pipetransformer.edge.etcd_client import EtcdClient, KeepAlive
from pipetransformer.orchestrator.controller.job import Progress
from pipetransformer.orchestrator.generations import Generation, Generations
from pipetransformer.orchestrator.roster import Roster
from pipetransformer.store import Store


class ControllerBase:
    """The state the controller's parts share; `Controller` (orchestrator/controller/lifecycle.py)
    is the class to use."""

    def __init__(self, store: Store, etcd: EtcdClient, job_id: str):
        self.store, self.etcd, self.job_id = store, etcd, job_id
        self.job = store.get_job(job_id)
        self.spec: JobSpec = self.job.spec
        self.layout: Layout | None = store.current_layout(job_id)
        self.notices: list[str] = []  # Progress.notices, kept across generations
        self.progress = Progress(notices=self.notices)
        self.roster = Roster(store, job_id)  # the store's `workers` rows
        # the newest generation answered (None before the first), and every generation this
        # controller knows of by number: ended ones are still explained, and late reports of
        # their ranks still land in their post-mortems
        self.generations = Generations(
            store,
            roster=self.roster,
            job_id=job_id,
            explain_s=self.spec.runtime.lease_ttl_s + 3,
            notices=self.notices,
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
