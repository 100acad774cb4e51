"""A job's recoveries, read back from what its controller stored: each generation that ended
before the job did (a worker lost, its node gone, the agents re-formed), the generation formed
after it, the step it resumed from, the steps trained again and the wall time without a new step.
`pipetransformer status` (text and JSON) and the end-of-run summary show them; the live
progress lines print the controller's own notices as they happen."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

ABORTED, STARTED = "generation_aborted", "generation_started"


class _Event(Protocol):  # a stored event (store.rows.EventRow)
    time: float
    kind: str
    data: Mapping[str, Any] | None


class _Step(Protocol):  # a stored step (store.rows.MetricRow)
    step: int
    time: float


@dataclass(frozen=True)
class Recovery:
    """One generation ended by a failure, and what took over. `resumed_from_step` and the
    figures after it are None until a generation has started after it (or when the job ended
    first). `steps_redone`: steps trained before the failure and again after it (the resume
    point is the last committed checkpoint); `seconds_lost`: from the newest step before the
    failure to the first new one after it."""

    generation: int | None
    failed_at: float  # unix seconds
    reason: str
    resumed_generation: int | None = None
    resumed_from_step: int | None = None
    from_checkpoint: bool | None = None
    steps_redone: int | None = None
    seconds_lost: float | None = None

    def text(self) -> str:
        """`generation 1: rank 1 ... killed by SIGKILL; generation 2 resumed from the
        checkpoint at step 161 (2 steps redone), 6.3 s without a new step`."""
        head = f"generation {self.generation}: {self.reason}"
        if self.resumed_from_step is None:
            return f"{head}; not resumed"
        source = (
            f"the checkpoint at step {self.resumed_from_step}"
            if self.from_checkpoint
            else "scratch"
        )
        tail = f"; generation {self.resumed_generation} resumed from {source}"
        if self.steps_redone:
            tail += f" ({self.steps_redone} step{'s' if self.steps_redone != 1 else ''} redone)"
        if self.seconds_lost is not None:
            tail += f", {self.seconds_lost:.1f} s without a new step"
        return head + tail


def recoveries(
    events: Iterable[_Event],
    steps: Sequence[_Step],
    reasons: Mapping[int, str | None] | None = None,
) -> list[Recovery]:
    """The recoveries in `events` (any order) with `steps` (the job's stored steps, each
    recorded once: the first time it was trained), oldest first. `reasons`: each generation's
    final explanation by number, where known (its post-mortem refines, once the ranks' exits
    are in, the reason its abort was recorded with)."""
    reasons = reasons or {}
    ordered = sorted(events, key=lambda e: e.time)
    by_time = sorted(steps, key=lambda s: s.time)
    found: list[Recovery] = []
    pending: Recovery | None = None
    for e in ordered:
        data = e.data or {}
        if e.kind == ABORTED:
            if pending is not None:  # aborted again before a generation started
                found.append(pending)
            number = data.get("generation")
            reason = reasons.get(number) or str(data.get("reason", ""))
            pending = Recovery(number, e.time, reason)
        elif e.kind == STARTED and pending is not None:
            start = data.get("start") or {}
            resumed = int(start.get("step", 0))
            before = [s for s in by_time if s.time <= pending.failed_at]
            last = max(before, key=lambda s: s.step, default=None)
            newest = last.step if last is not None else 0
            after = [s for s in by_time if s.time > pending.failed_at and s.step > newest]
            lost = None
            if last is not None and after:
                lost = min(after, key=lambda s: s.step).time - last.time
            found.append(
                Recovery(
                    pending.generation,
                    pending.failed_at,
                    pending.reason,
                    resumed_generation=data.get("generation"),
                    resumed_from_step=resumed,
                    from_checkpoint=bool(start.get("checkpoint")),
                    steps_redone=max(newest - resumed, 0),
                    seconds_lost=lost,
                )
            )
            pending = None
    if pending is not None:
        found.append(pending)
    return found
