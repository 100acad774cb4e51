"""Checkpoints as the controller owns them (`Checkpoints`): a checkpoint a rank 0 sealed is
committed only once verified against its manifest on disk (`_commit_checkpoint`), the newest
`checkpoint.keep` committed ones are kept (`_retain`), and a generation resumes from the last
committed one that is still intact (`resume_point`: corrupt ones are marked and skipped, and the
freeze boundary is the checkpoint's own).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pipetransformer.core.protocol import CheckpointWritten
from pipetransformer.core.state import TrainingState
from pipetransformer.edge.manifest import (
    CheckpointError,
    meta_boundary,
    read_meta,
    verify_checkpoint,
)
from pipetransformer.orchestrator.controller.base import ControllerBase
from pipetransformer.orchestrator.controller.job import ResumePoint, job_dir


class Checkpoints(ControllerBase):
    """Committing, keeping and resuming from checkpoints."""

    @property
    def checkpoint_dir(self) -> Path:
        return job_dir(self.job.workdir, self.job_id) / "checkpoints"

    def resume_point(self) -> ResumePoint:
        """The last committed checkpoint that is intact on disk; corrupt ones are marked and
        skipped (the previous committed one is used). The freeze boundary is the checkpoint's
        own (the layout its meta records), so falling back to an older checkpoint takes its
        boundary back too: the steps after it are trained again, and the policy decides again."""
        for ckpt in self.store.checkpoints(self.job_id):
            try:
                verify_checkpoint(ckpt.path, ckpt.checksum)
                meta = read_meta(ckpt.path)  # covered by the manifest just verified
            except (CheckpointError, ValueError) as exc:
                self.store.set_checkpoint_state(ckpt.id, "corrupt")
                self.store.add_event(self.job_id, "checkpoint_corrupt", str(exc))
                continue
            frozen = meta_boundary(meta)
            state = TrainingState(
                epoch=ckpt.epoch,
                step=ckpt.step,
                samples_consumed=ckpt.samples_consumed,
                lr=self.job.lr,
                layout_version=ckpt.layout_version,
                checkpoint=ckpt.path,
            )
            return ResumePoint(state, ckpt, self.job.freeze_boundary if frozen is None else frozen)
        return ResumePoint(TrainingState(), None, 0)

    def _commit_checkpoint(self, e: CheckpointWritten) -> None:
        state = e.state
        try:
            size = verify_checkpoint(e.path, e.checksum)
        except CheckpointError as exc:
            self._record_event("checkpoint_rejected", str(exc), rank=e.rank)
            return
        self.store.commit_checkpoint(
            self.job_id,
            step=state.step,
            epoch=state.epoch,
            layout_version=e.layout_version,
            path=e.path,
            size_bytes=size,
            checksum=e.checksum,
            samples_consumed=state.samples_consumed,
        )
        if state.step >= self.progress.step:  # an async commit lands after later metrics
            self.store.update_progress(self.job_id, self._current(state))
        self._record_event(
            "checkpoint_committed",
            f"step {state.step} ({size / 1e6:.1f} MB, {e.seconds:.2f}s)",
            data={"path": e.path, "step": state.step},
        )
        self._retain()

    def _retain(self) -> None:
        """Keep the newest `checkpoint.keep` committed checkpoints; delete older ones."""
        committed = self.store.checkpoints(self.job_id)
        for old in committed[self.spec.checkpoint.keep :]:
            shutil.rmtree(old.path, ignore_errors=True)
            self.store.set_checkpoint_state(old.id, "deleted")
