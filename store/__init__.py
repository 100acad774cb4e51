"""The SQL store: the only API anything uses to read or write the job database.

One writer (the controller; the CLI for job creation and state changes) and any number of
readers (the dashboard, `pipetransformer status`). Every write method is one transaction and
validates its input before touching the database, so bad input raises and changes nothing.
Every read returns typed, immutable rows (`store.rows`).

SQLite (default, one file per run directory) and PostgreSQL (production) are both supported,
with the same migrations and tests. The schema (`store.tables`) is created and upgraded only by
alembic (`Store.open(url, migrate=True)`).

The database may be unreachable for a few seconds (a PostgreSQL restart or fail-over, a locked
SQLite file): every method retries such transient errors with backoff for up to `retry_s`
seconds (`Store.open(url, retry_s=30)`), logging each retry, then raises `StoreUnavailable`.

The package is split by what it stores: `engine` (URLs, engines, alembic, retries), `base`
(connection and transactions), one mixin per table (`jobs`, `generations`, `layouts`,
`metrics` with evaluations, `checkpoints`, `events`, `workers`, `stage_times`,
`freeze_signals`) and `status`; `Store` is all of them.
"""

from __future__ import annotations

from pipetransformer.store.checkpoints import CheckpointsMixin
from pipetransformer.store.engine import (
    DB_ENV,
    DEFAULT_RETRY_S,
    MIGRATIONS_DIR,
    alembic_config,
    is_transient,
    make_engine,
    server_of,
    sqlite_path,
    sqlite_url,
    unreachable,
    url_problem,
)
from pipetransformer.store.errors import (
    JobExists,
    NotFound,
    StoreConflict,
    StoreUnavailable,
    UnknownJob,
)
from pipetransformer.store.events import EventsMixin
from pipetransformer.store.freeze_signals import FreezeSignalsMixin
from pipetransformer.store.generations import GenerationsMixin
from pipetransformer.store.jobs import JobsMixin
from pipetransformer.store.layouts import LayoutsMixin
from pipetransformer.store.metrics import PEAK_LOOKBACK_STEPS, MetricsMixin
from pipetransformer.store.rows import (
    CheckpointInfo,
    EvaluationRow,
    EventRow,
    FreezeSignalRow,
    GenerationRow,
    JobInfo,
    JobStatus,
    MetricRow,
    PeakMemory,
    RecordedLayout,
    StageTimesRow,
    StatusCheckpoint,
    StatusMetrics,
    StepTraceRow,
    WorkerRow,
)
from pipetransformer.store.stage_times import StageTimesMixin
from pipetransformer.store.status import StatusMixin
from pipetransformer.store.tables import (
    CHECKPOINT_STATES,
    GENERATION_STATES,
    JOB_STATES,
    LEASE_STATES,
    WORKER_STATES,
)
from pipetransformer.store.workers import WorkersMixin

__all__ = [
    "CHECKPOINT_STATES",
    "DB_ENV",
    "DEFAULT_RETRY_S",
    "GENERATION_STATES",
    "JOB_STATES",
    "LEASE_STATES",
    "MIGRATIONS_DIR",
    "PEAK_LOOKBACK_STEPS",
    "WORKER_STATES",
    "CheckpointInfo",
    "EvaluationRow",
    "EventRow",
    "FreezeSignalRow",
    "GenerationRow",
    "JobExists",
    "JobInfo",
    "JobStatus",
    "MetricRow",
    "NotFound",
    "PeakMemory",
    "RecordedLayout",
    "StageTimesRow",
    "StepTraceRow",
    "StatusCheckpoint",
    "StatusMetrics",
    "Store",
    "StoreConflict",
    "StoreUnavailable",
    "UnknownJob",
    "WorkerRow",
    "alembic_config",
    "is_transient",
    "make_engine",
    "server_of",
    "sqlite_path",
    "sqlite_url",
    "unreachable",
    "url_problem",
]


class Store(
    JobsMixin,
    GenerationsMixin,
    LayoutsMixin,
    MetricsMixin,
    CheckpointsMixin,
    EventsMixin,
    WorkersMixin,
    StageTimesMixin,
    FreezeSignalsMixin,
    StatusMixin,
):
    """Typed access to the job database (see `store.base.StoreBase` for connecting,
    transactions and retries). Construct with `Store.open(url)` to migrate first."""
