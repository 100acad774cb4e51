"""Hugging Face BERT and RoBERTa checkpoints (`transformers`' `Bert*` and `Roberta*` classes),
read from their config.json; built by `pipetransformer.models.bert`.

Units under the checkpoint's own names: `embed` is `<p>.embeddings.*`, `blocks.<i>` is
`<p>.encoder.layer.<i>.*`, `head` is BERT's `bert.pooler.*` + `classifier.*` or RoBERTa's
`classifier.dense.*` + `classifier.out_proj.*` (sequence classification), or `qa_outputs.*`
(question answering). A padded batch needs its attention mask in every layer, so the first
stage reads ids, token types and mask stacked ([B, 3, T]) and the stages pass the mask as one
extra channel of the hidden states ([B, T, D + 1])."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetransformer.core.families.base import Architecture, Family, encoder_adapter_layers
from pipetransformer.core.tasks import CLASSIFICATION, QUESTION_ANSWERING

if TYPE_CHECKING:
    from pipetransformer.core.spec import ModelSpec


@dataclass(frozen=True)
class BertFamily(Family):
    position_offset: int = 0  # RoBERTa's positions start after its padding index

    def adapter_layers(self, model: ModelSpec) -> dict[str, list[tuple[int, int]]] | None:
        return encoder_adapter_layers(model.dim, self.hidden(model))

    def width(self, model: ModelSpec) -> int:
        return model.dim + 1  # the attention mask's channel

    def input_shape(self, model: ModelSpec, batch: int) -> tuple[int, ...]:
        return (batch, 3, model.seq_len or 0)  # ids, token types, attention mask

    def max_seq_len(self, arch: Architecture) -> int | None:
        if arch.max_position_embeddings is None:
            return None
        return arch.max_position_embeddings - self.position_offset

    def head_prefixes(self, arch: Architecture) -> tuple[str, ...]:
        if arch.task == "question-answering":
            return ("qa_outputs.",)
        if self.key_prefix == "bert":
            return ("bert.pooler.", "classifier.")
        return ("classifier.",)


TASKS = (CLASSIFICATION.name, QUESTION_ANSWERING.name)
BUILD = "pipetransformer.models.bert"

BERT = BertFamily(
    name="bert",
    source="checkpoint",
    modality="text",
    build=BUILD,
    tasks=TASKS,
    model_type="bert",
    architectures={
        "BertModel": "body",
        "BertForPreTraining": "body",
        "BertForMaskedLM": "body",
        "BertForSequenceClassification": "sequence-classification",
        "BertForQuestionAnswering": "question-answering",
    },
    task_classes={
        "classification": "BertForSequenceClassification",
        "question-answering": "BertForQuestionAnswering",
    },
)
ROBERTA = BertFamily(
    name="roberta",
    source="checkpoint",
    modality="text",
    build=BUILD,
    tasks=TASKS,
    model_type="roberta",
    architectures={
        "RobertaModel": "body",
        "RobertaForMaskedLM": "body",
        "RobertaForSequenceClassification": "sequence-classification",
        "RobertaForQuestionAnswering": "question-answering",
    },
    task_classes={
        "classification": "RobertaForSequenceClassification",
        "question-answering": "RobertaForQuestionAnswering",
    },
    position_offset=2,
)
