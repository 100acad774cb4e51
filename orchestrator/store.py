"""The SQL store: the only API anything uses to read or write the job database.

One writer (the controller; the CLI for job creation and state changes) and any number of
readers (the dashboard, `pipetransformer status`). Every write method is one transaction and
validates its input before touching the database, so bad input raises and changes nothing.

Timestamps are timezone-aware UTC `datetime`s on the typed results (`JobInfo`,
`CheckpointInfo`, layouts); the row dicts (`metrics`, `evaluations`, `events`) carry `time` as
unix seconds, the same shape the trainer reports them in, so they are JSON-ready.

SQLite (default, one file per run directory) and PostgreSQL (production) are both supported.
The schema is created and upgraded only by alembic (`Store.open(url, migrate=True)`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from sqlalchemy import Connection, Engine, create_engine, delete, event, func, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

import migrations
from orchestrator.spec import JobSpec
from orchestrator.state import Layout, TrainingState
from orchestrator.tables import (
    CHECKPOINT_STATES,
    GENERATION_STATES,
    JOB_STATES,
    Checkpoint,
    Evaluation,
    Event,
    Generation,
    Job,
    LayoutRow,
    Metric,
    utcnow,
)

__all__ = [
    "CHECKPOINT_STATES",
    "GENERATION_STATES",
    "JOB_STATES",
    "CheckpointInfo",
    "JobExists",
    "JobInfo",
    "NotFound",
    "Store",
    "StoreConflict",
    "UnknownJob",
    "alembic_config",
    "make_engine",
    "sqlite_path",
    "sqlite_url",
]

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent
SQLITE_BUSY_TIMEOUT_MS = 10_000
_MAX_LISTED_IDS = 20


# --------------------------------------------------------------------------- errors


class NotFound(LookupError):
    """A row the caller named (job, generation, checkpoint) does not exist."""


class UnknownJob(NotFound):
    """No job with this id; the message lists the ids that do exist."""

    def __init__(self, job_id: str, known_ids: Sequence[str]):
        self.job_id = job_id
        self.known_ids = list(known_ids)
        if not self.known_ids:
            known = "there are no jobs in this store"
        else:
            shown = ", ".join(self.known_ids[:_MAX_LISTED_IDS])
            more = len(self.known_ids) - _MAX_LISTED_IDS
            known = f"known jobs: {shown}" + (f" (and {more} more)" if more > 0 else "")
        super().__init__(f"unknown job {job_id!r}; {known}")


class JobExists(ValueError):
    """`create_job` with an id that is already taken."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"job {job_id!r} already exists")


class StoreConflict(ValueError):
    """A write contradicts what is stored (e.g. a different layout under the same version)."""


# --------------------------------------------------------------------------- results


