"""Where a rank's time goes: the phases a training step is split into, the bubble a pipeline
schedule implies, and the readings drawn from measured intervals (issue 28).

Each rank measures, over each reporting interval, the seconds it spent in every phase below
(`trainer/stage_clock.py`) and reports them as `core.protocol.StageTimes`; the store keeps one
row per rank and interval; `status`, the end-of-run summary and the dashboard's Pipeline view
read them through the functions here. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict


def _not_negative(value: float) -> float:
    if not (math.isfinite(value) and value >= 0):  # a phase's seconds are always measured
        raise ValueError("must be a finite number >= 0")
    return value


Seconds = Annotated[float, AfterValidator(_not_negative)]

# The phases, in the order they are stacked in a bar. Their sum is the interval's wall time:
# `other` is what no phase measured (the loop's bookkeeping, freeze decisions, reports).
PHASES: tuple[str, ...] = (
    "forward",  # the stages' forward computation, micro-batch by micro-batch
    "backward",  # their backward computation (input and weight gradients)
    "pipeline_wait",  # inside the schedule but not computing: waiting on a neighbour stage
    "grad_sync",  # replica gradient sum after the schedule, the clip norm, the loss sum
    "optimizer",  # the optimizer step (and bf16-weights' master copies)
    "frozen_prefix",  # serving the frozen blocks' output: AutoCache lookups or recompute
    "data_wait",  # waiting for the next batch's inputs
    "checkpoint",  # writing (or blocking on) checkpoints
    "evaluation",  # held-out evaluation at epoch ends
    "other",
)
PHASE_LABELS: dict[str, str] = {
    "forward": "forward",
    "backward": "backward",
    "pipeline_wait": "waiting for a neighbour stage",
    "grad_sync": "gradient sync",
    "optimizer": "optimizer",
    "frozen_prefix": "frozen prefix (cache or recompute)",
    "data_wait": "waiting for data",
    "checkpoint": "checkpoints",
    "evaluation": "evaluation",
    "other": "other",
}
# schedules whose weight gradients fill the bubble: no closed form for their bubble here
ZERO_BUBBLE = frozenset({"interleaved-zb", "zbv", "dualpipev"})


class PhaseSeconds(BaseModel):
    """Seconds per phase over one interval on one rank (`PHASES`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    forward: Seconds = 0.0
    backward: Seconds = 0.0
    pipeline_wait: Seconds = 0.0
    grad_sync: Seconds = 0.0
    optimizer: Seconds = 0.0
    frozen_prefix: Seconds = 0.0
    data_wait: Seconds = 0.0
    checkpoint: Seconds = 0.0
    evaluation: Seconds = 0.0
    other: Seconds = 0.0

    def total(self) -> float:
        return sum(getattr(self, p) for p in PHASES)

    def compute(self) -> float:
        """Forward and backward: the stage's own work."""
        return self.forward + self.backward

    def fractions(self, wall_s: float) -> dict[str, float]:
        """Each phase's share of `wall_s` (empty when no wall time was measured)."""
        if not wall_s > 0:
            return {}
        return {p: getattr(self, p) / wall_s for p in PHASES}

    def plus(self, other: PhaseSeconds) -> PhaseSeconds:
        return PhaseSeconds(**{p: getattr(self, p) + getattr(other, p) for p in PHASES})


def theoretical_bubble(
    schedule: str, ranks: int, microbatches: int, virtual: int = 1
) -> float | None:
    """The idle fraction of a pipeline rank that the schedule implies for `ranks` pipeline
    ranks, `microbatches` micro-batches and `virtual` stages per rank, with equal stages:
    (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for the interleaved and looped ones
    (Megatron-LM's (p-1)/(v*m) of the ideal time); None for the zero-bubble schedules, whose
    bubble depends on how the weight gradients fill it."""
    if ranks < 1 or microbatches < 1 or virtual < 1:
        raise ValueError(
            f"ranks, microbatches and virtual must be >= 1, got {ranks}, {microbatches}, {virtual}"
        )
    if ranks == 1:
        return 0.0
    if schedule in ZERO_BUBBLE:
        return None
    v = 1 if schedule in ("gpipe", "1f1b") else virtual
    return (ranks - 1) / (v * microbatches + ranks - 1)


def measured_bubble(seconds: PhaseSeconds) -> float | None:
    """The fraction of the schedule's time a rank spent waiting for a neighbour stage:
    pipeline_wait / (forward + backward + pipeline_wait); None when the schedule did not run."""
    inside = seconds.compute() + seconds.pipeline_wait
    return seconds.pipeline_wait / inside if inside > 0 else None


# the spans one rank's traced step may hold: micro-batches x stages x (forward, backward, wait)
# with room to spare, and a bound on what a report carries through etcd
MAX_TRACE_SPANS = 8_192


class TraceSpan(BaseModel):
    """One span of a traced step on one rank: a phase (`PHASES`), the stage and micro-batch it
    worked on where it is a stage's forward, backward or wait, and when, in seconds from the
    rank's start of the step."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    phase: str
    start_s: Seconds
    end_s: Seconds
    stage: int | None = None
    microbatch: int | None = None

    def model_post_init(self, context: object) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        if self.end_s < self.start_s:
            raise ValueError(f"end_s {self.end_s} is before start_s {self.start_s}")


def with_waits(spans: Sequence[TraceSpan], schedule: tuple[float, float] | None) -> list[TraceSpan]:
    """`spans` with the schedule's idle gaps between its compute spans (forward, backward)
    as `pipeline_wait` spans, ordered by start. `schedule` is the schedule's (start, end)."""
    if schedule is None:
        return sorted(spans, key=lambda s: s.start_s)
    lo, hi = schedule
    compute = sorted(
        (s for s in spans if s.phase in ("forward", "backward") and lo <= s.start_s <= hi),
        key=lambda s: s.start_s,
    )
    waits, cursor = [], lo
    for s in compute:
        if s.start_s > cursor:
            waits.append(TraceSpan(phase="pipeline_wait", start_s=cursor, end_s=s.start_s))
        cursor = max(cursor, s.end_s)
    if hi > cursor:
        waits.append(TraceSpan(phase="pipeline_wait", start_s=cursor, end_s=hi))
    return sorted([*spans, *waits], key=lambda s: s.start_s)


class TracedRank(Protocol):
    """What a Chrome trace needs of one rank's traced step (a report or a store row)."""

    @property
    def rank(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def started(self) -> float: ...
    @property
    def spans(self) -> Sequence[TraceSpan]: ...


def chrome_trace(traces: Iterable[TracedRank]) -> dict[str, object]:
    """The traced step of every rank as a Chrome / Perfetto trace (the JSON Trace Event
    Format: one complete event `ph: X` per span, microseconds from the earliest rank's start;
    a process per rank, a thread per stage)."""
    rows = list(traces)
    if not rows:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(r.started for r in rows)
    events: list[dict[str, object]] = []
    for r in rows:
        events.append(
            {"name": "process_name", "ph": "M", "pid": r.rank, "args": {"name": f"rank {r.rank}"}}
        )
        offset = (r.started - t0) * 1e6
        for s in r.spans:
            name = PHASE_LABELS[s.phase]
            if s.microbatch is not None:
                name += f" mb{s.microbatch}"
            events.append(
                {
                    "name": name,
                    "cat": s.phase,
                    "ph": "X",
                    "pid": r.rank,
                    "tid": -1 if s.stage is None else s.stage,
                    "ts": round(offset + s.start_s * 1e6, 3),
                    "dur": round((s.end_s - s.start_s) * 1e6, 3),
                    "args": {"step": r.step, "stage": s.stage, "microbatch": s.microbatch},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


class TimedInterval(Protocol):
    """What the readings below need of a measured interval (a store row or a report)."""

    @property
    def rank(self) -> int: ...
    @property
    def from_step(self) -> int: ...
    @property
    def to_step(self) -> int: ...
    @property
    def layout_version(self) -> int: ...
    @property
    def stages(self) -> Sequence[int]: ...
    @property
    def replica(self) -> int: ...
    @property
    def wall_s(self) -> float: ...
    @property
    def seconds(self) -> PhaseSeconds: ...


@dataclass(frozen=True)
class RankTimes:
    """One rank's phases summed over the intervals of one layout version."""

    rank: int
    stages: tuple[int, ...]
    replica: int
    layout_version: int
    wall_s: float
    seconds: PhaseSeconds
    intervals: int
    steps: int = 0  # the steps the intervals cover

    @property
    def per_step_compute_s(self) -> float:
        """Forward and backward per step (per interval where the steps are unknown)."""
        return self.seconds.compute() / max(self.steps or self.intervals, 1)

    @property
    def busy_fraction(self) -> float:
        """Forward and backward over the wall time."""
        return self.seconds.compute() / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def bubble(self) -> float | None:
        return measured_bubble(self.seconds)


def per_rank(
    intervals: Iterable[TimedInterval], layout_version: int | None = None
) -> list[RankTimes]:
    """Each rank's phases summed over the intervals of `layout_version` (default: the newest
    version any interval was measured under), ordered by rank."""
    rows = list(intervals)
    if not rows:
        return []
    version = layout_version if layout_version is not None else max(r.layout_version for r in rows)
    acc: dict[int, RankTimes] = {}
    for r in rows:
        if r.layout_version != version:
            continue
        prev = acc.get(r.rank)
        acc[r.rank] = RankTimes(
            rank=r.rank,
            stages=tuple(r.stages),
            replica=r.replica,
            layout_version=version,
            wall_s=r.wall_s + (prev.wall_s if prev else 0.0),
            seconds=r.seconds.plus(prev.seconds) if prev else r.seconds,
            intervals=1 + (prev.intervals if prev else 0),
            steps=r.to_step - r.from_step + (prev.steps if prev else 0),
        )
    return [acc[k] for k in sorted(acc)]


@dataclass(frozen=True)
class PipelineReading:
    """What `status` and the summary say of a layout's measured pipeline: the slowest stage
    (most forward + backward seconds per interval, over its replicas) and the mean measured
    bubble of the pipeline ranks beside what the schedule implies."""

    layout_version: int
    slowest_stages: tuple[int, ...]
    slowest_compute_s: float  # forward + backward per step, on that stage's ranks (mean)
    bubble: float | None
    theory: float | None

    def text(self) -> str:
        names = "+".join(str(s) for s in self.slowest_stages)
        bubble = "-" if self.bubble is None else f"{self.bubble:.0%}"
        theory = "" if self.theory is None else f" (schedule: {self.theory:.0%})"
        return (
            f"slowest stage {names} ({self.slowest_compute_s * 1e3:.1f} ms of forward and "
            f"backward per step); bubble {bubble}{theory} under layout v{self.layout_version}"
        )


def pipeline_reading(
    ranks: Sequence[RankTimes], schedule: str, pipeline_ranks: int, microbatches: int, virtual: int
) -> PipelineReading | None:
    """The slowest stage and the measured bubble of one layout's ranks (`per_rank`); None
    without measurements."""
    if not ranks:
        return None
    by_stages: dict[tuple[int, ...], list[float]] = {}
    for r in ranks:
        by_stages.setdefault(r.stages, []).append(r.per_step_compute_s)
    slowest, times = max(by_stages.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
    bubbles = [b for b in (r.bubble for r in ranks) if b is not None]
    return PipelineReading(
        layout_version=ranks[0].layout_version,
        slowest_stages=slowest,
        slowest_compute_s=sum(times) / len(times),
        bubble=sum(bubbles) / len(bubbles) if bubbles else None,
        theory=theoretical_bubble(schedule, pipeline_ranks, microbatches, virtual),
    )
