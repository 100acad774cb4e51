"""Jobs: creating one, its state and progress, reading one or all with the freeze boundary of
their current layouts, and deleting one with everything recorded for it."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ScalarSelect, Select, delete, select
from sqlalchemy.orm import Session

from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout, TrainingState
from pipetransformer.store.base import StoreBase
from pipetransformer.store.errors import JobExists
from pipetransformer.store.rows import JobInfo
from pipetransformer.store.tables import JOB_STATES, Job, LayoutRow, utcnow
from pipetransformer.store.values import check_state


def current_layout_json(job_id: Any) -> ScalarSelect[str]:
    """The `layout_json` of the job's highest layout version (NULL before the first layout).
    Pass `Job.id` to get a correlated subquery: one query reads any number of jobs with their
    current layouts, each found through the (job_id, version) unique index."""
    return (
        select(LayoutRow.layout_json)
        .where(LayoutRow.job_id == job_id)
        .order_by(LayoutRow.version.desc())
        .limit(1)
        .scalar_subquery()
    )


def _boundary(layout_json: str | None) -> int:
    """The freeze boundary of a recorded layout; 0 when there is none (nothing is frozen)."""
    return 0 if layout_json is None else Layout.model_validate_json(layout_json).freeze_boundary


def job_info(row: Job, layout_json: str | None) -> JobInfo:
    """`row` with its spec parsed; `layout_json`: the job's current layout
    (`current_layout_json`), None if none."""
    return JobInfo(
        id=row.id,
        name=row.name,
        spec=JobSpec.model_validate_json(row.spec_json),
        workdir=row.workdir,
        state=row.state,
        message=row.message,
        created_at=row.created_at,
        updated_at=row.updated_at,
        epoch=row.epoch,
        step=row.step,
        samples_consumed=row.samples_consumed,
        lr=row.lr,
        freeze_boundary=_boundary(layout_json),
        layout_version=row.layout_version,
        accuracy=row.accuracy,
    )


def _job_infos(session: Session, query: Select[tuple[Job]]) -> list[JobInfo]:
    """The jobs `query` selects, each with its current layout read in the same query."""
    rows = session.execute(query.add_columns(current_layout_json(Job.id)))
    return [job_info(job, layout_json) for job, layout_json in rows]


class JobsMixin(StoreBase):
    def create_job(self, job_id: str, spec: JobSpec, workdir: str) -> None:
        """Add a job in state "pending". Raises JobExists if the id is taken."""
        if not job_id or len(job_id) > 64:
            raise ValueError(f"job id {job_id!r} must be 1-64 characters")
        now = utcnow()  # also this call's identity: a retried commit recognises its own row
        spec_json = spec.to_json()

        def tx(s: Session) -> None:
            existing = s.get(Job, job_id)
            if existing is not None:
                if existing.created_at == now and existing.spec_json == spec_json:
                    return  # an earlier try of this call committed
                raise JobExists(job_id)
            s.add(
                Job(
                    id=job_id,
                    name=spec.name,
                    spec_json=spec_json,
                    workdir=str(workdir),
                    state="pending",
                    message=None,
                    created_at=now,
                    updated_at=now,
                    epoch=0,
                    step=0,
                    samples_consumed=0,
                    lr=0.0,
                    layout_version=0,
                    accuracy=None,
                )
            )

        self._write("create_job", tx)

    def get_job(self, job_id: str) -> JobInfo:
        def tx(s: Session) -> JobInfo:
            found = _job_infos(s, select(Job).where(Job.id == job_id))
            if not found:
                raise self._unknown(s, job_id)
            return found[0]

        return self._read("get_job", tx)

    def list_jobs(self) -> list[JobInfo]:
        """All jobs, newest first (one query, whatever their number)."""

        def tx(s: Session) -> list[JobInfo]:
            return _job_infos(s, select(Job).order_by(Job.created_at.desc(), Job.id.desc()))

        return self._read("list_jobs", tx)

    def set_job_state(self, job_id: str, state: str, message: str | None = None) -> None:
        """Move a job to `state`; `message` replaces the previous one (None clears it)."""
        check_state("job", state, JOB_STATES)

        def tx(s: Session) -> None:
            job = self._job(s, job_id)
            job.state = state
            job.message = message
            job.updated_at = utcnow()

        self._write("set_job_state", tx)

    def update_progress(self, job_id: str, state: TrainingState) -> None:
        """Record where training is (epoch, step, samples, LR, layout version). The freeze
        boundary is not taken from `state`: it is the current layout's (`record_layout`)."""

        def tx(s: Session) -> None:
            job = self._job(s, job_id)
            job.epoch = state.epoch
            job.step = state.step
            job.samples_consumed = state.samples_consumed
            job.lr = state.lr
            job.layout_version = state.layout_version
            job.updated_at = utcnow()

        self._write("update_progress", tx)

    def delete_job(self, job_id: str) -> None:
        """Remove a job and (by ON DELETE CASCADE) everything recorded for it."""
        self._read("delete_job", lambda s: self._job(s, job_id))  # UnknownJob before any write
        # A no-op when a retried try already deleted it.
        self._write("delete_job", lambda s: s.execute(delete(Job).where(Job.id == job_id)))