class JobInfo(BaseModel):
    """A job row with its spec parsed."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    spec: JobSpec
    workdir: str
    state: str
    message: str | None
    created_at: datetime
    updated_at: datetime
    epoch: int
    step: int
    samples_consumed: int
    lr: float
    freeze_boundary: int
    layout_version: int
    accuracy: float | None

    @property
    def spec_json(self) -> str:
        return self.spec.to_json()

    @classmethod
    def _from_row(cls, row: Job) -> JobInfo:
        return cls(
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
            freeze_boundary=row.freeze_boundary,
            layout_version=row.layout_version,
            accuracy=row.accuracy,
        )


class CheckpointInfo(BaseModel):
    """A checkpoint row. Only `state == "committed"` checkpoints may be resumed from."""

    model_config = ConfigDict(frozen=True)

    id: int
    job_id: str
    step: int
    epoch: int
    layout_version: int
    path: str
    size_bytes: int
    checksum: str
    samples_consumed: int
    state: str
    created_at: datetime

    @classmethod
    def _from_row(cls, row: Checkpoint) -> CheckpointInfo:
        return cls(
            id=row.id,
            job_id=row.job_id,
            step=row.step,
            epoch=row.epoch,
            layout_version=row.layout_version,
            path=row.path,
            size_bytes=row.size_bytes,
            checksum=row.checksum,
            samples_consumed=row.samples_consumed,
            state=row.state,
            created_at=row.created_at,
        )


# --------------------------------------------------------------------------- input rows


def _finite_or_none(value: float | None) -> float | None:
    # SQLite stores NaN as NULL (and rejects it in NOT NULL columns); make that explicit.
    return value if value is not None and math.isfinite(value) else None


class _MetricRow(BaseModel):
    model_config = ConfigDict(extra="ignore")

    step: int = Field(ge=0)
    epoch: int = Field(ge=0)
    loss: float | None
    samples_per_s: float | None
    lr: float = Field(ge=0, allow_inf_nan=False)
    time: float = Field(allow_inf_nan=False)

    @field_validator("loss", "samples_per_s")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return _finite_or_none(value)


_metric_rows = TypeAdapter(list[_MetricRow])


def _problems(err: ValidationError, what: str) -> str:
    # loc is (row index, field): name it like the caller's data, e.g. "rows[3].loss".
    out = []
    for e in err.errors():
        loc = list(e["loc"])
        where = what + (f"[{loc.pop(0)}]" if loc and isinstance(loc[0], int) else "")
        where += "".join(f".{p}" for p in loc)
        out.append(f"{where}: {e['msg']}")
    return "; ".join(out)


def _json_safe(value: Any) -> Any:
    """Non-finite floats become null: stored JSON stays standard (a diverged loss in event data
    must not make the event unrecordable)."""
    if isinstance(value, float):
        return _finite_or_none(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _check_state(kind: str, state: str, allowed: Sequence[str]) -> None:
    if state not in allowed:
        raise ValueError(f"{kind} state {state!r} is not valid; allowed: {', '.join(allowed)}")


def _from_unix(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def _unix(dt: datetime) -> float:
    return dt.timestamp()


# --------------------------------------------------------------------------- engine / alembic


def sqlite_url(path: str | Path) -> str:
    """SQLAlchemy URL of the SQLite file at `path` (made absolute)."""
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def sqlite_path(url: str) -> Path | None:
    """The file behind a SQLite URL; None for other databases and in-memory SQLite."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    database = u.database
    if u.query.get("uri") in ("true", "1") and database.startswith("file:"):
        database = database.removeprefix("file:").split("?", 1)[0]
    return Path(database)


def _sqlite_pragmas(read_only: bool) -> Callable[[Any, Any], None]:
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            # SQLite ignores foreign keys (and so ON DELETE CASCADE) unless asked, per connection.
            cursor.execute("PRAGMA foreign_keys=ON")
            # The dashboard reads while the controller writes: WAL lets readers proceed during a
            # write, and busy_timeout makes a second writer wait instead of failing at once.
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            if read_only:
                # WAL is a property of the file, set by the writer; a reader changes nothing.
                cursor.execute("PRAGMA query_only=ON")
            else:
                cursor.execute("PRAGMA journal_mode=WAL")
        finally:
            cursor.close()

    return on_connect


