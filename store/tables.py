"""SQL schema of the store (SQLAlchemy 2 declarative models).

Only the `store` package uses these classes; everything else goes through `store.Store`. The
schema itself is created and changed by alembic (`migrations/`), never by `create_all`: the
revisions, applied in order, give exactly these models, and `alembic check` guards that they
stay in sync.

Portable on purpose (SQLite and PostgreSQL): no dialect-specific types, JSON kept as text,
timestamps as timezone-aware UTC datetimes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

JOB_STATES = ("pending", "running", "completed", "failed", "interrupted")
GENERATION_STATES = ("running", "completed", "failed", "aborted", "interrupted")
CHECKPOINT_STATES = ("committed", "deleted", "corrupt")
# A worker (one rank of one generation): assigned, then running once it reported `started`, then
# how it ended: done/stopped (the job's training ended as asked), left (a graceful leave or
# SIGTERM), aborted (the controller aborted its generation), or the post-mortem's verdict:
# failed (its own exception), died (an abnormal exit status), lost (its lease lapsed without a
# word), peer_lost (a peer of a collective went away).
WORKER_STATES = (
    "assigned",
    "running",
    "done",
    "stopped",
    "left",
    "aborted",
    "failed",
    "died",
    "lost",
    "peer_lost",
)
# Its presence key's lease as the controller saw it: not seen yet, held, gone without the rank
# saying goodbye (lapsed), or let go with a final report (released).
LEASE_STATES = ("unknown", "held", "lapsed", "released")
# Column widths the store validates against: PostgreSQL enforces them, SQLite does not.
CHECKSUM_MAX_CHARS = 128
EVENT_KEY_MAX_CHARS = 255

# Deterministic constraint names: alembic needs them to alter/drop constraints (SQLite batch
# mode recreates tables by name), and they keep `alembic check` stable across dialects.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_N_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored and returned as timezone-aware UTC.

    PostgreSQL keeps the zone (`timestamptz`); SQLite drops it, so values are normalised to UTC
    on the way in and tagged UTC on the way out. Naive datetimes are rejected rather than guessed.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware (UTC) datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _job_fk() -> Mapped[str]:
    # Every child row belongs to a job and goes with it.
    return mapped_column(String(64), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (CheckConstraint(_in("state", JOB_STATES), name="state"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    spec_json: Mapped[str] = mapped_column(Text)
    workdir: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    message: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)  # list order
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer, default=0)
    samples_consumed: Mapped[int] = mapped_column(Integer, default=0)
    lr: Mapped[float] = mapped_column(Float, default=0.0)
    # No freeze boundary (dropped in revision 0004): the job's latest layout owns it.
    layout_version: Mapped[int] = mapped_column(Integer, default=0)
    accuracy: Mapped[float | None] = mapped_column(Float)


class Generation(Base):
    """One incarnation of the worker group (a new one after every rendezvous/recovery)."""

    __tablename__ = "generations"
    __table_args__ = (
        UniqueConstraint("job_id", "number"),
        CheckConstraint(_in("state", GENERATION_STATES), name="state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    number: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # why it ended: which rank died and how, which only lost a peer (revision 0003)
    reason: Mapped[str | None] = mapped_column(Text)


class LayoutRow(Base):
    """A layout the job ran under. The highest version is the one in force, and its
    `freeze_boundary` is the job's."""

    __tablename__ = "layouts"
    __table_args__ = (UniqueConstraint("job_id", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    version: Mapped[int] = mapped_column(Integer)
    layout_json: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    step: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(Integer)
    # NULL when not finite (a diverged step): SQLite cannot store NaN.
    loss: Mapped[float | None] = mapped_column(Float)
    samples_per_s: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float] = mapped_column(Float)
    time: Mapped[datetime] = mapped_column(UTCDateTime())
    # the freeze boundary the step trained under, as the worker reported it (revision 0007;
    # NULL on rows written before it, whose boundary is derived from the layouts' times)
    frozen: Mapped[int | None] = mapped_column(Integer)
    # JSON list: one gradient norm per block, null where not finite (revision 0005; NULL on
    # rows written before it)
    grad_norms: Mapped[str | None] = mapped_column(Text)
    # model FLOPs utilisation, a fraction; NULL where unknown (the CPU, older workers, rows
    # written before revision 0006)
    mfu: Mapped[float | None] = mapped_column(Float)
    # JSON list: peak GPU memory allocated per rank in MiB (index = rank, null where a rank did
    # not say); NULL on steps between control points, on the CPU and before revision 0006
    peak_memory_mib: Mapped[str | None] = mapped_column(Text)


class Evaluation(Base):
    __tablename__ = "evaluations"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    epoch: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    accuracy: Mapped[float] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float)
    time: Mapped[datetime] = mapped_column(UTCDateTime())
    f1: Mapped[float | None] = mapped_column(Float)  # question answering


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("job_id", "step"),
        CheckConstraint(_in("state", CHECKPOINT_STATES), name="state"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    step: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(Integer)
    layout_version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[str] = mapped_column(String(CHECKSUM_MAX_CHARS))
    samples_consumed: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (
        # The dashboard and CLI read a job's most recent events.
        Index("ix_events_job_id_time", "job_id", "time"),
        # Recording an event again (a replayed worker report, a retried commit) is a no-op.
        UniqueConstraint("job_id", "dedup_key"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    time: Mapped[datetime] = mapped_column(UTCDateTime())
    kind: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int | None] = mapped_column(Integer)
    message: Mapped[str] = mapped_column(Text)
    data_json: Mapped[str | None] = mapped_column(Text)
    # NULL only on rows written before revision 0002 (several NULLs never collide).
    dedup_key: Mapped[str | None] = mapped_column(String(EVENT_KEY_MAX_CHARS))


class Worker(Base):
    """One rank of one generation: where it ran, what it ran, and how it ended (revision 0005).
    The controller writes it from the join request, the rank's reports, its presence lease and
    the post-mortem."""

    __tablename__ = "workers"
    __table_args__ = (
        UniqueConstraint("job_id", "generation", "rank"),
        CheckConstraint(_in("state", WORKER_STATES), name="state"),
        CheckConstraint(_in("lease", LEASE_STATES), name="lease"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    generation: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(Text)  # "host:agent-pid", from the join request
    host: Mapped[str | None] = mapped_column(Text)
    pid: Mapped[int | None] = mapped_column(Integer)
    stages_json: Mapped[str | None] = mapped_column(Text)  # JSON list of stage indices
    replica: Mapped[int | None] = mapped_column(Integer)
    log: Mapped[str | None] = mapped_column(Text)  # the file its stdout went to
    assigned_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    last_report_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    lease: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16))
    exit_code: Mapped[int | None] = mapped_column(Integer)
    signal: Mapped[int | None] = mapped_column(Integer)
    detail: Mapped[str | None] = mapped_column(Text)


class StageTime(Base):
    """Where one rank's time went over one reporting interval (`core.protocol.StageTimes`,
    revision 0009): the steps `from_step`+1 .. `to_step` under layout `layout_version`, on the
    rank's `stages` of `replica`; seconds per phase (`core.stage_times.PHASES`, one `<phase>_s`
    column each), the interval's wall time and how the phases were timed (`clock`)."""

    __tablename__ = "stage_times"
    __table_args__ = (
        # A report drained again (a replayed queue entry, a retried commit) is a no-op.
        UniqueConstraint("job_id", "generation", "rank", "to_step"),
        # Readers take a job's newest intervals (`Store.stage_times(last_intervals=...)`).
        Index("ix_stage_times_job_id_to_step", "job_id", "to_step"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    generation: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    time: Mapped[datetime] = mapped_column(UTCDateTime())  # the worker's, at the interval's end
    from_step: Mapped[int] = mapped_column(Integer)
    to_step: Mapped[int] = mapped_column(Integer)
    layout_version: Mapped[int] = mapped_column(Integer)
    stages: Mapped[str] = mapped_column(Text)  # JSON list of stage indices
    replica: Mapped[int] = mapped_column(Integer)
    wall_s: Mapped[float] = mapped_column(Float)
    forward_s: Mapped[float] = mapped_column(Float)
    backward_s: Mapped[float] = mapped_column(Float)
    pipeline_wait_s: Mapped[float] = mapped_column(Float)
    grad_sync_s: Mapped[float] = mapped_column(Float)
    optimizer_s: Mapped[float] = mapped_column(Float)
    frozen_prefix_s: Mapped[float] = mapped_column(Float)
    data_wait_s: Mapped[float] = mapped_column(Float)
    checkpoint_s: Mapped[float] = mapped_column(Float)
    evaluation_s: Mapped[float] = mapped_column(Float)
    other_s: Mapped[float] = mapped_column(Float)
    clock: Mapped[str] = mapped_column(String(8))  # 'cuda' (events on the device) or 'host'


class StepTraceRecord(Base):
    """One rank's traced step (`core.protocol.StepTrace`, revision 0009), answering a trace
    request: its spans as JSON (`core.stage_times.TraceSpan`, seconds from `started`, the
    rank's unix time at the step's start)."""

    __tablename__ = "step_traces"
    __table_args__ = (
        # a report drained again is a no-op
        UniqueConstraint("job_id", "request", "generation", "rank"),
        Index("ix_step_traces_job_id_request", "job_id", "request"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    request: Mapped[str] = mapped_column(String(64))
    generation: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    started: Mapped[float] = mapped_column(Float)  # unix seconds (microseconds matter here)
    time: Mapped[datetime] = mapped_column(UTCDateTime())  # the report's
    layout_version: Mapped[int] = mapped_column(Integer)
    stages: Mapped[str] = mapped_column(Text)  # JSON list of stage indices
    replica: Mapped[int] = mapped_column(Integer)
    spans: Mapped[str] = mapped_column(Text)  # JSON list of TraceSpan
    clock: Mapped[str] = mapped_column(String(8))


class FreezeSignalRecord(Base):
    """What the freeze policy read at one decision point (`core.protocol.FreezeSignal`,
    revision 0010): per block the statistic (`signal`) and the value at or below which the
    block counts as settled (`limits`), JSON lists with null where unknown; the boundary after
    the decision point and the automatic cap (`bound`); what reading it cost (`probe_s`)."""

    __tablename__ = "freeze_signals"
    __table_args__ = (
        # One decision point, one row: a recovery's retake replaces it by a higher generation
        # (`Store.add_freeze_signal`); its index serves the reads, by step.
        UniqueConstraint("job_id", "step"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = _job_fk()
    step: Mapped[int] = mapped_column(Integer)
    generation: Mapped[int] = mapped_column(Integer)  # of the report kept: the highest
    time: Mapped[datetime] = mapped_column(UTCDateTime())  # the report's
    decision: Mapped[int] = mapped_column(Integer)  # the decision point's number, from 1
    boundary: Mapped[int] = mapped_column(Integer)
    bound: Mapped[int] = mapped_column(Integer)
    policy: Mapped[str] = mapped_column(String(16))  # 'output' or 'gradient'
    statistic: Mapped[str] = mapped_column(String(32))
    signal: Mapped[str] = mapped_column(Text)  # JSON list, one per block
    limits: Mapped[str] = mapped_column(Text)  # JSON list, one per block
    probe_s: Mapped[float] = mapped_column(Float)
