"""The worker <-> controller protocol: every message that crosses etcd between them, typed.

Workers and the controller never share memory; they talk through the keys in `core.keys`,
and each key holds one of the models below as JSON (docs/architecture.md, "Protocol"):

    keys.join            JoinRequest    rank 0 of a rendezvous round -> controller
    keys.assignment      Assignment     controller -> every worker of the round
    keys.control         Control        controller (or CLI) -> rank 0, read at control points
    keys.freeze_override FreezeRequest  `pipetransformer freeze` -> rank 0, read at decision points
    keys.event(...)      WorkerEvent    any rank -> controller (a queue the controller drains)
    keys.exit_report     WorkerExit     a node's fork server -> controller
    keys.abort           generation     controller -> every worker (a number, watched)

`WorkerEvent` is a discriminated union on `kind`: one model per event, so the controller matches
on types and a malformed or unknown report fails validation in one place (`parse_event`), where it
is rejected with a log line instead of crashing the controller.
"""

from __future__ import annotations

import math
import time
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from pipetransformer.core.stage_times import MAX_TRACE_SPANS, PhaseSeconds, TraceSpan
from pipetransformer.core.state import Layout, TrainingState

# Exit code of a worker that leaves its generation on purpose (aborted by the controller, a lost
# peer, or re-forming after a graceful SIGTERM): non-zero, so its torchrun agent restarts it into
# the next rendezvous round (EX_TEMPFAIL).
EXIT_REFORM = 75
# exit codes that are a decision, not a death: done, and leaving to re-form
_CLEAN_EXITS = (0, EXIT_REFORM)


def _not_negative(value: float) -> float:
    if value < 0:  # NaN and inf pass: a diverged step's norms are stored as NULL
        raise ValueError("must not be negative")
    return value


# a norm, a utilisation or a memory size: a negative one is a malformed report, rejected when
# drained rather than failing the store write of the whole batch
NonNegative = Annotated[float, AfterValidator(_not_negative)]


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


