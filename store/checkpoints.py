"""Checkpoints: committed once verified on disk, then pruned (deleted) or found corrupt."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipetransformer.store.base import StoreBase
from pipetransformer.store.errors import NotFound
from pipetransformer.store.rows import CheckpointInfo
from pipetransformer.store.tables import CHECKPOINT_STATES, CHECKSUM_MAX_CHARS, Checkpoint, utcnow
from pipetransformer.store.values import check_state


def checkpoint_info(row: Checkpoint) -> CheckpointInfo:
    return CheckpointInfo(
        id=row.id,
        job_id=row.job_id,
        step=row.step,
        epoch=row.epoch,
        layout_version=row.layout_version,
        path=row.path,
        size_bytes=row.size_bytes,
        checksum=row.checksum,
        samples_consumed=row.samples_consumed,
        state=row.state,
        created_at=row.created_at,
    )


class CheckpointsMixin(StoreBase):
    def commit_checkpoint(
        self,
        job_id: str,
        *,
        step: int,
        epoch: int,
        layout_version: int,
        path: str,
        size_bytes: int,
        checksum: str,
        samples_consumed: int,
    ) -> int:
        """Mark a fully written checkpoint usable; returns its id.

        Idempotent on (job, step): committing the same step again returns the same id, with the
        row updated to describe what is now on disk (a step re-reached after recovery rewrites
        the same directory) and its state back to "committed".
        """
        if not path:
            raise ValueError("checkpoint path must not be empty")
        if not checksum or len(checksum) > CHECKSUM_MAX_CHARS:
            # PostgreSQL enforces the column width; SQLite would silently store anything.
            raise ValueError(f"checkpoint checksum must be 1-{CHECKSUM_MAX_CHARS} characters")
        for name, value in (
            ("step", step),
            ("epoch", epoch),
            ("size_bytes", size_bytes),
            ("samples_consumed", samples_consumed),
        ):
            if value < 0:
                raise ValueError(f"checkpoint {name} must be >= 0, got {value}")
        values = {
            "epoch": epoch,
            "layout_version": layout_version,
            "path": str(path),
            "size_bytes": size_bytes,
            "checksum": checksum,
            "samples_consumed": samples_consumed,
            "state": "committed",
        }

        def tx(s: Session) -> int:
            self._job(s, job_id)
            row = s.scalar(
                select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
            )
            if row is None:
                row = Checkpoint(job_id=job_id, step=step, created_at=utcnow(), **values)
                s.add(row)
            else:
                changed = any(getattr(row, k) != v for k, v in values.items())
                for k, v in values.items():
                    setattr(row, k, v)
                if changed:
                    row.created_at = utcnow()
            s.flush()
            return row.id

        return self._write("commit_checkpoint", tx)

    def checkpoints(self, job_id: str, state: str | None = "committed") -> list[CheckpointInfo]:
        """The job's checkpoints in `state` (all if None), newest (highest step) first."""
        if state is not None:
            check_state("checkpoint", state, CHECKPOINT_STATES)

        def tx(s: Session) -> list[CheckpointInfo]:
            self._job(s, job_id)
            q = select(Checkpoint).where(Checkpoint.job_id == job_id)
            if state is not None:
                q = q.where(Checkpoint.state == state)
            rows = s.scalars(q.order_by(Checkpoint.step.desc()))
            return [checkpoint_info(r) for r in rows]

        return self._read("checkpoints", tx)

    def latest_checkpoint(self, job_id: str) -> CheckpointInfo | None:
        """The newest committed checkpoint, the one to resume from."""
        found = self.checkpoints(job_id, "committed")
        return found[0] if found else None

    def set_checkpoint_state(self, checkpoint_id: int, state: str) -> None:
        """Mark a checkpoint deleted (pruned) or corrupt (failed verification), or committed."""
        check_state("checkpoint", state, CHECKPOINT_STATES)

        def tx(s: Session) -> None:
            row = s.get(Checkpoint, checkpoint_id)
            if row is None:
                raise NotFound(f"no checkpoint with id {checkpoint_id}")
            row.state = state

        self._write("set_checkpoint_state", tx)
