"""The SQL store: the only API anything uses to read or write the job database.

One writer (the controller; the CLI for job creation and state changes) and any number of
readers (the dashboard, `pipetransformer status`). Every write method is one transaction and
validates its input before touching the database, so bad input raises and changes nothing.

Timestamps are timezone-aware UTC `datetime`s on the typed results (`JobInfo`,
`CheckpointInfo`, layouts); the row dicts (`metrics`, `evaluations`, `events`, `workers`) carry
times as unix seconds, the same shape the trainer reports them in, so they are JSON-ready.

SQLite (default, one file per run directory) and PostgreSQL (production) are both supported,
with the same migrations and tests. The schema is created and upgraded only by alembic
(`Store.open(url, migrate=True)`).

The database may be unreachable for a few seconds (a PostgreSQL restart or fail-over, a locked
SQLite file): every method retries such transient errors with backoff for up to `retry_s`
seconds (`Store.open(url, retry_s=30)`), logging each retry, then raises `StoreUnavailable`.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from time import monotonic, sleep
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from sqlalchemy import (
    Connection,
    Engine,
    ScalarSelect,
    Select,
    and_,
    case,
    create_engine,
    delete,
    event,
    func,
    insert,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

import migrations
from core.spec import MAX_CONTROL_EVERY, JobSpec
from core.state import Layout, TrainingState
from store.tables import (
    CHECKPOINT_STATES,
    CHECKSUM_MAX_CHARS,
    EVENT_KEY_MAX_CHARS,
    GENERATION_STATES,
    JOB_STATES,
    LEASE_STATES,
    WORKER_STATES,
    Checkpoint,
    Evaluation,
    Event,
    Generation,
    Job,
    LayoutRow,
    Metric,
    UTCDateTime,
    Worker,
    utcnow,
)

__all__ = [
    "CHECKPOINT_STATES",
    "GENERATION_STATES",
    "JOB_STATES",
    "LEASE_STATES",
    "WORKER_STATES",
    "CheckpointInfo",
    "JobExists",
    "JobInfo",
    "NotFound",
    "Store",
    "StoreConflict",
    "StoreUnavailable",
    "UnknownJob",
    "alembic_config",
    "is_transient",
    "make_engine",
    "sqlite_path",
    "sqlite_url",
]

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent
# The database URL when no --db is given (how containers pass it: from a Secret, never as an
# argument, which any process listing would show)
DB_ENV = "PIPETRANSFORMER_DB"
SQLITE_BUSY_TIMEOUT_MS = 10_000
# How long one Store call keeps retrying an unreachable database (Store(..., retry_s=...)).
DEFAULT_RETRY_S = 30.0
_RETRY_FIRST_DELAY_S = 0.05
_RETRY_MAX_DELAY_S = 2.0
# A connect attempt to an unreachable host must fail, not hang past the retry budget.
POSTGRES_CONNECT_TIMEOUT_S = 10
_MAX_LISTED_IDS = 20

log = logging.getLogger(__name__)
T = TypeVar("T")


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


class StoreUnavailable(ConnectionError):
    """The database stayed unreachable for longer than the store's `retry_s`.

    Raised from the transient error of the last try (`__cause__`). The write did not land,
    unless a try's commit reached the server just before the connection broke; every write is
    idempotent, so calling it again once the database is back is safe either way."""


# PostgreSQL SQLSTATEs worth retrying besides class 08 (connection exception): the server is
# shutting down or starting up (admin/crash shutdown, "cannot connect now"), or out of slots.
_PG_TRANSIENT_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})
_SQLITE_TRANSIENT_MESSAGES = ("database is locked", "database table is locked")
_NO_SQLSTATE = object()


def is_transient(exc: BaseException) -> bool:
    """Whether a database error is worth retrying: the connection was lost or refused, the
    server is restarting, or SQLite's file is locked past its busy timeout. Constraint
    violations, read-only refusals, bad SQL and the like are not."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    if not isinstance(exc, OperationalError):
        return False
    orig = exc.orig
    if any(m in str(orig).lower() for m in _SQLITE_TRANSIENT_MESSAGES):
        return True
    # psycopg 3 names it `sqlstate`, psycopg2 `pgcode`; other drivers have neither.
    code = getattr(orig, "sqlstate", getattr(orig, "pgcode", _NO_SQLSTATE))
    if code is _NO_SQLSTATE:
        return False
    # No SQLSTATE means the client gave up on the connection (refused, reset, timed out).
    return code is None or code.startswith("08") or code in _PG_TRANSIENT_SQLSTATES


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# --------------------------------------------------------------------------- results


