"""What the freeze policy read at each decision point: one row per decision point (revision 0010).

Rank 0 reports `core.protocol.FreezeSignal` at every AutoFreeze decision point of policies
`output` and `gradient`. One decision point is one row, keyed by its step: after a recovery the
resumed generation takes the decision points since its checkpoint again, and its reading is the
one the job followed, so a report replaces the stored one only when its generation is higher;
any other (a replayed queue entry, a late report of the failed generation) is skipped. Reads
return `FreezeSignalRow`s by step, what the dashboard's Freezing view draws."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from pipetransformer.core.protocol import FreezeSignal
from pipetransformer.store.base import StoreBase
from pipetransformer.store.rows import FreezeSignalRow
from pipetransformer.store.tables import FreezeSignalRecord
from pipetransformer.store.values import from_unix, problems, unix


def _checked(report: object) -> FreezeSignal:
    """The report as the protocol validates it, or TypeError/ValueError before any write.
    Validated again: a pydantic model is not checked on assignment, so a report changed after
    parsing (or built with `model_construct`) may no longer be one the protocol accepts."""
    if not isinstance(report, FreezeSignal):
        raise TypeError(
            f"report must be a core.protocol.FreezeSignal report, got {type(report).__name__}"
        )
    try:
        return FreezeSignal.model_validate(report.model_dump())
    except ValidationError as exc:
        raise ValueError(f"not a valid FreezeSignal: {problems(exc, 'report')}") from None


def _columns(r: FreezeSignal) -> dict[str, Any]:
    return {
        "generation": r.generation,
        "time": from_unix(r.time),
        "decision": r.decision,
        "boundary": r.boundary,
        "bound": r.bound,
        "policy": r.policy,
        "statistic": r.statistic,
        # None where unknown: the protocol has made every non-finite reading None already
        "signal": json.dumps(list(r.signal), allow_nan=False),
        "limits": json.dumps(list(r.limits), allow_nan=False),
        "probe_s": r.probe_s,
    }


def freeze_signal_row(f: FreezeSignalRecord) -> FreezeSignalRow:
    return FreezeSignalRow(
        step=f.step,
        generation=f.generation,
        time=unix(f.time),
        decision=f.decision,
        boundary=f.boundary,
        bound=f.bound,
        policy=f.policy,
        statistic=f.statistic,
        signal=tuple(json.loads(f.signal)),
        limits=tuple(json.loads(f.limits)),
        probe_s=f.probe_s,
    )


class FreezeSignalsMixin(StoreBase):
    def add_freeze_signal(self, job_id: str, report: FreezeSignal) -> bool:
        """Store what the freeze policy read at one decision point (`report`, from rank 0).
        A decision point already stored (same step) is replaced only by a report of a higher
        generation (a recovery took it again: that reading is the one the job followed);
        otherwise the report is skipped. Returns whether it was stored. A report that is not a
        `FreezeSignal` raises TypeError, one the protocol would refuse ValueError, before
        anything is written."""
        r = _checked(report)
        columns = _columns(r)
        tried = False  # an earlier try of this call wrote it (its commit may have landed)

        def tx(s: Session) -> bool:
            nonlocal tried
            self._job(s, job_id)
            stored = s.execute(
                select(FreezeSignalRecord.id, FreezeSignalRecord.generation).where(
                    FreezeSignalRecord.job_id == job_id, FreezeSignalRecord.step == r.step
                )
            ).first()
            if stored is not None and stored.generation >= r.generation:
                return tried and stored.generation == r.generation
            tried = True
            if stored is None:
                s.execute(
                    insert(FreezeSignalRecord), [{"job_id": job_id, "step": r.step, **columns}]
                )
            else:
                s.execute(
                    update(FreezeSignalRecord)
                    .where(FreezeSignalRecord.id == stored.id)
                    .values(**columns)
                )
            return True

        return self._write("add_freeze_signal", tx)

    def freeze_signals(self, job_id: str) -> list[FreezeSignalRow]:
        """The job's decision points' readings, ordered by step (none for jobs whose policy
        reads nothing, `schedule` and `off`, nor for jobs run before revision 0010)."""

        def tx(s: Session) -> list[FreezeSignalRow]:
            self._job(s, job_id)
            rows = s.scalars(
                select(FreezeSignalRecord)
                .where(FreezeSignalRecord.job_id == job_id)
                .order_by(FreezeSignalRecord.step)
            )
            return [freeze_signal_row(f) for f in rows]

        return self._read("freeze_signals", tx)
