"""The torch side of a job's task (`pipetransformer.core.tasks`, chosen by the spec's
`model.task`): the loss of a batch's real samples and how the held-out split is scored.

The loss is a sum over the real samples (padding targets are `IGNORE`), divided by the task's
`loss_terms` (question answering: the mean of the start and end losses, as `transformers`'
`*ForQuestionAnswering` computes it); the pipeline divides it by the global batch's real sample
count (`trainer.pipeline.MaskedCrossEntropy`); a language model's is a sum over its counted
tokens, divided by the global batch's counted tokens.

A `Scorer` accumulates held-out batches on the last stage and is summed over the replicas:
classification counts correct argmaxes; question answering keeps each window's best span and
scores each question's best over its windows against its answers (`trainer.sources.qa`); a
language model counts its correctly predicted next tokens."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetransformer.core.sampler import IGNORE
from pipetransformer.core.tasks import CAUSAL_LM, CLASSIFICATION, QUESTION_ANSWERING, Task


def loss_sum(task: Task, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed loss of the real samples of one batch (a target per token: of its counted
    tokens, logits [B, T, V] against targets [B, T])."""
    if task.targets_per_token:
        logits, target = logits.flatten(0, 1), target.flatten()
    loss = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum")
    return loss / task.loss_terms  # exact for 1 and 2 (powers of two)


class Scorer(Protocol):
    """Held-out scoring, batch by batch, on the last stage."""

    def add(
        self, logits: torch.Tensor, targets: torch.Tensor, valid: np.ndarray, indices: np.ndarray
    ) -> None: ...

    def all_reduce(self, group: dist.ProcessGroup) -> None: ...

    def result(self) -> tuple[float, float | None]:
        """The metric (a fraction) and, where the task reports it, F1."""
        ...


class _Correct:
    """Classification: the fraction of samples whose argmax is the label."""

    def __init__(self, split: Any, device: torch.device) -> None:
        self.total = len(split)
        self.correct = torch.zeros(1, device=device)

    def add(
        self, logits: torch.Tensor, targets: torch.Tensor, valid: np.ndarray, indices: np.ndarray
    ) -> None:
        mask = torch.from_numpy(valid).to(logits.device)
        self.correct += (logits.argmax(1) == targets)[mask].sum()

    def all_reduce(self, group: dist.ProcessGroup) -> None:
        dist.all_reduce(self.correct, group=group)

    def result(self) -> tuple[float, float | None]:
        return float(self.correct) / self.total, None


class _Spans:
    """Question answering: each window's best span (scored here: 1, its score, first and end
    character), then the split's SQuAD scoring per question (exact match, F1)."""

    def __init__(self, split: Any, device: torch.device) -> None:
        self.split = split
        self.spans = torch.zeros(len(split), 4, dtype=torch.float64, device=device)

    def add(
        self, logits: torch.Tensor, targets: torch.Tensor, valid: np.ndarray, indices: np.ndarray
    ) -> None:
        if not valid.any():
            return
        real = indices[valid]
        mask = torch.from_numpy(valid).to(logits.device)
        best = self.split.spans(logits[mask].float(), real)
        at = torch.from_numpy(real).to(self.spans.device)
        self.spans[at, 0] = 1.0
        self.spans[at, 1:] = best.to(self.spans.device)

    def all_reduce(self, group: dist.ProcessGroup) -> None:
        dist.all_reduce(self.spans, group=group)  # one replica scored each window, the rest 0

    def result(self) -> tuple[float, float | None]:
        return self.split.score(self.spans.cpu())


class _NextTokens:
    """Causal language modelling: the fraction of counted tokens (targets not IGNORE, in real
    rows) whose argmax is the next token."""

    def __init__(self, split: Any, device: torch.device) -> None:
        self.total = split.num_labels
        self.correct = torch.zeros(1, device=device)

    def add(
        self, logits: torch.Tensor, targets: torch.Tensor, valid: np.ndarray, indices: np.ndarray
    ) -> None:
        rows = torch.from_numpy(valid).to(logits.device)
        counted = (targets != IGNORE) & rows[:, None]
        self.correct += ((logits.argmax(-1) == targets) & counted).sum()

    def all_reduce(self, group: dist.ProcessGroup) -> None:
        dist.all_reduce(self.correct, group=group)

    def result(self) -> tuple[float, float | None]:
        return float(self.correct) / max(self.total, 1), None


_SCORERS: dict[str, type[_Correct] | type[_Spans] | type[_NextTokens]] = {
    CLASSIFICATION.name: _Correct,
    QUESTION_ANSWERING.name: _Spans,
    CAUSAL_LM.name: _NextTokens,
}


def scorer(task: Task, split: Any, device: torch.device) -> Scorer:
    """A fresh scorer of `task` for the held-out `split`."""
    return _SCORERS[task.name](split, device)
