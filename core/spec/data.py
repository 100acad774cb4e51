"""`data`: what a job reads (a registered kind of data set, its files and columns)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    field_validator,
    model_validator,
)

from pipetransformer.core.datasets import DataKind, kind_of
from pipetransformer.core.spec.base import (
    MAX_LOADER_WORKERS,
    MAX_NAME,
    MAX_PATH,
    MAX_SEQ_LEN,
    MAX_SYNTHETIC_SAMPLES,
    NonNegativeInt,
    Number,
    PositiveInt,
    Seed,
    _Strict,
)
from pipetransformer.core.spec.model import ModelSpec

Paths = Annotated[str, Field(min_length=1, max_length=MAX_PATH)]


def _path_list(value: Any) -> Any:
    # `train: a.parquet` is `train: [a.parquet]`
    return [value] if isinstance(value, str) else value


PathList = Annotated[list[Paths], BeforeValidator(_path_list), Field(min_length=1, max_length=1024)]
ColumnName = Annotated[str, Field(min_length=1, max_length=MAX_NAME * 4)]


class ColumnsSpec(_Strict):
    """Which columns of a table hold what (`table` only; an image folder's are fixed)."""

    image: ColumnName | None = Field(None, description="image models: the image column")
    text: ColumnName | None = Field(None, description="text models: the (first) sentence")
    text_pair: ColumnName | None = Field(None, description="sentence pairs: the second sentence")
    label: ColumnName = Field("label", description="the integer class label")
    question: ColumnName = Field("question", description="question answering: the question")
    context: ColumnName = Field(
        "context", description="question answering: the passage holding the answer"
    )
    answers: ColumnName = Field(
        "answers",
        description="question answering: SQuAD's {text: [...], answer_start: [...]} (the first "
        "answer is the training target; held-out questions are scored against all)",
    )
    id: ColumnName = Field("id", description="question answering: the question's id")
    messages: ColumnName | None = Field(
        None,
        description="causal-lm chat data: the conversation column (a list of {role, content}, "
        "rendered with the tokenizer's chat template; the loss on the assistant's tokens)",
    )


class DataSpec(_Strict):
    """Which data the job reads: `dataset` is a registered kind (`pipetransformer.core.datasets`).

    `digits`: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes; vit).
    `synthetic`: seeded random images/labels of the model's shape, for benchmarks (vit).
    `synthetic-text`: seeded token sequences of the model's seq_len; the label is whichever of the
    num_classes keyword tokens (ids 0 .. num_classes-1) occurs most often (bert).

    Your own data, for a `model.pretrained` model (read through its image processor or
    tokenizer, a row at a time, by `loader_workers` processes per rank):
    `image-folder`: `train` and `test` are folders of `<class>/<image>` files (jpg, png);
    `table`: `train` and `test` are parquet, arrow, JSON-lines or CSV files (or `save_to_disk`
    directories), or `path` is a `save_to_disk` DatasetDict with splits `train_split` and
    `test_split`; `columns` names the image or text column(s) and the label.

    `classes` (digits) keeps only those digits, relabelled 0 .. len(classes)-1 in the order given.
    The held-out split is drawn from the whole data set first and then filtered, so jobs with
    the same `seed` never train on each other's held-out images, whatever classes they keep (a
    model pretrained on some digits can be fine-tuned on all of them)."""

    dataset: Annotated[str, Field(max_length=MAX_NAME)] = "digits"
    test_fraction: Annotated[Number, Field(gt=0, lt=1)] = 0.2
    synthetic_samples: Annotated[PositiveInt, Field(le=MAX_SYNTHETIC_SAMPLES)] = 2048
    seed: Seed = 0
    classes: list[Annotated[NonNegativeInt, Field(le=9)]] | None = Field(
        None,
        max_length=10,
        description="digits only: the digits to keep (at least 2), relabelled in this order",
    )
    train: PathList | None = Field(
        None, description="image-folder / table: the training split's folder or file(s)"
    )
    test: PathList | None = Field(
        None, description="image-folder / table: the held-out split's folder or file(s)"
    )
    path: Paths | None = Field(None, description="table: a save_to_disk DatasetDict directory")
    train_split: Annotated[str, Field(min_length=1, max_length=MAX_NAME)] = "train"
    test_split: Annotated[str, Field(min_length=1, max_length=MAX_NAME)] = "test"
    columns: ColumnsSpec = ColumnsSpec()
    augment: bool = Field(
        False,
        description="image sources: random resized crop and horizontal flip, drawn per epoch "
        "and sample from data.seed (AutoCache then stays off: a frozen prefix sees new inputs)",
    )
    loader_workers: Annotated[NonNegativeInt, Field(le=MAX_LOADER_WORKERS)] = Field(
        2, description="data-loading processes per first-stage rank (0: in the training process)"
    )
    doc_stride: Annotated[PositiveInt, Field(le=MAX_SEQ_LEN)] | None = Field(
        None,
        description="question answering: tokens two windows of a context longer than "
        "model.seq_len share (default: a third of seq_len, as SQuAD's 128 of 384)",
    )
    max_answer_tokens: Annotated[PositiveInt, Field(le=MAX_SEQ_LEN)] = Field(
        30, description="question answering: the longest answer span predicted, in tokens"
    )
    cross_document_attention: bool = Field(
        False,
        description="causal-lm: documents packed into one sequence attend to each other as one "
        "text (default: each attends only to itself, its positions restarting at 0)",
    )
    image_backend: Literal["auto", "native", "transformers"] = Field(
        "auto",
        description="image preprocessing: 'native' (resize, rescale, normalise from the "
        "processor's config), 'transformers' (the model's processor class), 'auto' (the class "
        "where it loads)",
    )

    @field_validator("dataset")
    @classmethod
    def _registered(cls, value: str) -> str:
        return kind_of(value).name

    @model_validator(mode="after")
    def _known(self) -> DataSpec:
        if problem := kind_of(self).problem(self):
            raise ValueError(problem)
        return self

    @property
    def kind(self) -> DataKind:
        """The registered kind of data set (`pipetransformer.core.datasets`)."""
        return kind_of(self)

    @property
    def is_source(self) -> bool:
        """Data read from a user's files (not built in)."""
        return self.kind.files

    def stride(self, seq_len: int) -> int:
        """Question answering: the tokens a long context's windows share."""
        return self.doc_stride if self.doc_stride is not None else max(1, seq_len // 3)

    @property
    def num_classes(self) -> int | None:
        """Classes the data set has (None where the model's num_classes decides)."""
        return self.kind.num_classes(self)

    def model_problem(self, model: ModelSpec) -> str | None:
        """Why this data set cannot feed `model` (a message naming the fields), or None."""
        return self.kind.model_problem(self, model)
