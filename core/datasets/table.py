"""`table`: the user's rows, `data.train` and `data.test` parquet, arrow, JSON-lines or CSV files
(or `save_to_disk` directories), or `data.path` a `save_to_disk` DatasetDict with splits
`data.train_split` and `data.test_split`; `data.columns` names the columns the job's task reads
(images or text and a label; question answering's id, question, context and answers; a
language model's text or chat `messages`), read through the pretrained model's own image
processor or tokenizer (`pipetransformer.trainer.sources.tabular`, `.qa`, `.lm`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetransformer.core.datasets.base import FilesKind
from pipetransformer.core.tasks import CAUSAL_LM, QUESTION_ANSWERING, Task, task_of

if TYPE_CHECKING:
    from pipetransformer.core.spec import DataSpec, ModelSpec


@dataclass(frozen=True)
class Table(FilesKind):
    def model_problem(self, data: DataSpec, model: ModelSpec) -> str | None:
        if problem := super().model_problem(data, model):
            return problem
        if model.pending:
            return None  # the family is known once the checkpoint is read
        cols = data.columns
        if task_of(model) is CAUSAL_LM:
            if cols.text is not None and cols.messages is not None:
                return (
                    "a language model reads either plain text (data.columns.text) or "
                    "conversations (data.columns.messages), not both"
                )
            extra = [r for r in ("image", "text_pair") if getattr(cols, r) is not None]
            if extra:
                return f"data.columns.{extra[0]} is not read by causal-lm; remove it"
            if data.doc_stride is not None or data.augment:
                which = "doc_stride" if data.doc_stride is not None else "augment"
                return f"data.{which} is not read by causal-lm; remove it"
            return None
        if data.cross_document_attention or cols.messages is not None:
            which = (
                "cross_document_attention" if data.cross_document_attention else "columns.messages"
            )
            return f"data.{which} is for causal-lm (model.task); remove it"
        if task_of(model) is QUESTION_ANSWERING:
            if cols.text is not None or cols.text_pair is not None or cols.image is not None:
                return (
                    "question answering reads data.columns.question, context, answers and id; "
                    "remove data.columns.text / text_pair / image"
                )
            if model.seq_len is not None and data.stride(model.seq_len) >= model.seq_len // 2:
                return (
                    f"data.doc_stride ({data.stride(model.seq_len)}) must be below half of "
                    f"model.seq_len ({model.seq_len}): a window must move on by more than it keeps"
                )
            return None
        if data.doc_stride is not None:
            return "data.doc_stride is for question answering (model.task); remove it"
        if model.is_text:
            if cols.text is None:
                return "a text model reads data.columns.text (and text_pair for pairs); set it"
            if cols.image is not None:
                return "data.columns.image is for image models; remove it"
            if data.augment:
                return "data.augment is for image models"
            return None
        if cols.image is None:
            return "an image model reads data.columns.image from a table; set it"
        if cols.text is not None or cols.text_pair is not None:
            return "data.columns.text / text_pair are for text models; remove them"
        return None

    def columns(self, data: DataSpec, task: Task) -> dict[str, str] | None:
        if task is CAUSAL_LM:
            cols = data.columns
            if cols.messages is not None:
                return {"messages": cols.messages}
            return {"text": cols.text or "text"}
        named = {role: getattr(data.columns, role) for role in task.reads}
        return {role: name for role, name in named.items() if name is not None}


TABLE = Table("table", files=True, opens="pipetransformer.trainer.sources.splits:table_splits")
