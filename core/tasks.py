"""What a job learns to do (the spec's `model.task`), the second axis beside the model family:
the shape of its head's output, its targets, how its loss is averaged, its held-out metric and
the head's FLOPs. Pure: the torch side (the loss itself, held-out scoring) is
`pipetransformer.trainer.tasks`, chosen by the same name, never by the shape of a tensor.

- `classification`: one label per sample (images, sentences, sentence pairs): logits [B, K],
  targets [B], cross-entropy, accuracy.
- `question-answering`: an extractive span per window (SQuAD): start and end logits [B, T, 2],
  targets [B, 2] (the span's first and last token), the mean of the start and end losses (as
  `transformers`' `*ForQuestionAnswering` computes it), exact match (and F1).
- `causal-lm`: the next token at every position (decoder-only language models): logits
  [B, T, V] over the vocabulary (a causal-lm model's `num_classes` is its `vocab_size`: each
  next token is a class), targets [B, T] (the next token's id, `IGNORE` where no loss: a
  document's last token, padding), cross-entropy per target token, next-token accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pipetransformer.core.spec import ModelSpec

TaskName = Literal["classification", "question-answering", "causal-lm"]


@dataclass(frozen=True)
class Task:
    name: TaskName
    metric: str  # what the held-out `accuracy` measures, in words
    # spec.model.num_classes a head of this task must have (None: any)
    fixed_outputs: int | None = None
    per_token: bool = False  # the head reads every token, not the first
    loss_terms: int = 1  # cross-entropies averaged into one sample's loss
    targets_per_sample: int = 1
    reports_f1: bool = False  # held-out F1 beside the metric (SQuAD's token overlap)
    # the head's outputs are the model's vocabulary (num_classes is the model's vocab_size)
    vocab_outputs: bool = False
    targets_per_token: bool = False  # one target per token ([B, T]), not per sample
    # the table columns (data.columns roles) its rows are read from, where set
    reads: tuple[str, ...] = ("image", "text", "text_pair", "label")

    def num_outputs(self, num_classes: int) -> int:
        """The head's outputs for a spec's `num_classes`."""
        return self.fixed_outputs if self.fixed_outputs is not None else num_classes

    def output_shape(self, batch: int, tokens: int, num_classes: int) -> tuple[int, ...]:
        """The logits of one batch: [B, K], or [B, T, K] for a per-token head."""
        if self.per_token:
            return (batch, tokens, self.num_outputs(num_classes))
        return (batch, num_classes)

    def target_shape(self, batch: int, tokens: int | None = None) -> tuple[int, ...]:
        """The targets of one batch: [B], [B, targets_per_sample], or [B, T] for a task with
        a target per token (`tokens` is then required)."""
        if self.targets_per_token:
            if tokens is None:
                raise ValueError(f"{self.name}: the targets' shape needs the token count")
            return (batch, tokens)
        return (batch,) if self.targets_per_sample == 1 else (batch, self.targets_per_sample)

    def head_flops(self, dim: int, num_classes: int, tokens: int) -> float:
        """Forward FLOPs of the head's output layer for one sample."""
        reads = tokens if self.per_token else 1
        return float(2 * dim * self.num_outputs(num_classes) * reads)


CLASSIFICATION = Task("classification", metric="accuracy")
QUESTION_ANSWERING = Task(
    "question-answering",
    metric="exact match",
    fixed_outputs=2,  # start and end logits
    per_token=True,
    loss_terms=2,
    targets_per_sample=2,
    reports_f1=True,
    reads=("id", "question", "context", "answers"),
)

CAUSAL_LM = Task(
    "causal-lm",
    metric="next-token accuracy",
    per_token=True,
    vocab_outputs=True,
    targets_per_token=True,
    reads=("text",),
)

TASKS: dict[str, Task] = {
    task.name: task for task in (CLASSIFICATION, QUESTION_ANSWERING, CAUSAL_LM)
}


def task_of(model: ModelSpec | str) -> Task:
    """The task a model (or a task name) trains for."""
    name = model if isinstance(model, str) else model.task
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"model.task {name!r} is not available; choose one of {', '.join(TASKS)}"
        ) from None