class JobInfo(BaseModel):
    """A job row with its spec parsed. `freeze_boundary` is not stored with the job: it is
    that of the job's current (highest-versioned) layout, 0 before the first one."""

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
    def _from_row(cls, row: Job, layout_json: str | None) -> JobInfo:
        """`layout_json`: the job's current layout (`_current_layout_json`), None if none."""
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
            freeze_boundary=_boundary(layout_json),
            layout_version=row.layout_version,
            accuracy=row.accuracy,
        )


def _current_layout_json(job_id: Any) -> ScalarSelect[str]:
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
    grad_norms: list[float | None] | None = None  # one per block
    mfu: float | None = None  # model FLOPs utilisation, a fraction
    peak_memory_mib: list[float | None] | None = None  # one per rank (index = rank)

    @field_validator("loss", "samples_per_s")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return _finite_or_none(value)

    @field_validator("mfu")
    @classmethod
    def _utilisation(cls, value: float | None) -> float | None:
        # unknown rather than wrong: a negative or non-finite utilisation is stored as NULL
        value = _finite_or_none(value)
        return value if value is not None and value >= 0 else None

    @field_validator("grad_norms")
    @classmethod
    def _norms(cls, value: list[float | None] | None) -> list[float | None] | None:
        if value is None:
            return None
        for i, n in enumerate(value):
            if n is not None and n < 0:  # NaN compares False: it becomes null below
                raise ValueError(f"grad_norms[{i}] is a norm and cannot be negative, got {n}")
        return [_finite_or_none(n) for n in value]

    @field_validator("peak_memory_mib")
    @classmethod
    def _peaks(cls, value: list[float | None] | None) -> list[float | None] | None:
        if value is None:
            return None
        for i, m in enumerate(value):
            if m is not None and m < 0:  # NaN compares False: it becomes null below
                raise ValueError(
                    f"peak_memory_mib[{i}] is an amount of memory and cannot be negative, got {m}"
                )
        return [_finite_or_none(m) for m in value]


_metric_rows = TypeAdapter(list[_MetricRow])


class _WorkerMember(BaseModel):
    """A rank of a generation as its join request names it (`Store.add_workers`)."""

    model_config = ConfigDict(extra="forbid")

    rank: StrictInt = Field(ge=0)
    node: str  # "host:agent-pid"; "" when the join request did not name it
    pid: StrictInt | None = Field(default=None, ge=0)
    host: str | None = None


_worker_members = TypeAdapter(list[_WorkerMember])