def _postgres_read_only(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    finally:
        cursor.close()
    dbapi_connection.commit()


def make_engine(url: str, read_only: bool = False) -> Engine:
    """An engine for `url` with the settings the store relies on (SQLite pragmas, pooling).

    `read_only` makes the database itself refuse writes on these connections."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        kwargs: dict[str, Any] = {}
        if sqlite_path(url) is None:
            # One shared connection, or every pooled connection would see its own empty DB.
            kwargs = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        engine = create_engine(u, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas(read_only))
        return engine
    engine = create_engine(u, pool_pre_ping=True)
    if read_only and u.get_backend_name() == "postgresql":
        event.listen(engine, "connect", _postgres_read_only)
    return engine


def alembic_config(connection: Connection | None = None, url: str | None = None) -> Config:
    """An alembic Config for the packaged `migrations`, built in code (no alembic.ini).

    Pass an open `connection` to migrate on it (used by `Store`), or a `url`.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # ConfigParser escaping
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


# --------------------------------------------------------------------------- the store


class Store:
    """Typed access to the job database. Construct with `Store.open(url)` to migrate first."""

    def __init__(self, url: str, read_only: bool = False) -> None:
        """Connect to `url` without touching the schema. `read_only` (the dashboard) makes
        every write method raise PermissionError and the connection itself refuse writes."""
        self.url = url
        self.read_only = read_only
        self._engine = make_engine(url, read_only=read_only)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    @classmethod
    def open(cls, url: str, migrate: bool = True) -> Store:
        """Connect, and (by default) upgrade the schema to the newest alembic revision."""
        store = cls(url)
        if migrate:
            try:
                store.migrate()
            except BaseException:
                store.close()
                raise
        return store

    def migrate(self, revision: str = "head") -> None:
        """`alembic upgrade <revision>` on this store's engine."""
        if self.read_only:
            raise PermissionError(f"{self!r} is open read-only; it cannot migrate")
        with self._engine.begin() as conn:
            command.upgrade(alembic_config(connection=conn), revision)

    def revision(self) -> str | None:
        """The schema's alembic revision; None for a database without the schema."""
        with self._engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({make_url(self.url).render_as_string(hide_password=True)!r})"

    # ---- plumbing

    @contextmanager
    def _write(self) -> Iterator[Session]:
        if self.read_only:
            raise PermissionError(f"{self!r} is open read-only")
        with self._sessions.begin() as session:
            yield session

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._sessions() as session:
            yield session

    def _job(self, session: Session, job_id: str) -> Job:
        job = session.get(Job, job_id)
        if job is None:
            known = session.scalars(select(Job.id).order_by(Job.created_at.desc(), Job.id))
            raise UnknownJob(job_id, list(known))
        return job

    # ---- jobs

    def create_job(self, job_id: str, spec: JobSpec, workdir: str) -> None:
        """Add a job in state "pending". Raises JobExists if the id is taken."""
        if not job_id or len(job_id) > 64:
            raise ValueError(f"job id {job_id!r} must be 1-64 characters")
        now = utcnow()
        with self._write() as s:
            if s.get(Job, job_id) is not None:
                raise JobExists(job_id)
            s.add(
                Job(
                    id=job_id,
                    name=spec.name,
                    spec_json=spec.to_json(),
                    workdir=str(workdir),
                    state="pending",
                    message=None,
                    created_at=now,
                    updated_at=now,
                    epoch=0,
                    step=0,
                    samples_consumed=0,
                    lr=0.0,
                    freeze_boundary=0,
                    layout_version=0,
                    accuracy=None,
                )
            )

    def get_job(self, job_id: str) -> JobInfo:
        with self._read() as s:
            return JobInfo._from_row(self._job(s, job_id))

    def list_jobs(self) -> list[JobInfo]:
        """All jobs, newest first."""
        with self._read() as s:
            rows = s.scalars(select(Job).order_by(Job.created_at.desc(), Job.id.desc()))
            return [JobInfo._from_row(r) for r in rows]

    def set_job_state(self, job_id: str, state: str, message: str | None = None) -> None:
        """Move a job to `state`; `message` replaces the previous one (None clears it)."""
        _check_state("job", state, JOB_STATES)
        with self._write() as s:
            job = self._job(s, job_id)
            job.state = state
            job.message = message
            job.updated_at = utcnow()

    def update_progress(self, job_id: str, state: TrainingState) -> None:
        """Record where training is (epoch, step, samples, LR, freeze boundary, layout)."""
        with self._write() as s:
            job = self._job(s, job_id)
            job.epoch = state.epoch
            job.step = state.step
            job.samples_consumed = state.samples_consumed
            job.lr = state.lr
            job.freeze_boundary = state.freeze_boundary
            job.layout_version = state.layout_version
            job.updated_at = utcnow()

    def delete_job(self, job_id: str) -> None:
        """Remove a job and (by ON DELETE CASCADE) everything recorded for it."""
        with self._write() as s:
            self._job(s, job_id)
            s.execute(delete(Job).where(Job.id == job_id))

    # ---- generations

    def start_generation(self, job_id: str, world_size: int) -> int:
        """Open the job's next generation (numbered from 1) in state "running"."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        with self._write() as s:
            self._job(s, job_id)
            last = s.scalar(select(func.max(Generation.number)).where(Generation.job_id == job_id))
            number = (last or 0) + 1
            s.add(
                Generation(
                    job_id=job_id,
                    number=number,
                    world_size=world_size,
                    state="running",
                    started_at=utcnow(),
                    ended_at=None,
                )
            )
            return number

    def end_generation(self, job_id: str, number: int, state: str) -> None:
        ended = tuple(g for g in GENERATION_STATES if g != "running")
        _check_state("generation end", state, ended)
        with self._write() as s:
            self._job(s, job_id)
            gen = s.scalar(
                select(Generation).where(Generation.job_id == job_id, Generation.number == number)
            )
            if gen is None:
                raise NotFound(f"job {job_id!r} has no generation {number}")
            gen.state = state
            gen.ended_at = utcnow()

    def generations(self, job_id: str) -> list[dict[str, Any]]:
        """The job's generations, oldest first."""
        with self._read() as s:
            self._job(s, job_id)
            rows = s.scalars(
                select(Generation).where(Generation.job_id == job_id).order_by(Generation.number)
            )
            return [
                {
                    "number": g.number,
                    "world_size": g.world_size,
                    "state": g.state,
                    "started_at": g.started_at,
                    "ended_at": g.ended_at,
                }
                for g in rows
            ]

    # ---- layouts

    def record_layout(self, job_id: str, layout: Layout, reason: str) -> None:
        """Store `layout` under its version. Recording the same layout again is a no-op; a
        different layout under an existing version raises StoreConflict."""
        with self._write() as s:
            self._job(s, job_id)
            existing = s.scalar(
                select(LayoutRow).where(
                    LayoutRow.job_id == job_id, LayoutRow.version == layout.version
                )
            )
            if existing is not None:
                if Layout.model_validate_json(existing.layout_json) != layout:
                    raise StoreConflict(
                        f"job {job_id!r} already has a different layout v{layout.version}; "
                        "a changed layout needs a new version"
                    )
                return
            s.add(
                LayoutRow(
                    job_id=job_id,
                    version=layout.version,
                    layout_json=layout.model_dump_json(),
                    reason=reason,
                    created_at=utcnow(),
                )
            )

    def current_layout(self, job_id: str) -> Layout | None:
        """The highest-versioned layout, or None before the first one is recorded."""
        with self._read() as s:
            self._job(s, job_id)
            row = s.scalar(
                select(LayoutRow)
                .where(LayoutRow.job_id == job_id)
                .order_by(LayoutRow.version.desc())
                .limit(1)
            )
            return None if row is None else Layout.model_validate_json(row.layout_json)

    def layouts(self, job_id: str) -> list[tuple[Layout, str, datetime]]:
        """Every recorded layout with its reason and time, by version."""
        with self._read() as s:
            self._job(s, job_id)
            rows = s.scalars(
                select(LayoutRow).where(LayoutRow.job_id == job_id).order_by(LayoutRow.version)
            )
            return [
                (Layout.model_validate_json(r.layout_json), r.reason, r.created_at) for r in rows
            ]

    # ---- metrics and evaluations

    def add_metrics(self, job_id: str, rows: Sequence[dict[str, Any]]) -> int:
        """Append training metrics (step, epoch, loss, samples_per_s, lr, time) in one
        transaction. Steps already stored (or repeated in `rows`) are skipped; returns the
        number of rows inserted. Non-finite loss/samples_per_s are stored as NULL."""
        try:
            parsed = _metric_rows.validate_python(list(rows))
        except ValidationError as err:
            raise ValueError(f"invalid metrics: {_problems(err, 'rows')}") from None
        by_step: dict[int, _MetricRow] = {}
        for r in parsed:
            by_step.setdefault(r.step, r)
        with self._write() as s:
            self._job(s, job_id)
            if not by_step:
                return 0
            existing: set[int] = set()
            steps = sorted(by_step)
            for i in range(0, len(steps), 500):  # keep under bind-parameter limits
                chunk = steps[i : i + 500]
                existing.update(
                    s.scalars(
                        select(Metric.step).where(Metric.job_id == job_id, Metric.step.in_(chunk))
                    )
                )
            new = [
                {
                    "job_id": job_id,
                    "step": r.step,
                    "epoch": r.epoch,
                    "loss": r.loss,
                    "samples_per_s": r.samples_per_s,
                    "lr": r.lr,
                    "time": _from_unix(r.time),
                }
                for step, r in sorted(by_step.items())
                if step not in existing
            ]
            if new:
                s.execute(insert(Metric), new)
            return len(new)

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        """Training metrics ordered by step; `time` in unix seconds."""
        with self._read() as s:
            self._job(s, job_id)
            rows = s.scalars(select(Metric).where(Metric.job_id == job_id).order_by(Metric.step))
            return [
                {
                    "step": m.step,
                    "epoch": m.epoch,
                    "loss": m.loss,
                    "samples_per_s": m.samples_per_s,
                    "lr": m.lr,
                    "time": _unix(m.time),
                }
                for m in rows
            ]

    def add_evaluation(
        self,
        job_id: str,
        epoch: int,
        step: int,
        accuracy: float,
        loss: float | None,
        time: float,
    ) -> bool:
        """Record a held-out evaluation (accuracy as a fraction 0..1). A step already evaluated
        is skipped (returns False). The job's `accuracy` becomes that of its latest step."""
        if not (isinstance(accuracy, int | float) and 0.0 <= accuracy <= 1.0):
            raise ValueError(f"accuracy must be a fraction in [0, 1], got {accuracy!r}")
        if step < 0 or epoch < 0:
            raise ValueError(f"epoch and step must be >= 0, got epoch={epoch}, step={step}")
        if not math.isfinite(time):
            raise ValueError(f"time must be finite unix seconds, got {time!r}")
        with self._write() as s:
            job = self._job(s, job_id)
            exists = s.scalar(
                select(Evaluation.id).where(Evaluation.job_id == job_id, Evaluation.step == step)
            )
            if exists is not None:
                return False
            s.add(
                Evaluation(
                    job_id=job_id,
                    epoch=epoch,
                    step=step,
                    accuracy=float(accuracy),
                    loss=_finite_or_none(loss),
                    time=_from_unix(time),
                )
            )
            s.flush()
            # Out-of-order arrivals must not overwrite a later step's accuracy.
            job.accuracy = s.scalar(
                select(Evaluation.accuracy)
                .where(Evaluation.job_id == job_id)
                .order_by(Evaluation.step.desc())
                .limit(1)
            )
            job.updated_at = utcnow()
            return True

    def evaluations(self, job_id: str) -> list[dict[str, Any]]:
        """Held-out evaluations ordered by step; `time` in unix seconds."""
        with self._read() as s:
            self._job(s, job_id)
            rows = s.scalars(
                select(Evaluation).where(Evaluation.job_id == job_id).order_by(Evaluation.step)
            )
            return [
                {
                    "epoch": e.epoch,
                    "step": e.step,
                    "accuracy": e.accuracy,
                    "loss": e.loss,
                    "time": _unix(e.time),
                }
                for e in rows
            ]

    # ---- checkpoints

    def commit_checkpoint(
        self,
        job_id: str,
        *,
        step: int,
        epoch: int,
        layout_version: int,
        path: str,
        size_bytes: int,
        checksum: str,
        samples_consumed: int,
    ) -> int:
        """Mark a fully written checkpoint usable; returns its id.

        Idempotent on (job, step): committing the same step again returns the same id, with the
        row updated to describe what is now on disk (a step re-reached after recovery rewrites
        the same directory) and its state back to "committed".
        """
        if not path:
            raise ValueError("checkpoint path must not be empty")
        if not checksum:
            raise ValueError("checkpoint checksum must not be empty")
        for name, value in (
            ("step", step),
            ("epoch", epoch),
            ("size_bytes", size_bytes),
            ("samples_consumed", samples_consumed),
        ):
            if value < 0:
                raise ValueError(f"checkpoint {name} must be >= 0, got {value}")
        values = {
            "epoch": epoch,
            "layout_version": layout_version,
            "path": str(path),
            "size_bytes": size_bytes,
            "checksum": checksum,
            "samples_consumed": samples_consumed,
            "state": "committed",
        }
        with self._write() as s:
            self._job(s, job_id)
            row = s.scalar(
                select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
            )
            if row is None:
                row = Checkpoint(job_id=job_id, step=step, created_at=utcnow(), **values)
                s.add(row)
            else:
                changed = any(getattr(row, k) != v for k, v in values.items())
                for k, v in values.items():
                    setattr(row, k, v)
                if changed:
                    row.created_at = utcnow()
            s.flush()
            return row.id

    def checkpoints(self, job_id: str, state: str | None = "committed") -> list[CheckpointInfo]:
        """The job's checkpoints in `state` (all if None), newest (highest step) first."""
        if state is not None:
            _check_state("checkpoint", state, CHECKPOINT_STATES)
        with self._read() as s:
            self._job(s, job_id)
            q = select(Checkpoint).where(Checkpoint.job_id == job_id)
            if state is not None:
                q = q.where(Checkpoint.state == state)
            rows = s.scalars(q.order_by(Checkpoint.step.desc()))
            return [CheckpointInfo._from_row(r) for r in rows]

    def latest_checkpoint(self, job_id: str) -> CheckpointInfo | None:
        """The newest committed checkpoint, the one to resume from."""
        found = self.checkpoints(job_id, "committed")
        return found[0] if found else None

    def set_checkpoint_state(self, checkpoint_id: int, state: str) -> None:
        """Mark a checkpoint deleted (pruned) or corrupt (failed verification), or committed."""
        _check_state("checkpoint", state, CHECKPOINT_STATES)
        with self._write() as s:
            row = s.get(Checkpoint, checkpoint_id)
            if row is None:
                raise NotFound(f"no checkpoint with id {checkpoint_id}")
            row.state = state

    # ---- events

    def add_event(
        self,
        job_id: str,
        kind: str,
        message: str,
        rank: int | None = None,
        data: dict[str, Any] | None = None,
        time: float | None = None,
    ) -> None:
        """Append to the job's event log (`time`: unix seconds, default now)."""
        if not kind or len(kind) > 32:
            raise ValueError(f"event kind {kind!r} must be 1-32 characters")
        try:
            data_json = None if data is None else json.dumps(_json_safe(data), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"event data must be JSON-serialisable: {exc}") from None
        when = utcnow() if time is None else _from_unix(time)
        with self._write() as s:
            self._job(s, job_id)
            s.add(
                Event(
                    job_id=job_id,
                    time=when,
                    kind=kind,
                    rank=rank,
                    message=message,
                    data_json=data_json,
                )
            )

    def events(self, job_id: str, limit: int = 100) -> list[dict[str, Any]]:
        """The job's most recent events, newest first; `time` in unix seconds."""
        with self._read() as s:
            self._job(s, job_id)
            rows = s.scalars(
                select(Event)
                .where(Event.job_id == job_id)
                .order_by(Event.time.desc(), Event.id.desc())
                .limit(limit)
            )
            return [
                {
                    "id": e.id,
                    "time": _unix(e.time),
                    "kind": e.kind,
                    "rank": e.rank,
                    "message": e.message,
                    "data": None if e.data_json is None else json.loads(e.data_json),
                }
                for e in rows
            ]

    # ---- summary

    def status(self, job_id: str) -> dict[str, Any]:
        """A JSON-serialisable summary of one job (for the CLI and the dashboard header)."""
        with self._read() as s:
            job = JobInfo._from_row(self._job(s, job_id))
            layout_row = s.scalar(
                select(LayoutRow)
                .where(LayoutRow.job_id == job_id)
                .order_by(LayoutRow.version.desc())
                .limit(1)
            )
            ckpt = s.scalar(
                select(Checkpoint)
                .where(Checkpoint.job_id == job_id, Checkpoint.state == "committed")
                .order_by(Checkpoint.step.desc())
                .limit(1)
            )
            last = s.scalar(
                select(Metric).where(Metric.job_id == job_id).order_by(Metric.step.desc()).limit(1)
            )
        return {
            "id": job.id,
            "name": job.name,
            "state": job.state,
            "message": job.message,
            "epoch": job.epoch,
            "epochs": job.spec.training.epochs,
            "step": job.step,
            "samples_consumed": job.samples_consumed,
            "accuracy": job.accuracy,
            "lr": job.lr,
            "freeze_boundary": job.freeze_boundary,
            "layout_version": job.layout_version,
            "layout": None if layout_row is None else json.loads(layout_row.layout_json),
            "checkpoint": None if ckpt is None else {"path": ckpt.path, "step": ckpt.step},
            "last_metrics": None
            if last is None
            else {
                "step": last.step,
                "epoch": last.epoch,
                "loss": last.loss,
                "samples_per_s": last.samples_per_s,
                "lr": last.lr,
                "time": _unix(last.time),
            },
            "workdir": job.workdir,
            "created_at": job.created_at.isoformat(),
            "updated_at": job.updated_at.isoformat(),
        }
