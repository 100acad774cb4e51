"""Per-step training metrics and held-out evaluations.

Metrics arrive as the workers' typed reports (`core.protocol.Metrics`), already validated by
the protocol (bounds; non-finite readings are None), and are stored one row per step."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from pipetransformer.core.protocol import Metrics
from pipetransformer.core.spec import MAX_CONTROL_EVERY
from pipetransformer.store.base import StoreBase
from pipetransformer.store.rows import EvaluationRow, MetricRow, PeakMemory
from pipetransformer.store.tables import Evaluation, Metric, utcnow
from pipetransformer.store.values import finite_or_none, from_unix, unix

# How far back (in metric rows) `latest_peak_memory` looks: workers send peaks at every control
# point, at most MAX_CONTROL_EVERY steps apart, so a job still reporting them has one in there;
# the bound keeps a long CPU job (no peaks at all) from scanning every row it ever stored.
PEAK_LOOKBACK_STEPS = MAX_CONTROL_EVERY
# Steps looked up per statement: keeps under the databases' bind-parameter limits.
_CHUNK = 500


def _json_list(values: Sequence[float | None] | None) -> str | None:
    return None if values is None else json.dumps(list(values), allow_nan=False)


def _columns(job_id: str, r: Metrics) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "step": r.step,
        "epoch": r.epoch,
        "loss": r.loss,
        "samples_per_s": r.samples_per_s,
        "lr": r.lr,
        "time": from_unix(r.time),
        "frozen": r.frozen,
        "grad_norms": _json_list(r.grad_norms),
        "mfu": r.mfu,
        "peak_memory_mib": _json_list(r.peak_memory_mib),
    }


def metric_row(m: Metric) -> MetricRow:
    return MetricRow(
        step=m.step,
        epoch=m.epoch,
        loss=m.loss,
        samples_per_s=m.samples_per_s,
        lr=m.lr,
        time=unix(m.time),
        frozen=m.frozen,
        grad_norms=None if m.grad_norms is None else json.loads(m.grad_norms),
        mfu=m.mfu,
        peak_memory_mib=None if m.peak_memory_mib is None else json.loads(m.peak_memory_mib),
    )


def latest_peak(s: Session, job_id: str) -> PeakMemory | None:
    """The newest of the job's last `PEAK_LOOKBACK_STEPS` rows that carries peak memory."""
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
    return PeakMemory(step=row.step, peak_memory_mib=json.loads(row.peak_memory_mib))


class MetricsMixin(StoreBase):
    def add_metrics(self, job_id: str, reports: Sequence[Metrics]) -> int:
        """Append the workers' step reports in one transaction: step, epoch, loss,
        samples_per_s, lr, time, the freeze boundary the step trained under (`frozen`), and
        where reported `grad_norms` (per block), `mfu` (a fraction) and `peak_memory_mib` (per
        rank). Steps already stored (or repeated in `reports`) are skipped; returns the number
        of rows inserted. The protocol has validated them (`core.protocol.Metrics`): bounds,
        and non-finite readings as None, which is stored as NULL."""
        by_step: dict[int, Metrics] = {}
        for i, r in enumerate(reports):
            if not isinstance(r, Metrics):
                raise TypeError(
                    f"reports[{i}] must be a core.protocol.Metrics report, got {type(r).__name__}"
                )
            by_step.setdefault(r.step, r)
        tried: set[int] = set()  # steps an earlier try of this call inserted (may have landed)

        def tx(s: Session) -> int:
            self._job(s, job_id)
            if not by_step:
                return 0
            existing: set[int] = set()
            steps = sorted(by_step)
            for i in range(0, len(steps), _CHUNK):
                chunk = steps[i : i + _CHUNK]
                existing.update(
                    s.scalars(
                        select(Metric.step).where(Metric.job_id == job_id, Metric.step.in_(chunk))
                    )
                )
            new = [
                _columns(job_id, r) for step, r in sorted(by_step.items()) if step not in existing
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

    def metrics(self, job_id: str, last: int | None = None) -> list[MetricRow]:
        """Training metrics ordered by step (`MetricRow`: what is unknown, or was stored before
        the revision that added it, is None). `last`: only the newest that many steps (a
        display that needs the latest rate need not read a long job's every row)."""
        if last is not None and last < 1:
            raise ValueError(f"last must be >= 1 (or None for every row), got {last}")

        def tx(s: Session) -> list[MetricRow]:
            self._job(s, job_id)
            q = select(Metric).where(Metric.job_id == job_id)
            if last is None:
                rows = list(s.scalars(q.order_by(Metric.step)))
            else:
                rows = list(s.scalars(q.order_by(Metric.step.desc()).limit(last)))[::-1]
            return [metric_row(m) for m in rows]

        return self._read("metrics", tx)

    def latest_peak_memory(self, job_id: str) -> PeakMemory | None:
        """The newest per-rank peak GPU memory a step carried, or None where none of the newest
        `PEAK_LOOKBACK_STEPS` rows has one (a CPU job, an older worker). Workers send it only at
        control points, so the newest row rarely has it."""

        def tx(s: Session) -> PeakMemory | None:
            self._job(s, job_id)
            return latest_peak(s, job_id)

        return self._read("latest_peak_memory", tx)

    def add_evaluation(
        self,
        job_id: str,
        epoch: int,
        step: int,
        accuracy: float,
        loss: float | None,
        time: float,
        f1: float | None = None,
    ) -> bool:
        """Record a held-out evaluation (accuracy, and question answering's F1, as fractions
        0..1). A step already evaluated is skipped (returns False). The job's `accuracy` becomes
        that of its latest step."""
        for name, value in (("accuracy", accuracy), ("f1", 0.0 if f1 is None else f1)):
            if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
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
                    loss=finite_or_none(loss),
                    time=from_unix(time),
                    f1=None if f1 is None else float(f1),
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

    def evaluations(self, job_id: str) -> list[EvaluationRow]:
        """Held-out evaluations ordered by step."""

        def tx(s: Session) -> list[EvaluationRow]:
            self._job(s, job_id)
            rows = s.scalars(
                select(Evaluation).where(Evaluation.job_id == job_id).order_by(Evaluation.step)
            )
            return [
                EvaluationRow(
                    epoch=e.epoch,
                    step=e.step,
                    accuracy=e.accuracy,
                    loss=e.loss,
                    time=unix(e.time),
                    f1=e.f1,
                )
                for e in rows
            ]

        return self._read("evaluations", tx)