class _WorkerUpdate(BaseModel):
    """What `Store.update_workers` may set; fields not passed are left alone."""

    model_config = ConfigDict(extra="forbid")

    host: str | None = None
    pid: StrictInt | None = Field(default=None, ge=0)
    stages: list[StrictInt] | None = None
    replica: StrictInt | None = Field(default=None, ge=0)
    log: str | None = None
    started_at: float | None = Field(default=None, allow_inf_nan=False)  # unix seconds
    state: str | None = None
    lease: str | None = None
    exit_code: StrictInt | None = None
    signal: StrictInt | None = Field(default=None, ge=1)
    detail: str | None = None

    @field_validator("stages")
    @classmethod
    def _stages(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(i < 0 for i in value):
            raise ValueError(f"stage indices must be >= 0, got {value}")
        return value

    @field_validator("state")
    @classmethod
    def _state(cls, value: str | None) -> str:
        if value not in WORKER_STATES:
            raise ValueError(f"{value!r} is not one of {', '.join(WORKER_STATES)}")
        return value

    @field_validator("lease")
    @classmethod
    def _lease(cls, value: str | None) -> str:
        if value not in LEASE_STATES:
            raise ValueError(f"{value!r} is not one of {', '.join(LEASE_STATES)}")
        return value

    def columns(self) -> dict[str, Any]:
        """The `workers` columns to set, from the fields the caller passed."""
        out: dict[str, Any] = {}
        for name in self.model_fields_set:
            value = getattr(self, name)
            if name == "stages":
                out["stages_json"] = None if value is None else json.dumps(value)
            elif name == "started_at":
                out["started_at"] = None if value is None else _from_unix(value)
            else:
                out[name] = value
        return out


def _worker_dict(w: Worker) -> dict[str, Any]:
    return {
        "generation": w.generation,
        "rank": w.rank,
        "node": w.node,
        "host": w.host,
        "pid": w.pid,
        "stages": None if w.stages_json is None else json.loads(w.stages_json),
        "replica": w.replica,
        "log": w.log,
        "assigned_at": _unix(w.assigned_at),
        "started_at": None if w.started_at is None else _unix(w.started_at),
        "last_report_at": None if w.last_report_at is None else _unix(w.last_report_at),
        "lease": w.lease,
        "state": w.state,
        "exit_code": w.exit_code,
        "signal": w.signal,
        "detail": w.detail,
    }


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


def _finite_time(t: Any, name: str) -> float:
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        raise ValueError(f"{name} must be finite unix seconds, got {t!r}")
    return float(t)


def _ranks(ranks: Sequence[int]) -> list[int]:
    if isinstance(ranks, str) or not all(
        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks
    ):
        raise ValueError(f"ranks must be integers >= 0, got {ranks!r}")
    return sorted(set(ranks))


def _from_unix(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


# How far back (in metric rows) `latest_peak_memory` looks: workers send peaks at every control
# point, at most MAX_CONTROL_EVERY steps apart, so a job still reporting them has one in there;
# the bound keeps a long CPU job (no peaks at all) from scanning every row it ever stored.
PEAK_LOOKBACK_STEPS = MAX_CONTROL_EVERY


def _latest_peak(s: Session, job_id: str) -> dict[str, Any] | None:
    newest = (
        select(Metric.step, Metric.peak_memory_mib)
        .where(Metric.job_id == job_id)
        .order_by(Metric.step.desc())
        .limit(PEAK_LOOKBACK_STEPS)
        .subquery()
    )
    row = s.execute(
        select(newest.c.step, newest.c.peak_memory_mib)
        .where(newest.c.peak_memory_mib.is_not(None))
        .order_by(newest.c.step.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    return {"step": row.step, "peak_memory_mib": json.loads(row.peak_memory_mib)}


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
    """An engine for `url` with the settings the store relies on (SQLite pragmas, pooling,
    PostgreSQL connection checks). A plain `postgresql://` URL uses psycopg 3.

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
    if u.drivername == "postgresql":
        # SQLAlchemy's default PostgreSQL driver is psycopg2; this project ships psycopg 3.
        u = u.set(drivername="postgresql+psycopg")
    if u.get_driver_name() in ("psycopg", "psycopg2") and "connect_timeout" not in u.query:
        u = u.update_query_dict({"connect_timeout": str(POSTGRES_CONNECT_TIMEOUT_S)})
    # pre_ping: after a server restart the pool's connections are dead; test before use.
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
    """Typed access to the job database. Construct with `Store.open(url)` to migrate first.

    Every public method is one transaction. A transaction that fails because the database is
    unreachable for a moment (server restarting, network blip, SQLite "database is locked") is
    retried with exponential backoff until `retry_s` seconds have passed since its first try,
    each retry logged as a warning; after that it raises `StoreUnavailable`. Every write is safe
    to run twice (the retry of a commit whose acknowledgement was lost finds its own row and
    stops), so a retried write lands exactly once and returns what its landed try would have.
    That relies on the store's single writer: no one else inserts the same rows meanwhile.
    """

    def __init__(self, url: str, read_only: bool = False, retry_s: float = DEFAULT_RETRY_S) -> None:
        """Connect to `url` without touching the schema. `read_only` (the dashboard) makes
        every write method raise PermissionError and the connection itself refuse writes.
        `retry_s` bounds how long one call keeps retrying transient errors (0: no retry)."""
        if not retry_s >= 0:
            raise ValueError(f"retry_s must be >= 0 seconds, got {retry_s!r}")
        self.url = url
        self.read_only = read_only
        self.retry_s = float(retry_s)
        # outages ridden out inside one call, (what, seconds): the caller reports them
        self.recoveries: collections.deque[tuple[str, float]] = collections.deque(maxlen=100)
        self._engine = make_engine(url, read_only=read_only)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    @classmethod
    def open(cls, url: str, migrate: bool = True, retry_s: float = DEFAULT_RETRY_S) -> Store:
        """Connect, and (by default) upgrade the schema to the newest alembic revision."""
        store = cls(url, retry_s=retry_s)
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

        def upgrade() -> None:
            # One transaction: PostgreSQL's DDL is transactional, so a retry starts clean.
            with self._engine.begin() as conn:
                command.upgrade(alembic_config(connection=conn), revision)

        self._retrying("migrate", upgrade)

    def revision(self) -> str | None:
        """The schema's alembic revision; None for a database without the schema."""

        def current() -> str | None:
            with self._engine.connect() as conn:
                return MigrationContext.configure(conn).get_current_revision()

        return self._retrying("revision", current)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({make_url(self.url).render_as_string(hide_password=True)!r})"

    # ---- plumbing

    def _retrying(self, what: str, attempt: Callable[[], T]) -> T:
        """Run `attempt` until it succeeds, it fails with a non-transient error, or `retry_s`
        seconds have passed (then StoreUnavailable, chained to the last error)."""
        started = monotonic()
        delay = _RETRY_FIRST_DELAY_S
        tries = 1
        while True:
            try:
                result = attempt()
                if tries > 1:
                    self.recoveries.append((what, monotonic() - started))
                return result
            except DBAPIError as exc:
                if not is_transient(exc):
                    raise
                waited = monotonic() - started
                left = self.retry_s - waited
                reason = _first_line(exc.orig if exc.orig is not None else exc)
                if left <= 0:
                    raise StoreUnavailable(
                        f"{self!r}: {what} failed: the database stayed unreachable for "
                        f"{waited:.1f}s ({tries} tries, retry_s={self.retry_s:g}); "
                        f"last error: {reason}"
                    ) from exc
                pause = min(delay, left)
                log.warning(
                    "%r: %s failed (try %d, %s); retrying in %.2fs, giving up in %.1fs",
                    self,
                    what,
                    tries,
                    reason,
                    pause,
                    left,
                )
                sleep(pause)
                delay = min(delay * 2, _RETRY_MAX_DELAY_S)
                tries += 1

    def _write(self, what: str, tx: Callable[[Session], T]) -> T:
        """Run `tx` in one write transaction (committed on return), retrying transient
        failures. `tx` must be safe to run again after a commit whose outcome was lost."""
        if self.read_only:
            raise PermissionError(f"{self!r} is open read-only")

        def attempt() -> T:
            with self._sessions.begin() as session:
                return tx(session)

        return self._retrying(what, attempt)

    def _read(self, what: str, tx: Callable[[Session], T]) -> T:
        def attempt() -> T:
            with self._sessions() as session:
                return tx(session)

        return self._retrying(what, attempt)

    def _job(self, session: Session, job_id: str) -> Job:
        job = session.get(Job, job_id)
        if job is None:
            raise self._unknown(session, job_id)
        return job

    def _unknown(self, session: Session, job_id: str) -> UnknownJob:
        known = session.scalars(select(Job.id).order_by(Job.created_at.desc(), Job.id))
        return UnknownJob(job_id, list(known))

    def _job_infos(self, session: Session, query: Select[tuple[Job]]) -> list[JobInfo]:
        """The jobs `query` selects, each with its current layout read in the same query."""
        rows = session.execute(query.add_columns(_current_layout_json(Job.id)))
        return [JobInfo._from_row(job, layout_json) for job, layout_json in rows]

    # ---- jobs

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
            found = self._job_infos(s, select(Job).where(Job.id == job_id))
            if not found:
                raise self._unknown(s, job_id)
            return found[0]

        return self._read("get_job", tx)

    def list_jobs(self) -> list[JobInfo]:
        """All jobs, newest first (one query, whatever their number)."""

        def tx(s: Session) -> list[JobInfo]:
            return self._job_infos(s, select(Job).order_by(Job.created_at.desc(), Job.id.desc()))

        return self._read("list_jobs", tx)

    def set_job_state(self, job_id: str, state: str, message: str | None = None) -> None:
        """Move a job to `state`; `message` replaces the previous one (None clears it)."""
        _check_state("job", state, JOB_STATES)

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

    # ---- generations

    def start_generation(self, job_id: str, world_size: int) -> int:
        """Open the job's next generation (numbered from 1) in state "running"."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        started = utcnow()  # this call's identity across retries

        def tx(s: Session) -> int:
            self._job(s, job_id)
            mine = s.scalar(
                select(Generation.number).where(
                    Generation.job_id == job_id,
                    Generation.started_at == started,
                    Generation.world_size == world_size,
                )
            )
            if mine is not None:
                return mine  # an earlier try of this call committed
            last = s.scalar(select(func.max(Generation.number)).where(Generation.job_id == job_id))
            number = (last or 0) + 1
            s.add(
                Generation(
                    job_id=job_id,
                    number=number,
                    world_size=world_size,
                    state="running",
                    started_at=started,
                    ended_at=None,
                )
            )
            return number

        return self._write("start_generation", tx)

    def end_generation(
        self, job_id: str, number: int, state: str, reason: str | None = None
    ) -> None:
        """Close a generation in `state`, saying why (`reason`) when there is more to say than
        the state."""
        ended = tuple(g for g in GENERATION_STATES if g != "running")
        _check_state("generation end", state, ended)

        def tx(s: Session) -> None:
            gen = self._generation(s, job_id, number)
            gen.state = state
            gen.ended_at = utcnow()
            if reason is not None:
                gen.reason = reason

        self._write("end_generation", tx)

    def explain_generation(self, job_id: str, number: int, reason: str) -> None:
        """Replace a generation's end reason: what ended it is sometimes learnt after it ended
        (a dead process's exit status or lapsed lease arrives after its peers' reports)."""

        def tx(s: Session) -> None:
            self._generation(s, job_id, number).reason = reason

        self._write("explain_generation", tx)

    def _generation(self, s: Session, job_id: str, number: int) -> Generation:
        self._job(s, job_id)
        gen = s.scalar(
            select(Generation).where(Generation.job_id == job_id, Generation.number == number)
        )
        if gen is None:
            raise NotFound(f"job {job_id!r} has no generation {number}")
        return gen

    def generations(self, job_id: str) -> list[dict[str, Any]]:
        """The job's generations, oldest first."""

        def tx(s: Session) -> list[dict[str, Any]]:
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
                    "reason": g.reason,
                }
                for g in rows
            ]

        return self._read("generations", tx)

    # ---- layouts

    def record_layout(self, job_id: str, layout: Layout, reason: str) -> None:
        """Store `layout` under its version. Recording the same layout again is a no-op; a
        different layout under an existing version raises StoreConflict."""

        def tx(s: Session) -> None:
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

        self._write("record_layout", tx)

    def current_layout(self, job_id: str) -> Layout | None:
        """The highest-versioned layout, or None before the first one is recorded."""

        def tx(s: Session) -> Layout | None:
            self._job(s, job_id)
            row = s.scalar(
                select(LayoutRow)
                .where(LayoutRow.job_id == job_id)
                .order_by(LayoutRow.version.desc())
                .limit(1)
            )
            return None if row is None else Layout.model_validate_json(row.layout_json)

        return self._read("current_layout", tx)

    def layouts(self, job_id: str) -> list[tuple[Layout, str, datetime]]:
        """Every recorded layout with its reason and time, by version."""

        def tx(s: Session) -> list[tuple[Layout, str, datetime]]:
            self._job(s, job_id)
            rows = s.scalars(
                select(LayoutRow).where(LayoutRow.job_id == job_id).order_by(LayoutRow.version)
            )
            return [
                (Layout.model_validate_json(r.layout_json), r.reason, r.created_at) for r in rows
            ]

        return self._read("layouts", tx)

    # ---- metrics and evaluations

    def add_metrics(self, job_id: str, rows: Sequence[dict[str, Any]]) -> int:
        """Append training metrics (step, epoch, loss, samples_per_s, lr, time) in one
        transaction. Steps already stored (or repeated in `rows`) are skipped; returns the
        number of rows inserted. Non-finite loss/samples_per_s are stored as NULL.

        A row may carry `grad_norms`: one gradient norm per block (>= 0; a non-finite one is
        stored as null in the list), or None; `mfu`: model FLOPs utilisation as a fraction
        (stored as NULL unless finite and >= 0), or None; `peak_memory_mib`: peak GPU memory
        allocated per rank in MiB (index = rank; >= 0, a non-finite one null in the list), or
        None. A negative norm or memory raises ValueError naming the row and field, and nothing
        of the batch is stored."""
        try:
            parsed = _metric_rows.validate_python(list(rows))
        except ValidationError as err:
            raise ValueError(f"invalid metrics: {_problems(err, 'rows')}") from None
        by_step: dict[int, _MetricRow] = {}
        for r in parsed:
            by_step.setdefault(r.step, r)
        tried: set[int] = set()  # steps an earlier try of this call inserted (may have landed)

        def tx(s: Session) -> int:
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
                    "grad_norms": None if r.grad_norms is None else json.dumps(r.grad_norms),
                    "mfu": r.mfu,
                    "peak_memory_mib": None
                    if r.peak_memory_mib is None
                    else json.dumps(r.peak_memory_mib),
                }
                for step, r in sorted(by_step.items())
                if step not in existing
            ]
            ours = len(existing & tried)  # landed by a try whose acknowledgement was lost
            tried.update(row["step"] for row in new)
            # The ORM leaves None columns out of a row's INSERT and batches runs of rows with
            # the same columns: peak memory on every control_every_steps-th step only would
            # split a drain into a statement per step or so. Rows with the same missing columns
            # together (stable: step order within each) keep it to one per kind of row.
            new.sort(key=lambda row: tuple(v is None for v in row.values()))
            if new:
                s.execute(insert(Metric), new)
            return len(new) + ours

        return self._write("add_metrics", tx)

    def metrics(self, job_id: str, last: int | None = None) -> list[dict[str, Any]]:
        """Training metrics ordered by step; `time` in unix seconds; `grad_norms` the per-block
        gradient norms (None where a norm was not finite), or None (not reported, or a row
        stored before revision 0005); `mfu` (a fraction) and `peak_memory_mib` (per rank, MiB;
        only on steps at control points) or None where unknown (the CPU, an older worker, a row
        stored before revision 0006). `last`: only the newest that many steps (a display that
        needs the latest rate need not read a long job's every row)."""
        if last is not None and last < 1:
            raise ValueError(f"last must be >= 1 (or None for every row), got {last}")

        def tx(s: Session) -> list[dict[str, Any]]:
            self._job(s, job_id)
            q = select(Metric).where(Metric.job_id == job_id)
            if last is None:
                rows = list(s.scalars(q.order_by(Metric.step)))
            else:
                rows = list(s.scalars(q.order_by(Metric.step.desc()).limit(last)))[::-1]
            return [
                {
                    "step": m.step,
                    "epoch": m.epoch,
                    "loss": m.loss,
                    "samples_per_s": m.samples_per_s,
                    "lr": m.lr,
                    "time": _unix(m.time),
                    "grad_norms": None if m.grad_norms is None else json.loads(m.grad_norms),
                    "mfu": m.mfu,
                    "peak_memory_mib": None
                    if m.peak_memory_mib is None
                    else json.loads(m.peak_memory_mib),
                }
                for m in rows
            ]

        return self._read("metrics", tx)

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
        tried = False  # an earlier try of this call inserted it (its commit may have landed)

        def tx(s: Session) -> bool:
            nonlocal tried
            job = self._job(s, job_id)
            exists = s.scalar(
                select(Evaluation.id).where(Evaluation.job_id == job_id, Evaluation.step == step)
            )
            if exists is not None:
                return tried
            tried = True
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

        return self._write("add_evaluation", tx)

    def evaluations(self, job_id: str) -> list[dict[str, Any]]:
        """Held-out evaluations ordered by step; `time` in unix seconds."""

        def tx(s: Session) -> list[dict[str, Any]]:
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

        return self._read("evaluations", tx)

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
        if not checksum or len(checksum) > CHECKSUM_MAX_CHARS:
            # PostgreSQL enforces the column width; SQLite would silently store anything.
            raise ValueError(f"checkpoint checksum must be 1-{CHECKSUM_MAX_CHARS} characters")
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

        def tx(s: Session) -> int:
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

        return self._write("commit_checkpoint", tx)

    def checkpoints(self, job_id: str, state: str | None = "committed") -> list[CheckpointInfo]:
        """The job's checkpoints in `state` (all if None), newest (highest step) first."""
        if state is not None:
            _check_state("checkpoint", state, CHECKPOINT_STATES)

        def tx(s: Session) -> list[CheckpointInfo]:
            self._job(s, job_id)
            q = select(Checkpoint).where(Checkpoint.job_id == job_id)
            if state is not None:
                q = q.where(Checkpoint.state == state)
            rows = s.scalars(q.order_by(Checkpoint.step.desc()))
            return [CheckpointInfo._from_row(r) for r in rows]

        return self._read("checkpoints", tx)

    def latest_checkpoint(self, job_id: str) -> CheckpointInfo | None:
        """The newest committed checkpoint, the one to resume from."""
        found = self.checkpoints(job_id, "committed")
        return found[0] if found else None

    def set_checkpoint_state(self, checkpoint_id: int, state: str) -> None:
        """Mark a checkpoint deleted (pruned) or corrupt (failed verification), or committed."""
        _check_state("checkpoint", state, CHECKPOINT_STATES)

        def tx(s: Session) -> None:
            row = s.get(Checkpoint, checkpoint_id)
            if row is None:
                raise NotFound(f"no checkpoint with id {checkpoint_id}")
            row.state = state

        self._write("set_checkpoint_state", tx)

    # ---- events

    def add_event(
        self,
        job_id: str,
        kind: str,
        message: str,
        rank: int | None = None,
        data: dict[str, Any] | None = None,
        time: float | None = None,
        key: str | None = None,
    ) -> bool:
        """Append to the job's event log (`time`: unix seconds, default now).

        `key` makes the event idempotent: an event whose key the job already has is skipped
        (returns False). Pass a stable key (e.g. the etcd key of a worker report) when the same
        event may be recorded again after a crash; without one, each call gets a fresh key, so
        a retried commit still records it exactly once.
        """
        if not kind or len(kind) > 32:
            raise ValueError(f"event kind {kind!r} must be 1-32 characters")
        if key is not None and not 1 <= len(key) <= EVENT_KEY_MAX_CHARS:
            raise ValueError(f"event key must be 1-{EVENT_KEY_MAX_CHARS} characters")
        try:
            data_json = None if data is None else json.dumps(_json_safe(data), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"event data must be JSON-serialisable: {exc}") from None
        when = utcnow() if time is None else _from_unix(time)
        dedup_key = key if key is not None else f"auto:{uuid.uuid4().hex}"
        tried = False  # an earlier try of this call inserted it (its commit may have landed)

        def tx(s: Session) -> bool:
            nonlocal tried
            self._job(s, job_id)
            seen = s.scalar(
                select(Event.id).where(Event.job_id == job_id, Event.dedup_key == dedup_key)
            )
            if seen is not None:
                return tried
            tried = True
            s.add(
                Event(
                    job_id=job_id,
                    time=when,
                    kind=kind,
                    rank=rank,
                    message=message,
                    data_json=data_json,
                    dedup_key=dedup_key,
                )
            )
            return True

        return self._write("add_event", tx)

    def events(
        self, job_id: str, limit: int = 100, kinds: Sequence[str] | None = None
    ) -> list[dict[str, Any]]:
        """The job's most recent events, newest first; `time` in unix seconds. `kinds`: only
        events of these kinds (e.g. `["freeze_requested"]`); None for all."""
        if isinstance(kinds, str):  # "freeze" would otherwise mean the kinds f, r, e, ...
            raise ValueError(f"kinds must be a sequence of event kinds, not the string {kinds!r}")
        wanted = None if kinds is None else list(kinds)

        def tx(s: Session) -> list[dict[str, Any]]:
            self._job(s, job_id)
            q = select(Event).where(Event.job_id == job_id)
            if wanted is not None:
                q = q.where(Event.kind.in_(wanted))
            rows = s.scalars(q.order_by(Event.time.desc(), Event.id.desc()).limit(limit))
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

        return self._read("events", tx)

    # ---- workers

    def add_workers(
        self,
        job_id: str,
        generation: int,
        members: Sequence[Mapping[str, Any]],
        time: float | None = None,
    ) -> int:
        """Record the ranks of a generation as its join request names them, in state "assigned"
        with lease "unknown": `members` are dicts with `rank`, `node` ("host:agent-pid"), and
        optionally `pid` and `host`. `time` (unix seconds, default now) is `assigned_at`.

        Ranks already recorded for the generation are left as they are (a restarted controller
        re-adds them), so this is idempotent; returns the number of rows inserted. Raises
        NotFound if the job has no such generation."""
        try:
            parsed = _worker_members.validate_python(list(members))
        except ValidationError as err:
            raise ValueError(f"invalid workers: {_problems(err, 'members')}") from None
        seen: set[int] = set()
        for i, m in enumerate(parsed):
            if m.rank in seen:
                raise ValueError(f"invalid workers: members[{i}].rank: rank {m.rank} repeated")
            seen.add(m.rank)
        when = utcnow() if time is None else _from_unix(_finite_time(time, "time"))
        tried: set[int] = set()  # ranks an earlier try of this call inserted (may have landed)

        def tx(s: Session) -> int:
            self._generation(s, job_id, generation)
            existing = set(
                s.scalars(
                    select(Worker.rank).where(
                        Worker.job_id == job_id, Worker.generation == generation
                    )
                )
            )
            new = [
                {
                    "job_id": job_id,
                    "generation": generation,
                    "rank": m.rank,
                    "node": m.node,
                    "host": m.host,
                    "pid": m.pid,
                    "assigned_at": when,
                    "lease": "unknown",
                    "state": "assigned",
                }
                for m in sorted(parsed, key=lambda m: m.rank)
                if m.rank not in existing
            ]
            ours = len(existing & tried)
            tried.update(row["rank"] for row in new)
            if new:
                s.execute(insert(Worker), new)
            return len(new) + ours

        return self._write("add_workers", tx)

    def update_workers(
        self, job_id: str, generation: int, ranks: Sequence[int], **fields: Any
    ) -> int:
        """Set the same `fields` on some ranks of a generation, in one statement: any of
        `host, pid, stages (list[int]), replica, log, started_at (unix seconds), state, lease,
        exit_code, signal, detail`; fields not passed are left alone, None clears a nullable one.
        Setting values is idempotent. Returns the number of rows matched: ranks (or a
        generation) without a row are skipped, not an error."""
        try:
            update_ = _WorkerUpdate.model_validate(fields)
        except ValidationError as err:
            raise ValueError(f"invalid worker update: {_problems(err, 'fields')}") from None
        values = update_.columns()
        if not values:
            raise ValueError("invalid worker update: no fields given")
        wanted = _ranks(ranks)

        def tx(s: Session) -> int:
            self._job(s, job_id)
            if not wanted:
                return 0
            result = s.execute(
                update(Worker)
                .where(
                    Worker.job_id == job_id,
                    Worker.generation == generation,
                    Worker.rank.in_(wanted),
                )
                .values(**values)
                .execution_options(synchronize_session=False)  # no rows loaded in this session
            )
            return result.rowcount  # type: ignore[attr-defined]

        return self._write("update_workers", tx)

    def touch_workers(self, job_id: str, times: Mapping[tuple[int, int], float]) -> None:
        """Advance `last_report_at` of several ranks in one statement: `times` maps (generation,
        rank) to the time of its newest report (unix seconds). A time never moves back (reports
        replayed after a controller restart, clocks of other hosts); ranks without a row are
        skipped."""
        pairs: list[tuple[int, int, datetime]] = []
        for key, t in times.items():
            if not (
                isinstance(key, tuple)
                and len(key) == 2
                and all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in key)
            ):
                raise ValueError(f"invalid worker times: key {key!r} is not (generation, rank)")
            pairs.append((key[0], key[1], _from_unix(_finite_time(t, f"times[{key!r}]"))))

        def tx(s: Session) -> None:
            self._job(s, job_id)
            for i in range(0, len(pairs), 200):  # keep under bind-parameter limits
                chunk = pairs[i : i + 200]
                who = [and_(Worker.generation == g, Worker.rank == r) for g, r, _ in chunk]
                newer = [
                    and_(w, or_(Worker.last_report_at.is_(None), Worker.last_report_at < t))
                    for w, (_, _, t) in zip(who, chunk, strict=True)
                ]
                new_time = case(
                    *[
                        (w, literal(t, UTCDateTime()))
                        for w, (_, _, t) in zip(who, chunk, strict=True)
                    ],
                    else_=Worker.last_report_at,
                )
                s.execute(
                    update(Worker)
                    .where(Worker.job_id == job_id, or_(*newer))
                    .values(last_report_at=new_time)
                    .execution_options(synchronize_session=False)
                )

        self._write("touch_workers", tx)

    def workers(self, job_id: str) -> list[dict[str, Any]]:
        """Every rank of every generation, by generation then rank: `generation, rank, node,
        host, pid, stages (list[int] | None), replica, log, assigned_at, started_at,
        last_report_at (unix seconds; the last two None until known), lease, state, exit_code,
        signal, detail`."""

        def tx(s: Session) -> list[dict[str, Any]]:
            self._job(s, job_id)
            rows = s.scalars(
                select(Worker)
                .where(Worker.job_id == job_id)
                .order_by(Worker.generation, Worker.rank)
            )
            return [_worker_dict(w) for w in rows]

        return self._read("workers", tx)

    def latest_peak_memory(self, job_id: str) -> dict[str, Any] | None:
        """The newest per-rank peak GPU memory a step carried: `{"step", "peak_memory_mib"}`
        (MiB, index = rank), or None where none of the newest `PEAK_LOOKBACK_STEPS` rows has one
        (a CPU job, an older worker). Workers send it only at control points, so the newest
        row rarely has it."""

        def tx(s: Session) -> dict[str, Any] | None:
            self._job(s, job_id)
            return _latest_peak(s, job_id)

        return self._read("latest_peak_memory", tx)

    # ---- summary

    def status(self, job_id: str) -> dict[str, Any]:
        """A JSON-serialisable summary of one job (for the CLI and the dashboard header).
        `mfu`: the newest step's model FLOPs utilisation (a fraction), `peak_memory_mib`: the
        newest per-rank peak GPU memory in MiB (`latest_peak_memory`); None where unknown."""

        def tx(
            s: Session,
        ) -> tuple[JobInfo, str | None, Checkpoint | None, Metric | None, dict[str, Any] | None]:
            row = self._job(s, job_id)
            layout_json = s.scalar(select(_current_layout_json(job_id)))
            job = JobInfo._from_row(row, layout_json)  # its boundary is that layout's
            ckpt = s.scalar(
                select(Checkpoint)
                .where(Checkpoint.job_id == job_id, Checkpoint.state == "committed")
                .order_by(Checkpoint.step.desc())
                .limit(1)
            )
            last = s.scalar(
                select(Metric).where(Metric.job_id == job_id).order_by(Metric.step.desc()).limit(1)
            )
            return job, layout_json, ckpt, last, _latest_peak(s, job_id)

        job, layout_json, ckpt, last, peak = self._read("status", tx)
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
            "layout": None if layout_json is None else json.loads(layout_json),
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
                "mfu": last.mfu,
            },
            "mfu": None if last is None else last.mfu,
            "peak_memory_mib": None if peak is None else peak["peak_memory_mib"],
            "workdir": job.workdir,
            "created_at": job.created_at.isoformat(),
            "updated_at": job.updated_at.isoformat(),
        }
