"""One rank's training state as one object that checkpoints itself (torchtitan's `Stateful` train
state is the model): where training is, the layout it runs under, and AutoFreeze's memory.

The layout is the one owner of the freeze boundary (docs/architecture.md, "Who owns what"): the
boundary is `layout.freeze_boundary` and nothing here keeps a second copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipetransformer.core.freeze import FreezeState
from pipetransformer.core.protocol import Assignment
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout, TrainingState


@dataclass
class TrainState:
    progress: TrainingState  # epoch, step, sampler cursor, LR, last committed checkpoint
    layout: Layout  # the layout in force
    freeze: FreezeState  # AutoFreeze's memory between decision points (not the boundary)

    @classmethod
    def start(
        cls, assignment: Assignment, layout: Layout, meta: dict[str, Any] | None
    ) -> TrainState:
        """Where a generation starts: the assignment's state and layout, and the freeze memory of
        the checkpoint it resumes from (`meta`, None when it starts from scratch)."""
        saved = (meta or {}).get("freeze")
        freeze = FreezeState.from_dict(saved) if saved else FreezeState()
        return cls(assignment.start, layout, freeze)

    @property
    def boundary(self) -> int:
        return self.layout.freeze_boundary

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def epoch(self) -> int:
        return self.progress.epoch

    def advance(self, *, cursor: int, epoch_len: int, lr: float) -> bool:
        """One optimizer step done, the sampler now at `cursor` of the epoch; returns whether it
        ended the epoch."""
        p = self.progress
        epoch, done = p.epoch, cursor >= epoch_len
        if done:
            epoch, cursor = epoch + 1, 0
        self.progress = p.model_copy(
            update={"epoch": epoch, "step": p.step + 1, "samples_consumed": cursor, "lr": lr}
        )
        return done

    def adopt(self, layout: Layout) -> None:
        """Train under `layout` from now on (a re-layout)."""
        self.layout = layout
        self.progress = self.progress.model_copy(update={"layout_version": layout.version})

    def committed(self, path: str) -> None:
        self.progress = self.progress.model_copy(update={"checkpoint": path})

    def state_dict(
        self, spec: JobSpec, reason: str, continues_under: Layout | None
    ) -> dict[str, Any]:
        """What a checkpoint records besides the weights (its `meta.json`): the position, the
        layout training continues under from this state (a re-layout checkpoint is written under
        the old layout for the new one: weights reshard by block name), AutoFreeze's memory, and
        what the weights are for (a fine-tuning job checks it at submission)."""
        layout = continues_under or self.layout
        return self.progress.model_dump() | {
            "layout_version": self.layout.version,
            "layout": layout.model_dump(),
            "reason": reason,
            "freeze": self.freeze.to_dict(),
            "model": spec.model.model_dump(),
        }