# A measurement that may be unknown. JSON has no NaN, so a non-finite value travels as None:
# it is None in memory too, and the store keeps it as NULL (SQLite cannot store NaN).
Reading = Annotated[float | None, AfterValidator(_finite_or_none)]
# a norm or memory size that may be unknown: never negative, None where not finite
NonNegativeReading = Annotated[NonNegative | None, AfterValidator(_finite_or_none)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Control(StrEnum):
    """The value of `keys.control`: what rank 0 tells every rank at a control point."""

    RUN = "run"
    STOP = "stop"  # checkpoint and leave; the job is interrupted (resume continues it)

    @classmethod
    def read(cls, raw: str | None) -> Control:
        """A missing or unknown value means run: only an explicit stop stops a job."""
        try:
            return cls(raw) if raw is not None else cls.RUN
        except ValueError:
            return cls.RUN


class RunOutcome(StrEnum):
    """How a rank's training loop ended."""

    DONE = "done"  # every epoch (or max_steps) trained
    TARGET = "target"  # held-out accuracy reached training.target_accuracy
    STOPPED = "stopped"  # told to stop (Control.STOP)
    LEAVE = "leave"  # a rank was asked to leave (SIGTERM): re-form without it


class Phase(StrEnum):
    """Where a worker was when it failed: `build` is everything before its first step."""

    BUILD = "build"
    TRAIN = "train"


class FreezeOutcome(StrEnum):
    """What became of a manual freeze request at the decision point that read it."""

    APPLIED = "applied"  # it moved the boundary past the automatic decision
    SUPERSEDED = "superseded"  # the automatic decision reached it anyway
    REJECTED = "rejected"  # malformed or beyond the cap; the automatic decision stands


# -- requests filed by people and by workers ------------------------------------------------------


class FreezeRequest(_Model):
    """A manual request to freeze blocks [0, layers), filed under `keys.freeze_override` by the
    CLI (`edge.overrides.file_freeze_request`; one pending at a time) and applied at the next decision point."""

    id: str
    layers: StrictInt  # "4" or 4.0 is a malformed request, not four blocks
    who: str
    reason: str
    time: float = Field(default_factory=time.time)


class TraceRequest(_Model):
    """The value of `keys.trace_request`: capture one step's schedule on every rank (`pipetransformer
    trace JOB`, or a signed-in dashboard user). Rank 0 reads it at a control point; every rank
    traces the next step and reports a `StepTrace`; rank 0 then marks it `served_step`."""

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    who: str = Field(max_length=200)
    time: float = Field(default_factory=time.time, allow_inf_nan=False)
    served_step: int | None = None  # the traced step, once rank 0 chose it


def read_trace_request(raw: str | None) -> TraceRequest | None:
    """The pending request under `keys.trace_request`, or None (none, served, or unreadable:
    a control point never fails on it)."""
    if raw is None:
        return None
    try:
        request = TraceRequest.model_validate_json(raw)
    except ValidationError:
        return None
    return request if request.served_step is None else None


class UnreadableRequest(_Model):
    """Text under `keys.freeze_override` that is not a FreezeRequest (written there by hand):
    audited with its first 200 characters and rejected at the decision point."""

    raw: str
    error: str = Field(default="", exclude=True)  # why it did not parse (for messages only)


def freeze_request_id(request: FreezeRequest | UnreadableRequest) -> str:
    """What tells one filed request from another: its id, or the text of one that did not parse
    (as kept)."""
    return request.raw if isinstance(request, UnreadableRequest) else request.id


def read_freeze_request(raw: str) -> FreezeRequest | UnreadableRequest:
    """The request filed under `keys.freeze_override`; whoever reads it must not crash on a
    malformed one."""
    try:
        return FreezeRequest.model_validate_json(raw)
    except ValidationError as exc:
        return UnreadableRequest(raw=raw[:200], error=first_error(exc))


class JoinRequest(_Model):
    """A rendezvous round's workers asking for their assignment (rank 0 files it under
    `keys.join`); the controller answers with an Assignment carrying the same `id`, and tells
    joined and departed nodes apart by `nodes`."""

    id: str
    world: int = Field(ge=1)
    # node of each rank, in rank order: "host:agent-pid" (one torchrun agent per node)
    nodes: list[str] = []
    pids: list[int] = []
    time: float = Field(default_factory=time.time)


class Assignment(_Model):
    """What the controller hands a generation of workers (published under `keys.assignment`).

    `request`: the JoinRequest this answers. `layout`: the layout the generation trains under
    (planned for its world size). `waiting`: set when no layout fits the workers that joined:
    they hold on (keeping their leases) until a node joins and the agents re-rendezvous."""

    generation: int
    checkpoint_dir: str
    # the job failed for good (every rank of the last generation failed the same way while
    # starting): workers that see it leave with exit code 0, so their agents stop restarting
    fatal: str | None = None
    start: TrainingState = TrainingState()
    # a committed checkpoint to load before training, with the checksum it was committed under
    resume_checksum: str | None = None
    request: str | None = None
    layout: Layout | None = None
    waiting: str | None = None


def is_abnormal(exit_code: int | None, signum: int | None) -> bool:
    """Whether a worker's exit status is a failure: a signal, or a code other than 0 (done) and
    75 (leaving to re-form)."""
    return signum is not None or exit_code not in _CLEAN_EXITS


class WorkerExit(_Model):
    """How a worker process ended, as the process that reaped it (its node's fork server) saw
    it; put under `keys.exit_report` and drained by the controller, which matches it to a
    generation's rank by host and pid. `exit_code` is None when a signal killed it."""

    pid: int
    host: str
    rank: int | None = None  # RANK from torchrun, if it was set
    exit_code: int | None = None
    signal: int | None = None
    time: float = Field(default_factory=time.time)


class TrainerRefused(_Model):
    """A trainer pod cannot run its share of the job where it landed (fewer GPUs than
    workers): put under `keys.refusal` by `pipetransformer workers` before it exits 2. A
    failed pod is replaced (its Volcano policy); the controller fails the job once pods have
    refused as many times as its restart budget, so the store says why rather than a job
    Volcano ended without a word."""

    reason: str = Field(max_length=1000)
    host: str = Field(max_length=255)
    pid: int
    time: float = Field(default_factory=time.time, allow_inf_nan=False)


class RendezvousRefused(_Model):
    """A torchrun agent refused the rendezvous state it read: not signed with the job's secret
    (written by someone without it, or by an agent given another secret). Put under
    `keys.alert` by the agent's rendezvous backend, before anything unpickled the state; the
    controller records it as an event."""

    run_id: str = Field(max_length=200)
    key: str = Field(max_length=400)
    reason: str = Field(max_length=400)
    host: str = Field(max_length=255)
    pid: int
    time: float = Field(default_factory=time.time, allow_inf_nan=False)


# -- worker events -------------------------------------------------------------------------------


class _Event(_Model):
    """What every worker report carries: who sent it, for which generation, and when."""

    rank: int
    generation: int = 1
    time: float = Field(default_factory=time.time, allow_inf_nan=False)  # unix seconds

    def payload(self) -> dict[str, Any]:
        """The report's own fields (not who/when), as the store records them."""
        return self.model_dump(mode="json", exclude={"kind", "rank", "generation", "time"})


class Started(_Event):
    """A rank built its share of the model and is about to train."""

    kind: Literal["started"] = "started"
    stages: list[int]
    replica: int
    pid: int
    host: str
    node: str
    total_steps: int
    # the file this process's stdout goes to, when it is a regular file (the worker's log)
    log: str | None = None


class FirstStep(_Event):
    """Rank 0 finished the generation's first step (how long a start or recovery took)."""

    kind: Literal["first_step"] = "first_step"
    step: int

    def payload(self) -> dict[str, Any]:
        return {"step": self.step, "time": self.time}


class Metrics(_Event):
    """One optimizer step, from the rank that owns the global batch's loss."""

    kind: Literal["metrics"] = "metrics"
    step: int = Field(ge=0)
    epoch: int = Field(ge=0)
    samples_consumed: int
    loss: Reading  # None: not finite (a diverged step)
    lr: float = Field(ge=0, allow_inf_nan=False)
    samples_per_s: Reading
    frozen: int = Field(ge=0)  # the layout's freeze boundary at this step (stored since 0007)
    # one gradient L2 norm per transformer block (after the cross-replica all-reduce, before
    # clipping; 0 for frozen blocks); None where not finite. Absent from older workers' reports.
    grad_norms: list[NonNegativeReading] | None = None
    # model FLOPs per second over the devices' dense peak (core/flops.py), a fraction; None
    # where the peak is unknown (the CPU, unless PIPETRANSFORMER_PEAK_TFLOPS says it) or not finite
    mfu: NonNegativeReading = None
    # peak GPU memory allocated per rank (MiB; index = rank) since the layout was built, sent at
    # control points (runtime.control_every_steps) and None between them and on the CPU
    peak_memory_mib: list[NonNegativeReading] | None = None


class Evaluated(_Event):
    """Held-out accuracy (question answering: exact match) and loss at the end of an epoch, and
    question answering's F1."""

    kind: Literal["eval"] = "eval"
    epoch: int
    step: int
    accuracy: float
    loss: float | None
    f1: float | None = None


class CheckpointWritten(_Event):
    """A checkpoint is durable and sealed (rank 0 reports; the controller verifies it on disk
    before committing it)."""

    kind: Literal["checkpoint"] = "checkpoint"
    path: str
    size_bytes: int
    checksum: str
    seconds: float
    blocked_s: float
    state: TrainingState
    layout_version: int


class CheckpointFailed(_Event):
    """A background checkpoint failed to write or seal; nothing was committed."""

    kind: Literal["checkpoint_failed"] = "checkpoint_failed"
    step: int
    error: str


class RelayoutCost(_Model):
    """Where a re-layout in the running processes spent its time (seconds on rank 0, which every
    rank waits for) and how the state reached its new owners (`freeze.handover`)."""

    handover: Literal["memory", "checkpoint"]
    plan_s: NonNegative  # measuring (rank 0) and planning the new layout, agreed by every rank
    checkpoint_s: NonNegative  # committing the old layout's state (the checkpoint path; else 0)
    build_s: NonNegative  # new groups, stages and optimizer, filled by the move or the load
    cache_s: NonNegative  # AutoCache's decision at the new boundary
    moved_bytes: int = Field(ge=0)  # state sent between ranks, all ranks together (memory path)


class LayoutPlanned(_Event):
    """The workers planned a layout from measurement (start-up AutoPipe, or a re-layout)."""

    kind: Literal["layout"] = "layout"
    layout: Layout
    reason: str
    seconds: float | None = None
    cost: RelayoutCost | None = None  # a re-layout in the running processes
    # AutoPipe's prediction per stage: forward and backward seconds per step (None: not planned
    # from measurement)
    predicted_stage_s: list[NonNegative] | None = Field(default=None, max_length=1_024)


class FreezeDecided(_Event):
    """A decision point moved the boundary, or answered a manual request."""

    kind: Literal["freeze"] = "freeze"
    step: int
    previous: int
    boundary: int
    source: Literal["auto", "manual", "none"]
    reason: str
    request: FreezeRequest | UnreadableRequest | None = None
    outcome: FreezeOutcome | None = None
    outcome_reason: str = ""


class FreezeSignal(_Event):
    """What the freeze policy read at a decision point (every one, moved or not): per block the
    statistic (`signal`) and the value at or below which the block counts as settled (`limits`),
    both None where unknown; `policy` and `statistic` say which (policy `output`: output rate;
    `gradient`: gradient drift or norm). `probe_s`: what reading it cost this decision point
    (policy `output`'s probe; 0 where the statistic came with the steps). From rank 0; none
    for `schedule` and `off`, which read nothing."""

    kind: Literal["freeze_signal"] = "freeze_signal"
    step: int = Field(ge=0)
    decision: int = Field(ge=1)
    boundary: int = Field(ge=0)  # the boundary after this decision point
    bound: int = Field(ge=0)  # the automatic cap at it (alpha-bound and keep_trainable)
    policy: Literal["output", "gradient"]
    statistic: Literal["output_rate", "gradient_drift", "gradient_norm"]
    signal: list[NonNegativeReading] = Field(max_length=4096)
    limits: list[NonNegativeReading] = Field(max_length=4096)
    probe_s: NonNegative = Field(0.0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_limit_per_block(self) -> FreezeSignal:
        if len(self.signal) != len(self.limits):
            raise ValueError(
                f"signal has {len(self.signal)} entries and limits {len(self.limits)}: one "
                "of each per block"
            )
        return self


class CacheDecided(_Event):
    """Whether AutoCache serves this rank's frozen prefix at a boundary, and why."""

    kind: Literal["cache"] = "cache"
    boundary: int
    use: bool
    reason: str
    costs: dict[str, Any] | None = None
    directory: str | None = None
    ram_fraction: float | None = None


class StageTimes(_Event):
    """Where one rank's time went over one reporting interval: the steps `from_step`+1 ..
    `to_step`, all under layout `layout_version` (an interval ends at a re-layout), on the
    rank's `stages` of `replica` (core/stage_times.py names the phases)."""

    kind: Literal["stage_times"] = "stage_times"
    from_step: int = Field(ge=0)
    to_step: int = Field(ge=1)
    layout_version: int = Field(ge=1)
    stages: list[int] = Field(max_length=1_024)
    replica: int = Field(ge=0)
    wall_s: NonNegative = Field(allow_inf_nan=False)
    seconds: PhaseSeconds
    # how the phases were timed: CUDA events on the device, or the host's clock
    clock: Literal["cuda", "host"] = "host"

    @model_validator(mode="after")
    def _steps_in_order(self) -> StageTimes:
        if self.to_step <= self.from_step:
            raise ValueError(f"to_step {self.to_step} must be after from_step {self.from_step}")
        return self


class StepTrace(_Event):
    """One rank's traced step (a `TraceRequest` answered): every phase's spans, micro-batch by
    stage, from `started` (unix seconds, the rank's clock at the step's start)."""

    kind: Literal["step_trace"] = "step_trace"
    request: str = Field(max_length=64)
    step: int = Field(ge=1)
    started: float = Field(allow_inf_nan=False)
    layout_version: int = Field(ge=1)
    stages: list[int] = Field(max_length=1_024)
    replica: int = Field(ge=0)
    spans: list[TraceSpan] = Field(max_length=MAX_TRACE_SPANS)
    clock: Literal["cuda", "host"] = "host"


# a path, a split or column name in a report: the spec's own bounds (a path's is the longest)
_Text = Annotated[str, Field(max_length=4_096)]


class SplitOrigin(_Model):
    """Where one split of a job's data came from: its rows, the files or folder it was read from
    (none for a built-in data set) and, for a `save_to_disk` DatasetDict, the split's name."""

    rows: int | None = Field(None, ge=0)  # None: not opened yet (described from the spec alone)
    paths: list[_Text] = Field(default_factory=list, max_length=1024)
    split: _Text | None = None
    windows: int | None = Field(None, ge=0)  # question answering: the samples its rows became
    sequences: int | None = Field(None, ge=0)  # causal-lm: the packed sequences they became


class DataOrigin(_Model):
    """Where a job's data came from (`core.provenance.describe_data`): the data set (a built-in
    one by its name), the training and held-out splits, and the columns read (role -> column;
    none for a built-in data set)."""

    dataset: _Text
    builtin: bool
    train: SplitOrigin
    test: SplitOrigin
    columns: dict[_Text, _Text] = Field(default_factory=dict, max_length=8)


class DataOpened(_Event):
    """Rank 0 opened the job's data (once per generation, before the first step)."""

    kind: Literal["data"] = "data"
    origin: DataOrigin


class Finished(_Event):
    """Rank 0: the job's training ended as asked (all steps, the target, or a stop)."""

    kind: Literal["done", "stopped"]
    outcome: RunOutcome


class Failed(_Event):
    """This rank's own exception (the agents restart it; the job fails when they stop)."""

    kind: Literal["failed"] = "failed"
    error: str
    phase: Phase | None = None
    # a restart would fail the same way (a data error: the same file read again): the job fails
    # now instead of restarting
    repeats: bool = False


class PeerLost(_Event):
    """A collective failed because a peer went away: not this rank's fault."""

    kind: Literal["peer_lost"] = "peer_lost"
    error: str
    phase: Phase | None = None


class Aborted(_Event):
    """Left because the controller aborted the generation (last word, best effort)."""

    kind: Literal["aborted"] = "aborted"
    why: str


class Left(_Event):
    """Stopped by SIGTERM without finishing the graceful leave in time (last word)."""

    kind: Literal["left"] = "left"
    why: str


class Leaving(_Event):
    """Rank 0: these ranks were asked to leave (SIGTERM); everyone checkpointed this step and
    leaves to re-form without them."""

    kind: Literal["leaving"] = "leaving"
    ranks: list[int]
    step: int


WorkerEvent = Annotated[
    Started
    | FirstStep
    | Metrics
    | Evaluated
    | CheckpointWritten
    | CheckpointFailed
    | LayoutPlanned
    | FreezeDecided
    | FreezeSignal
    | CacheDecided
    | StageTimes
    | StepTrace
    | DataOpened
    | Finished
    | Failed
    | PeerLost
    | Aborted
    | Left
    | Leaving,
    Field(discriminator="kind"),
]
# a rank's own account of how its part in a generation ended (the post-mortem's facts)
RankEndReport = Failed | PeerLost | Aborted | Left

_events: TypeAdapter[WorkerEvent] = TypeAdapter(WorkerEvent)


class BadReport(ValueError):
    """A report that is not a WorkerEvent; the message says which field and why."""


def first_error(exc: ValidationError) -> str:
    """One line naming the first offending field, e.g. `step: Field required`."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(message)"
    message = err["msg"]
    if err["type"] == "union_tag_invalid":  # the discriminator names no known event
        where, message = "kind", f"unknown kind {err['ctx']['tag']!r}"
    elif err["type"] == "union_tag_not_found":
        where, message = "kind", "missing"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {message}{more}"


def parse_event(raw: str | bytes) -> WorkerEvent:
    """The event a worker put under `keys.event(...)`; BadReport if it is not one."""
    try:
        return _events.validate_json(raw)
    except ValidationError as exc:
        raise BadReport(first_error(exc)) from None
