"""The typed rows the store's reads return: immutable pydantic models, one per kind of row.

Timestamps: `JobInfo`, `CheckpointInfo`, `GenerationRow` and `RecordedLayout` carry
timezone-aware UTC datetimes; the per-step and per-report rows (`MetricRow`, `EvaluationRow`,
`EventRow`, `WorkerRow`, `FreezeSignalRow`) carry unix seconds, the shape the trainer reports
them in. Lists are tuples, so a row cannot change under its reader. `row.model_dump(mode="json")`
is strict JSON (non-finite floats are stored as NULL and read back as None).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, NoReturn

from pydantic import BaseModel, ConfigDict, PlainSerializer

from pipetransformer.core.spec import JobSpec
from pipetransformer.core.stage_times import PhaseSeconds, TraceSpan
from pipetransformer.core.state import Layout

# `datetime.isoformat()` in JSON ("...+00:00"), as `pipetransformer status --json` always
# printed it (pydantic's own JSON would write "Z" and drop zero microseconds differently).
IsoTime = Annotated[
    datetime, PlainSerializer(lambda t: t.isoformat(), return_type=str, when_used="json")
]
Readings = tuple[float | None, ...]  # one value per block or rank, None where unknown


class Row(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def __iter__(self) -> NoReturn:  # type: ignore[override]
        # These reads returned tuples and dicts before; unpacking a row like one would silently
        # give pydantic's (field, value) pairs, so it fails loudly instead.
        raise TypeError(f"a {type(self).__name__} is read by attribute, not iterated or unpacked")


class JobInfo(Row):
    """A job row with its spec parsed. `freeze_boundary` is not stored with the job: it is
    that of the job's current (highest-versioned) layout, 0 before the first one."""

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


class GenerationRow(Row):
    """One incarnation of the worker group; `reason` says why it ended when there is more to
    say than its state."""

    number: int
    world_size: int
    state: str
    started_at: datetime
    ended_at: datetime | None
    reason: str | None


class RecordedLayout(Row):
    """A layout version as the controller recorded it: why, and when (which is when the
    controller drained the report, a few steps after the workers started training under it)."""

    layout: Layout
    reason: str
    created_at: datetime


class MetricRow(Row):
    """One optimizer step. Fields a worker did not report, or a row stored before the
    revision that added them, are None: `frozen` (the freeze boundary the step trained under,
    revision 0007), `grad_norms` (per block, 0005), `mfu` (a fraction) and `peak_memory_mib`
    (per rank, MiB, only on steps at control points; both 0006)."""

    step: int
    epoch: int
    loss: float | None  # None where not finite (a diverged step)
    samples_per_s: float | None
    lr: float
    time: float  # unix seconds, the worker's clock when the step ended
    frozen: int | None = None
    grad_norms: Readings | None = None
    mfu: float | None = None
    peak_memory_mib: Readings | None = None


class EvaluationRow(Row):
    """A held-out evaluation at the end of an epoch: accuracy a fraction 0..1 (question
    answering: exact match), and question answering's F1 (None otherwise)."""

    epoch: int
    step: int
    accuracy: float
    loss: float | None
    time: float  # unix seconds
    f1: float | None = None


class CheckpointInfo(Row):
    """A checkpoint row. Only `state == "committed"` checkpoints may be resumed from."""

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


class EventRow(Row):
    """An entry of the job's event log; `rank` None for the controller's own events, `data`
    the JSON the event was recorded with (non-finite numbers in it became None)."""

    id: int
    time: float  # unix seconds
    kind: str
    rank: int | None
    message: str
    data: dict[str, Any] | None


class WorkerRow(Row):
    """One rank of one generation: where it ran, what it ran, and how it ended. Times are unix
    seconds; `started_at` and `last_report_at` None until known."""

    generation: int
    rank: int
    node: str  # "host:agent-pid", "" when the join request did not name it
    host: str | None
    pid: int | None
    stages: tuple[int, ...] | None
    replica: int | None
    log: str | None
    assigned_at: float
    started_at: float | None
    last_report_at: float | None
    lease: str
    state: str
    exit_code: int | None
    signal: int | None
    detail: str | None


class StageTimesRow(Row):
    """One rank's time over one reporting interval (`core.protocol.StageTimes`, revision
    0009): the steps `from_step`+1 .. `to_step` under layout `layout_version`, on `stages` of
    `replica`; seconds per phase (`core.stage_times.PHASES`), the interval's wall time, and how
    the phases were timed (`clock`: 'cuda' events or the 'host' clock). `time` is unix
    seconds, the worker's clock at the interval's end."""

    generation: int
    rank: int
    time: float
    from_step: int
    to_step: int
    layout_version: int
    stages: tuple[int, ...]
    replica: int
    wall_s: float
    seconds: PhaseSeconds
    clock: str


class StepTraceRow(Row):
    """One rank's traced step (`core.protocol.StepTrace`, revision 0009), answering trace
    request `request`: its spans (`core.stage_times.TraceSpan`, seconds from `started`, the
    rank's unix time at the step's start), on `stages` of `replica` under `layout_version`."""

    request: str
    generation: int
    rank: int
    step: int
    started: float
    layout_version: int
    stages: tuple[int, ...]
    replica: int
    spans: tuple[TraceSpan, ...]
    clock: str


class FreezeSignalRow(Row):
    """What the freeze policy read at one decision point (`core.protocol.FreezeSignal`,
    revision 0010), as the job followed it (after a recovery, the highest generation's): the
    decision point's `step` and number (`decision`), the boundary after it and the automatic
    cap (`bound`), the `policy` ('output', 'gradient') and `statistic` ('output_rate',
    'gradient_drift', 'gradient_norm'), per block the statistic read (`signal`) and the value at
    or below which the block counts as settled (`limits`), None where unknown, and what reading
    it cost (`probe_s`, seconds). `time` is unix seconds, rank 0's clock."""

    step: int
    generation: int
    time: float
    decision: int
    boundary: int
    bound: int
    # plain strings, not the protocol's literals: a row a newer writer stored still reads
    policy: str
    statistic: str
    signal: Readings
    limits: Readings
    probe_s: float


class PeakMemory(Row):
    """The newest per-rank peak GPU memory a step carried (MiB, index = rank)."""

    step: int
    peak_memory_mib: Readings


class StatusCheckpoint(Row):
    """The newest committed checkpoint, as `status` names it."""

    path: str
    step: int


class StatusMetrics(Row):
    """The newest step's metrics, as `status` shows them."""

    step: int
    epoch: int
    loss: float | None
    samples_per_s: float | None
    lr: float
    time: float  # unix seconds
    mfu: float | None


class JobStatus(Row):
    """One job at a glance (the CLI's `status` and its `--json`, whose keys are these fields).
    `mfu`: the newest step's model FLOPs utilisation (a fraction); `peak_memory_mib`: the newest
    per-rank peak GPU memory in MiB (`Store.latest_peak_memory`); None where unknown."""

    id: str
    name: str
    state: str
    message: str | None
    epoch: int
    epochs: int
    step: int
    samples_consumed: int
    accuracy: float | None
    # the newest evaluation's held-out mean loss (per sample; a language model's per counted
    # token), and a language model's perplexity (its exp); None before one, or not a language
    # model's
    held_out_loss: float | None = None
    perplexity: float | None = None
    lr: float
    freeze_boundary: int
    layout_version: int
    layout: Layout | None
    checkpoint: StatusCheckpoint | None
    last_metrics: StatusMetrics | None
    mfu: float | None
    peak_memory_mib: Readings | None
    workdir: str
    created_at: IsoTime
    updated_at: IsoTime
