"""One job at a glance, in one read: its row, current layout, newest committed checkpoint,
newest step and newest peak memory (`pipetransformer status`, the dashboard header)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipetransformer.core.readings import perplexity
from pipetransformer.core.state import Layout
from pipetransformer.core.tasks import task_of
from pipetransformer.store.base import StoreBase
from pipetransformer.store.jobs import current_layout_json, job_info
from pipetransformer.store.metrics import latest_peak
from pipetransformer.store.rows import JobStatus, StatusCheckpoint, StatusMetrics
from pipetransformer.store.tables import Checkpoint, Evaluation, Metric
from pipetransformer.store.values import unix


class StatusMixin(StoreBase):
    def status(self, job_id: str) -> JobStatus:
        """A summary of one job (`JobStatus`); `status(...).model_dump(mode="json")` is what
        `pipetransformer status --json` prints."""

        def tx(s: Session) -> JobStatus:
            row = self._job(s, job_id)
            layout_json = s.scalar(select(current_layout_json(job_id)))
            job = job_info(row, layout_json)  # its boundary is that layout's
            ckpt = s.scalar(
                select(Checkpoint)
                .where(Checkpoint.job_id == job_id, Checkpoint.state == "committed")
                .order_by(Checkpoint.step.desc())
                .limit(1)
            )
            last = s.scalar(
                select(Metric).where(Metric.job_id == job_id).order_by(Metric.step.desc()).limit(1)
            )
            peak = latest_peak(s, job_id)
            held = s.scalar(
                select(Evaluation.loss)
                .where(Evaluation.job_id == job_id)
                .order_by(Evaluation.step.desc())
                .limit(1)
            )
            per_token = task_of(job.spec.model).targets_per_token
            return JobStatus(
                id=job.id,
                name=job.name,
                state=job.state,
                message=job.message,
                epoch=job.epoch,
                epochs=job.spec.training.epochs,
                step=job.step,
                samples_consumed=job.samples_consumed,
                accuracy=job.accuracy,
                held_out_loss=held,
                perplexity=perplexity(held) if per_token and held is not None else None,
                lr=job.lr,
                freeze_boundary=job.freeze_boundary,
                layout_version=job.layout_version,
                layout=None if layout_json is None else Layout.model_validate_json(layout_json),
                checkpoint=None
                if ckpt is None
                else StatusCheckpoint(path=ckpt.path, step=ckpt.step),
                last_metrics=None
                if last is None
                else StatusMetrics(
                    step=last.step,
                    epoch=last.epoch,
                    loss=last.loss,
                    samples_per_s=last.samples_per_s,
                    lr=last.lr,
                    time=unix(last.time),
                    mfu=last.mfu,
                ),
                mfu=None if last is None else last.mfu,
                peak_memory_mib=None if peak is None else peak.peak_memory_mib,
                workdir=job.workdir,
                created_at=job.created_at,
                updated_at=job.updated_at,
            )

        return self._read("status", tx)
