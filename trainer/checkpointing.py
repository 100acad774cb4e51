"""The train loop's checkpointing collaborator: when to write a checkpoint, writing it (in the
background where the spec allows), and reporting it once it is durable so the controller can
commit it. The mechanics of writing and sealing are in `trainer.checkpoint`."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from torch import nn

from pipetransformer.core.protocol import CheckpointFailed, CheckpointWritten
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout, TrainingState
from pipetransformer.core.train_state import TrainState
from pipetransformer.trainer.checkpoint import (
    AsyncCheckpointer,
    CheckpointWriteError,
    checkpoint_due,
    tied_names,
)
from pipetransformer.trainer.collective import from_rank0
from pipetransformer.trainer.process import Reporter

log = logging.getLogger("pipetransformer.worker")


class Checkpointing:
    """At most one checkpoint in flight per rank; every method is collective (all ranks call it
    at the same step)."""

    def __init__(
        self, spec: JobSpec, rank: int, reporter: Reporter, directory: str, start: TrainingState
    ):
        self.spec, self.rank, self.reporter = spec, rank, reporter
        self.directory = Path(directory)
        self.saved_step = start.step if start.checkpoint else -1  # the last step written
        self._writer: AsyncCheckpointer | None = None  # made at the first checkpoint
        self._pending: TrainingState | None = None  # the state the one in flight snapshots
        # when the last checkpoint started, or the first step ended (for every_seconds)
        self._since: float | None = None

    def save(
        self,
        ts: TrainState,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        reason: str,
        wait: bool = True,
        continues_under: Layout | None = None,
    ) -> None:
        """Snapshot the current state (once per step) and write it; rank 0 reports it once every
        shard is durable and the directory sealed. With `wait` (re-layout, stop, leave, end) it
        is complete and reported before this returns; otherwise (periodic, with
        checkpoint.async_save) training goes on while it persists and a later step reports it."""
        writer = self._checkpointer()
        # at most one in flight: collect the previous (background) one first
        if not self.collect(ts, block=True, tolerate=True):
            if self.saved_step == ts.step:  # it was this very step's: write it again
                self.saved_step = -1
        if self.saved_step != ts.step:
            path = self.directory / f"step-{ts.step:08d}"
            meta = ts.state_dict(self.spec, reason, continues_under)
            writer.start(path, model, optimizer, meta, tied_names(self.spec.model))
            self._pending, self._since = ts.progress, time.monotonic()
            self.saved_step = ts.step
        if wait or not writer.async_save:
            self.collect(ts, block=True, tolerate=not wait)

    def _checkpointer(self) -> AsyncCheckpointer:
        """A collective the first time (it creates the gloo group background writes use)."""
        if self._writer is None:
            self._writer = AsyncCheckpointer(async_save=self.spec.checkpoint.async_save)
        return self._writer

    def collect(self, ts: TrainState, block: bool, tolerate: bool = True) -> bool:
        """Collect a checkpoint that has been sealed (wait for it if `block`): rank 0 reports it
        with the state as of the step it snapshots; every rank records its path in `ts`.

        A checkpoint that failed to write or seal was never committed. With `tolerate` (a
        background checkpoint) that is reported (`checkpoint_failed`) and training goes on: the
        last committed checkpoint stays the resume point and the next interval tries again.
        Returns False for such a failure."""
        writer = self._writer
        try:
            saved = None if writer is None else (writer.wait() if block else writer.poll())
        except CheckpointWriteError as exc:
            if not tolerate:
                raise
            log.warning("rank %d: %s; training goes on", self.rank, exc)
            if self.rank == 0:
                self.reporter.emit(CheckpointFailed, step=self._pending.step, error=str(exc))
            return False
        if saved is None:
            return True
        if self.rank == 0:
            self.reporter.emit(
                CheckpointWritten,
                path=saved.path,
                size_bytes=saved.size_bytes,
                checksum=saved.checksum,
                seconds=saved.seconds,
                blocked_s=saved.blocked_s,
                state=self._pending,
                layout_version=saved.meta["layout_version"],
            )
        ts.committed(saved.path)
        return True

    def periodic(
        self,
        ts: TrainState,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        epoch_done: bool,
    ) -> None:
        """At every step boundary: report a checkpoint that finished sealing, and start the next
        one when an interval of `checkpoint` has elapsed (CheckpointSpec, checkpoint_due)."""
        self.collect(ts, block=False)
        if self._since is None:
            self._since = time.monotonic()
        since, spec = self._since, self.spec
        seconds = None
        if spec.checkpoint.every_seconds is not None and (
            ts.step % spec.runtime.control_every_steps == 0 or epoch_done
        ):
            # clocks differ between ranks: rank 0's decides, so every rank takes the same step
            seconds = from_rank0(self.rank, lambda: time.monotonic() - since)
        due = checkpoint_due(
            spec.checkpoint,
            steps_since=ts.step - max(self.saved_step, 0),
            epoch=ts.epoch,
            epoch_end=epoch_done,
            seconds_since=seconds,
        )
        if due:
            self.save(ts, model, optimizer, due, wait=False)
