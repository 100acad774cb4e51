"""Where each rank's time went: one row per rank and reporting interval; and the traced steps
that trace requests asked for, one row per rank and request.

The workers' typed reports (`core.protocol.StageTimes`) arrive already validated by the
protocol (bounds, every phase's seconds >= 0) and are stored one row per (generation, rank, to_step),
with one column per phase of `core.stage_times.PHASES`. Reads return `StageTimesRow`s, which
`core.stage_times.per_rank` and `pipeline_reading` take as they are."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from pipetransformer.core.protocol import StageTimes, StepTrace
from pipetransformer.core.stage_times import PHASES, PhaseSeconds, TraceSpan
from pipetransformer.store.base import StoreBase
from pipetransformer.store.rows import StageTimesRow, StepTraceRow
from pipetransformer.store.tables import StageTime, StepTraceRecord
from pipetransformer.store.values import from_unix, unix

# Intervals looked up per statement: keeps under the databases' bind-parameter limits.
_CHUNK = 500

Key = tuple[int, int, int]  # (generation, rank, to_step): one interval of one rank


def _key(r: StageTimes) -> Key:
    return (r.generation, r.rank, r.to_step)


def _columns(job_id: str, r: StageTimes) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "generation": r.generation,
        "rank": r.rank,
        "time": from_unix(r.time),
        "from_step": r.from_step,
        "to_step": r.to_step,
        "layout_version": r.layout_version,
        "stages": json.dumps(list(r.stages)),
        "replica": r.replica,
        "wall_s": r.wall_s,
        **{f"{p}_s": getattr(r.seconds, p) for p in PHASES},
        "clock": r.clock,
    }


def stage_times_row(t: StageTime) -> StageTimesRow:
    return StageTimesRow(
        generation=t.generation,
        rank=t.rank,
        time=unix(t.time),
        from_step=t.from_step,
        to_step=t.to_step,
        layout_version=t.layout_version,
        stages=tuple(json.loads(t.stages)),
        replica=t.replica,
        wall_s=t.wall_s,
        seconds=PhaseSeconds(**{p: getattr(t, f"{p}_s") for p in PHASES}),
        clock=t.clock,
    )


def _check_report(i: int, r: object) -> StageTimes:
    # The protocol has validated its fields (`core.protocol.StageTimes`); a malformed report is
    # rejected when drained, never here, where it would fail the whole batch's write.
    if not isinstance(r, StageTimes):
        raise TypeError(
            f"reports[{i}] must be a core.protocol.StageTimes report, got {type(r).__name__}"
        )
    return r


def _bound(name: str, value: int | None, least: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least} (or None), got {value!r}")


class StageTimesMixin(StoreBase):
    def add_stage_times(self, job_id: str, reports: Sequence[StageTimes]) -> int:
        """Append the workers' stage-time reports in one transaction, one row per rank and
        interval. Intervals already stored (same generation, rank and `to_step`) or repeated in
        `reports` are skipped (the first one stands); returns the number of rows inserted.
        The protocol has validated each report's fields; an item that is not a `StageTimes`
        raises TypeError naming its index, before anything is written."""
        by_key: dict[Key, StageTimes] = {}
        for i, r in enumerate(reports):
            by_key.setdefault(_key(_check_report(i, r)), r)
        tried: set[Key] = set()  # intervals an earlier try of this call inserted (may have landed)

        def tx(s: Session) -> int:
            self._job(s, job_id)
            if not by_key:
                return 0
            existing: set[Key] = set()
            to_steps = sorted({k[2] for k in by_key})
            for i in range(0, len(to_steps), _CHUNK):
                chunk = to_steps[i : i + _CHUNK]
                existing.update(
                    (g, r, t)
                    for g, r, t in s.execute(
                        select(StageTime.generation, StageTime.rank, StageTime.to_step).where(
                            StageTime.job_id == job_id, StageTime.to_step.in_(chunk)
                        )
                    )
                )
            new = [(k, r) for k, r in sorted(by_key.items()) if k not in existing]
            ours = len(existing & tried)  # landed by a try whose acknowledgement was lost
            tried.update(k for k, _ in new)
            if new:
                s.execute(insert(StageTime), [_columns(job_id, r) for _, r in new])
            return len(new) + ours

        return self._write("add_stage_times", tx)

    def stage_times(
        self, job_id: str, since_step: int | None = None, last_intervals: int | None = None
    ) -> list[StageTimesRow]:
        """The job's stage-time rows ordered by (to_step, rank, generation). `since_step`:
        only intervals that end after it (to_step > since_step: what a reader that has seen up
        to that step is missing). `last_intervals`: only the rows of the newest that many
        distinct `to_step` values (every rank's row of each), so a display reads a bounded
        amount of a long job. Both together: the rows that pass both."""
        _bound("since_step", since_step, 0)
        _bound("last_intervals", last_intervals, 1)

        def tx(s: Session) -> list[StageTimesRow]:
            self._job(s, job_id)
            q = select(StageTime).where(StageTime.job_id == job_id)
            if since_step is not None:
                q = q.where(StageTime.to_step > since_step)
            if last_intervals is not None:
                newest = (
                    select(StageTime.to_step)
                    .where(StageTime.job_id == job_id)
                    .distinct()
                    .order_by(StageTime.to_step.desc())
                    .limit(last_intervals)
                    .subquery()
                )
                # NULL (no rows at all) compares false: nothing is returned
                q = q.where(
                    StageTime.to_step >= select(func.min(newest.c.to_step)).scalar_subquery()
                )
            q = q.order_by(StageTime.to_step, StageTime.rank, StageTime.generation)
            return [stage_times_row(t) for t in s.scalars(q)]

        return self._read("stage_times", tx)

    def add_step_traces(self, job_id: str, reports: Sequence[StepTrace]) -> int:
        """Store the ranks' traced steps (`core.protocol.StepTrace`), one row per request and
        rank (of a generation); one already stored, or repeated in `reports`, is skipped.
        Returns the number of rows inserted."""
        by_key: dict[tuple[str, int, int], StepTrace] = {}
        for i, r in enumerate(reports):
            if not isinstance(r, StepTrace):
                raise TypeError(
                    f"reports[{i}] must be a core.protocol.StepTrace report, got {type(r).__name__}"
                )
            by_key.setdefault((r.request, r.generation, r.rank), r)
        tried: set[tuple[str, int, int]] = set()

        def tx(s: Session) -> int:
            self._job(s, job_id)
            if not by_key:
                return 0
            requests = sorted({k[0] for k in by_key})
            existing = set(
                s.execute(
                    select(
                        StepTraceRecord.request, StepTraceRecord.generation, StepTraceRecord.rank
                    ).where(StepTraceRecord.job_id == job_id, StepTraceRecord.request.in_(requests))
                ).tuples()
            )
            new = [(k, r) for k, r in sorted(by_key.items()) if k not in existing]
            ours = len(existing & tried)
            tried.update(k for k, _ in new)
            if new:
                s.execute(
                    insert(StepTraceRecord),
                    [
                        {
                            "job_id": job_id,
                            "request": r.request,
                            "generation": r.generation,
                            "rank": r.rank,
                            "step": r.step,
                            "started": r.started,
                            "time": from_unix(r.time),
                            "layout_version": r.layout_version,
                            "stages": json.dumps(list(r.stages)),
                            "replica": r.replica,
                            "spans": json.dumps([x.model_dump(mode="json") for x in r.spans]),
                            "clock": r.clock,
                        }
                        for _, r in new
                    ],
                )
            return len(new) + ours

        return self._write("add_step_traces", tx)

    def step_traces(self, job_id: str, request: str | None = None) -> list[StepTraceRow]:
        """The traced steps of trace request `request` (default: the newest request that has
        any), ordered by rank and generation."""

        def tx(s: Session) -> list[StepTraceRow]:
            self._job(s, job_id)
            which = request
            if which is None:
                which = s.scalar(
                    select(StepTraceRecord.request)
                    .where(StepTraceRecord.job_id == job_id)
                    .order_by(StepTraceRecord.id.desc())
                    .limit(1)
                )
                if which is None:
                    return []
            rows = s.scalars(
                select(StepTraceRecord)
                .where(StepTraceRecord.job_id == job_id, StepTraceRecord.request == which)
                .order_by(StepTraceRecord.rank, StepTraceRecord.generation)
            )
            return [
                StepTraceRow(
                    request=t.request,
                    generation=t.generation,
                    rank=t.rank,
                    step=t.step,
                    started=t.started,
                    layout_version=t.layout_version,
                    stages=tuple(json.loads(t.stages)),
                    replica=t.replica,
                    spans=tuple(TraceSpan(**x) for x in json.loads(t.spans)),
                    clock=t.clock,
                )
                for t in rows
            ]

        return self._read("step_traces", tx)

    def trace_requests(self, job_id: str, limit: int = 20) -> list[tuple[str, int, float]]:
        """The job's answered trace requests, newest first: (request, step, started)."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")

        def tx(s: Session) -> list[tuple[str, int, float]]:
            self._job(s, job_id)
            rows = s.execute(
                select(
                    StepTraceRecord.request,
                    func.min(StepTraceRecord.step),
                    func.min(StepTraceRecord.started),
                    func.max(StepTraceRecord.id),
                )
                .where(StepTraceRecord.job_id == job_id)
                .group_by(StepTraceRecord.request)
                .order_by(func.max(StepTraceRecord.id).desc())
                .limit(limit)
            )
            return [(r[0], r[1], r[2]) for r in rows]

        return self._read("trace_requests", tx)
