"""The job spec: what a user submits.

Everything a job needs is in one validated `JobSpec`; anything unknown or out of range is rejected
before a process starts, with an error that names the field and what it allows. Every number is
bounded (finite floats, integers below what makes sense, seeds in the generators' range), the
file is read as bounded UTF-8 text and parsed by a YAML loader that refuses duplicate keys and
alias bombs (`load_spec`). What a valid spec needs of a machine is `orchestrator/admission.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipetransformer.core.specfile import MAX_BYTES, SpecFileError, parse_yaml, read_spec_file

DATASETS = ("digits", "synthetic", "synthetic-text", "image-folder", "table")
SOURCES = ("image-folder", "table")  # a user's files, read through the model's own preprocessing
MAX_LOADER_WORKERS = 64
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


class SpecError(ValueError):
    """A job spec failed validation. `problems` holds one (field, message) pair per problem."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"invalid job spec{where}:"] + [f"  {field}: {msg}" for field, msg in problems]
        super().__init__("\n".join(lines))


class _Strict(BaseModel):
    # allow_inf_nan=False: YAML's .inf/.nan (and 1e400, which overflows to inf) are never meant
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _not_bool(value: Any) -> Any:
    # pydantic's lax mode reads YAML `true` as 1: a flag where a number belongs is a mistake
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean (true/false)")
    return value


_NOT_BOOL = BeforeValidator(_not_bool)
PositiveInt = Annotated[int, _NOT_BOOL, Field(gt=0)]
NonNegativeInt = Annotated[int, _NOT_BOOL, Field(ge=0)]
Number = Annotated[float, _NOT_BOOL]

# Upper bounds. A value past one of these is a typo or a unit mistake, not a plan: each is
# generous for what this system trains, and orchestrator/admission.py refuses the combinations
# that fit no machine. Pydantic's message names the bound ("less than or equal to N").
MAX_DIM = 65_536  # model.dim: the widest published transformers are ~25k
MAX_DEPTH = 1_024  # model.depth: DeepNet trained 1000 blocks; the planner is O(depth^2 x stages)
MAX_HEADS = 1_024
MAX_MLP_RATIO = 64.0
MAX_IMAGE_SIZE = 4_096  # pixels per side
MAX_CHANNELS = 1_024  # hyperspectral images have a few hundred bands
MAX_VOCAB = 1 << 20  # the largest tokenizers have ~256k ids
MAX_SEQ_LEN = 65_536
MAX_CLASSES = 1 << 20  # extreme classification; ImageNet-21k has 21,843
# every worker generates the whole synthetic set at start-up (bert: ~6 us a sample, so 10M is
# a minute) and holds it in memory
MAX_SYNTHETIC_SAMPLES = 10_000_000
MAX_SEED = 2**32 - 1  # numpy's legacy seeding takes 0 .. 2**32-1; default_rng refuses negatives
MAX_EPOCHS = 100_000
MAX_STEPS = 100_000_000  # optimizer steps: a year at 3 steps/s
MAX_BATCH = 1 << 20  # samples per optimizer step
MAX_LR = 1.0  # AdamW moves every weight by about lr a step; initial weights are ~0.02
MAX_WEIGHT_DECAY = 10.0  # decoupled: each step scales weights by 1 - lr x weight_decay
MAX_GRAD_CLIP = 1e6  # a clip norm above this clips nothing; 0 switches clipping off
MAX_STAGES = 128  # pipeline stages in a replica: the planner's DP recurses once per stage
MAX_VIRTUAL_STAGES = 16
MAX_REPLICAS = 1_024
MAX_MICROBATCHES = 4_096
MAX_CHECKPOINT_SECONDS = 7 * 24 * 3600.0  # a week
MAX_KEEP = 1_000  # each committed checkpoint is a full copy of weights and optimizer state
MAX_THREADS = 256
MAX_CONTROL_EVERY = 10_000  # a stop request waits up to this many steps
MAX_LEASE_TTL_S = 3_600  # a hung worker is noticed only after this long
MAX_NODES = 1_024
MAX_RESTARTS = 1_000
MAX_WARMUP_DECISIONS = 100_000
MAX_NAME = 64  # free-text choices (dataset, schedule): the real ones are short
MAX_PATH = 4_096


Seed = Annotated[NonNegativeInt, Field(le=MAX_SEED)]


TEXT_FAMILIES = ("bert", "roberta")
PRETRAINED_ONLY = ("deit", "roberta")


class PretrainedSpec(_Strict):
    """A Hugging Face checkpoint to start from: a directory `save_pretrained` wrote (config.json
    and safetensors weights, with its tokenizer or image processor), or a hub id found in the
    local Hugging Face cache (nothing is downloaded). Its config.json decides the architecture.

    `path` and `fingerprint` are filled in at submission (`orchestrator/pretrained.py`): the
    directory as the controller and workers see it, and a digest of its config.json and
    safetensors headers, so the workers load exactly the checkpoint that was checked."""

    source: Annotated[str, Field(min_length=1, max_length=MAX_PATH)] = Field(
        ...,
        description="a checkpoint directory, or a hub id ('org/name') in the local Hugging Face "
        "cache",
    )
    revision: Annotated[str, Field(min_length=1, max_length=MAX_NAME * 2)] | None = Field(
        None, description="hub ids only: a branch, tag or commit of the cached repository"
    )
    path: Annotated[str, Field(max_length=MAX_PATH)] | None = Field(
        None, description="filled in at submission: the resolved local directory"
    )
    fingerprint: Annotated[str, Field(max_length=MAX_NAME * 2)] | None = Field(
        None, description="filled in at submission: digest of config.json and weight headers"
    )
    commit: Annotated[str, Field(max_length=MAX_NAME)] | None = Field(
        None, description="filled in at submission for hub ids: the cached snapshot's commit"
    )

    @property
    def resolved(self) -> bool:
        return self.path is not None


def _pretrained_shorthand(value: Any) -> Any:
    # `pretrained: ./vit` is `pretrained: {source: ./vit}`
    return {"source": value} if isinstance(value, str) else value


class ModelSpec(_Strict):
    """A transformer encoder whose blocks (`blocks.<i>`) are the partition units.

    Built here from a seeded initialisation: a ViT over small images (`family: vit`) or a
    BERT-style text encoder (`family: bert`). Shared: dim, depth, heads, mlp_ratio, num_classes,
    dropout. ViT only: image_size, patch_size, channels. BERT only (required for it):
    vocab_size, seq_len. The other family's fields are ignored (not validated), so a spec dumped
    with every field parses back unchanged.

    Or from a Hugging Face checkpoint (`pretrained`): ViT, DeiT, BERT or RoBERTa; its config.json
    decides family, task, dim, depth, heads, mlp_ratio and the input fields, which the spec then
    leaves out (a value that contradicts the checkpoint is an error naming the field). The spec
    still chooses `num_classes` (another label count than the checkpoint's gets a new head) and,
    for text, `seq_len` (tokens per input; default 128)."""

    pretrained: Annotated[PretrainedSpec | None, BeforeValidator(_pretrained_shorthand)] = None
    family: Literal["vit", "bert", "deit", "roberta"] = "vit"
    task: Literal["classification", "question-answering"] = Field(
        "classification",
        description="classification (images, sentences, sentence pairs) or question-answering "
        "(extractive spans, SQuAD-style; BERT and RoBERTa). Default: the checkpoint's head; "
        "another task than the checkpoint's gets a new head",
    )
    image_size: Annotated[PositiveInt, Field(le=MAX_IMAGE_SIZE)] = 8
    patch_size: Annotated[PositiveInt, Field(le=MAX_IMAGE_SIZE)] = 2
    channels: Annotated[PositiveInt, Field(le=MAX_CHANNELS)] = 1
    vocab_size: Annotated[PositiveInt, Field(le=MAX_VOCAB)] | None = Field(
        None, validate_default=True, description="bert: token ids are 0 .. vocab_size-1"
    )
    seq_len: Annotated[PositiveInt, Field(le=MAX_SEQ_LEN)] | None = Field(
        None,
        validate_default=True,
        description="bert: tokens per input sequence (a learned CLS vector is prepended); "
        "pretrained text models: tokens per input, [CLS] and [SEP] included (default 128)",
    )
    dim: Annotated[PositiveInt, Field(le=MAX_DIM)] = 64
    depth: Annotated[PositiveInt, Field(le=MAX_DEPTH)] = Field(
        6, description="number of transformer blocks"
    )
    heads: Annotated[PositiveInt, Field(le=MAX_HEADS)] = 4
    mlp_ratio: Annotated[Number, Field(gt=0, le=MAX_MLP_RATIO)] = 2.0
    num_classes: Annotated[PositiveInt, Field(le=MAX_CLASSES)] = 10
    dropout: Annotated[Number, Field(ge=0, lt=1)] = 0.0

    @property
    def pending(self) -> bool:
        """A pretrained model whose checkpoint was not read yet: its architecture fields are
        not known until submission resolves it."""
        return self.pretrained is not None and not self.pretrained.resolved

    @property
    def is_text(self) -> bool:
        return self.family in TEXT_FAMILIES

    @property
    def tokens(self) -> int:
        """Tokens in the hidden states between blocks: patches + CLS (vit; DeiT adds its
        distillation token), seq_len + a prepended CLS (bert), seq_len (pretrained text, whose
        tokenizer writes [CLS] itself)."""
        if self.is_text:
            return (self.seq_len or 0) + (0 if self.pretrained else 1)
        return (self.image_size // self.patch_size) ** 2 + (2 if self.family == "deit" else 1)

    @property
    def width(self) -> int:
        """Channels of the hidden states between stages: dim, plus one for pretrained text
        models, whose stages carry the attention mask as an extra channel."""
        return self.dim + (1 if self.is_text and self.pretrained else 0)

    @field_validator("vocab_size", "seq_len")
    @classmethod
    def _bert_needs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if (
            value is None
            and info.data.get("family") == "bert"
            and info.data.get("pretrained") is None
        ):
            raise ValueError(f"required when family is 'bert' (set model.{info.field_name})")
        return value

    @model_validator(mode="after")
    def _shapes(self) -> ModelSpec:
        if self.pretrained is None:
            if self.family in PRETRAINED_ONLY:
                raise ValueError(
                    f"family {self.family!r} comes from a checkpoint: set model.pretrained "
                    "(or use 'vit' / 'bert' for a model built from a seed)"
                )
            if self.task != "classification":
                raise ValueError(
                    f"task {self.task!r} needs a pretrained BERT or RoBERTa checkpoint "
                    "(model.pretrained)"
                )
        if self.pending:
            return self  # checked once the checkpoint has filled in the architecture
        if not self.is_text and self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size ({self.patch_size}) must divide image_size ({self.image_size})"
            )
        if self.dim % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide dim ({self.dim})")
        if int(self.dim * self.mlp_ratio) < 1:
            raise ValueError(
                f"mlp_ratio ({self.mlp_ratio}) x dim ({self.dim}) leaves the MLP no hidden "
                "units; raise mlp_ratio"
            )
        if self.task == "question-answering" and self.num_classes != 2:
            raise ValueError(
                f"question answering predicts start and end: num_classes must be 2 "
                f"(got {self.num_classes})"
            )
        return self


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


class DataSpec(_Strict):
    """`digits`: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes; vit).
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
    image_backend: Literal["auto", "native", "transformers"] = Field(
        "auto",
        description="image preprocessing: 'native' (resize, rescale, normalise from the "
        "processor's config), 'transformers' (the model's processor class), 'auto' (the class "
        "where it loads)",
    )

    @model_validator(mode="after")
    def _known(self) -> DataSpec:
        if self.dataset not in DATASETS:
            raise ValueError(
                f"dataset {self.dataset!r} is not available; choose one of {', '.join(DATASETS)}"
            )
        if self.classes is not None:
            if self.dataset != "digits":
                raise ValueError(
                    f"data.classes selects digits and needs dataset 'digits' "
                    f"(got {self.dataset!r}); remove it"
                )
            if len(self.classes) < 2 or len(set(self.classes)) != len(self.classes):
                raise ValueError(
                    f"data.classes must list at least 2 different digits (got {self.classes})"
                )
        if self.dataset not in SOURCES:
            given = [f for f in ("train", "test", "path") if getattr(self, f) is not None]
            if given or self.augment:
                raise ValueError(
                    f"data.{(given or ['augment'])[0]} is for dataset 'image-folder' or 'table' "
                    f"(got {self.dataset!r}); remove it"
                )
            return self
        if self.path is not None:
            if self.dataset != "table":
                raise ValueError("data.path (a DatasetDict) is for dataset 'table'")
            if self.train is not None or self.test is not None:
                raise ValueError(
                    "give either data.path (a DatasetDict) or data.train and data.test, not both"
                )
        elif self.train is None or self.test is None:
            missing = "data.train" if self.train is None else "data.test"
            raise ValueError(
                f"dataset {self.dataset!r} needs {missing} (the split's "
                f"{'folder' if self.dataset == 'image-folder' else 'file(s)'})"
            )
        if self.dataset == "image-folder" and (
            len(self.train or []) > 1 or len(self.test or []) > 1
        ):
            raise ValueError(
                "an image folder split is one folder: give one path for data.train and data.test"
            )
        return self

    @property
    def is_source(self) -> bool:
        """Data read from a user's files (not built in)."""
        return self.dataset in SOURCES

    def stride(self, seq_len: int) -> int:
        """Question answering: the tokens a long context's windows share."""
        return self.doc_stride if self.doc_stride is not None else max(1, seq_len // 3)

    @property
    def num_classes(self) -> int | None:
        """Classes the data set has (None where the model's num_classes decides)."""
        if self.dataset == "digits":
            return 10 if self.classes is None else len(self.classes)
        return None

    def model_problem(self, model: ModelSpec) -> str | None:
        """Why this data set cannot feed `model` (a message naming the fields), or None."""
        if self.is_source:
            return self._source_problem(model)
        if model.pretrained is not None:
            return (
                f"data.dataset {self.dataset!r} is built for the seeded models; a pretrained "
                "model reads your files through its own preprocessing: use 'image-folder' or "
                "'table'"
            )
        if self.dataset in ("digits", "synthetic") and model.family != "vit":
            return (
                f"data.dataset {self.dataset!r} is images and needs model.family 'vit' "
                f"(got {model.family!r}); for bert use 'synthetic-text'"
            )
        if self.dataset == "digits":
            k = self.num_classes
            if (model.image_size, model.channels, model.num_classes) != (8, 1, k):
                kept = "" if self.classes is None else " (the digits data.classes keeps)"
                return (
                    f"dataset 'digits' is 8x8 grey images of {k} classes{kept}: set "
                    f"model.image_size=8, model.channels=1, model.num_classes={k}"
                )
        if self.dataset == "synthetic-text":
            if model.family != "bert":
                return (
                    f"data.dataset 'synthetic-text' is token sequences and needs model.family "
                    f"'bert' (got {model.family!r})"
                )
            k = model.num_classes
            if k < 2:
                return "dataset 'synthetic-text' needs model.num_classes >= 2"
            if model.vocab_size is None or model.vocab_size <= k:
                return (
                    f"dataset 'synthetic-text' uses ids 0..{k - 1} as class keywords and needs "
                    f"filler tokens: model.vocab_size ({model.vocab_size}) must exceed "
                    f"model.num_classes ({k})"
                )
            if model.seq_len is None or model.seq_len < 2 * k:
                return (
                    f"dataset 'synthetic-text' needs room for the keywords: model.seq_len "
                    f"({model.seq_len}) must be at least 2 x model.num_classes ({2 * k})"
                )
        return None

    def _source_problem(self, model: ModelSpec) -> str | None:
        if model.pretrained is None:
            return (
                f"data.dataset {self.dataset!r} reads your files through the model's own image "
                "processor or tokenizer and needs model.pretrained (a Hugging Face checkpoint)"
            )
        if model.pending:
            return None  # the family is known once the checkpoint is read
        cols = self.columns
        if model.task == "question-answering":
            if self.dataset != "table":
                return "question answering reads a table of SQuAD-style rows: data.dataset 'table'"
            if cols.text is not None or cols.text_pair is not None or cols.image is not None:
                return (
                    "question answering reads data.columns.question, context, answers and id; "
                    "remove data.columns.text / text_pair / image"
                )
            if model.seq_len is not None and self.stride(model.seq_len) >= model.seq_len // 2:
                return (
                    f"data.doc_stride ({self.stride(model.seq_len)}) must be below half of "
                    f"model.seq_len ({model.seq_len}): a window must move on by more than it keeps"
                )
            return None
        if self.doc_stride is not None:
            return "data.doc_stride is for question answering (model.task); remove it"
        if model.is_text:
            if self.dataset == "image-folder":
                return f"data.dataset 'image-folder' is images; model.family is {model.family!r}"
            if cols.text is None:
                return "a text model reads data.columns.text (and text_pair for pairs); set it"
            if cols.image is not None:
                return "data.columns.image is for image models; remove it"
        else:
            if self.dataset == "table" and cols.image is None:
                return "an image model reads data.columns.image from a table; set it"
            if cols.text is not None or cols.text_pair is not None:
                return "data.columns.text / text_pair are for text models; remove them"
            if self.dataset == "image-folder" and cols != ColumnsSpec():
                return "an image folder's columns are fixed (image, label); remove data.columns"
        if self.augment and model.is_text:
            return "data.augment is for image models"
        return None


class TrainingSpec(_Strict):
    epochs: Annotated[PositiveInt, Field(le=MAX_EPOCHS)] = 20
    global_batch_size: Annotated[PositiveInt, Field(le=MAX_BATCH)] = Field(
        64, description="samples per optimizer step, summed over replicas and micro-batches"
    )
    lr: Annotated[Number, Field(gt=0, le=MAX_LR)] = 3e-3
    weight_decay: Annotated[Number, Field(ge=0, le=MAX_WEIGHT_DECAY)] = 0.05
    warmup_steps: Annotated[NonNegativeInt, Field(le=MAX_STEPS)] = 20
    min_lr_ratio: Annotated[Number, Field(ge=0, le=1)] = 0.05
    grad_clip: Annotated[Number, Field(ge=0, le=MAX_GRAD_CLIP)] = 1.0
    seed: Seed = 0
    max_steps: Annotated[PositiveInt, Field(le=MAX_STEPS)] | None = Field(
        None, description="stop after this many optimizer steps (for smoke tests)"
    )
    target_accuracy: Annotated[Number, Field(gt=0, le=1)] | None = Field(
        None, description="stop once held-out accuracy reaches this fraction"
    )
    precision: Literal["fp32", "bf16", "bf16-weights"] = Field(
        "fp32",
        description="'bf16': blocks compute under bfloat16 autocast while weights, gradients, "
        "optimizer state, checkpoints and the activations between stages stay float32 (no "
        "master-weight copies, no loss scaling); 'bf16-weights': the model's weights, "
        "activations and gradients are bfloat16 (no autocast, fewer bytes moved: the faster "
        "one on a GPU) and AdamW updates float32 master copies, which are what checkpoints "
        "hold; 'fp32': float32 throughout. A checkpoint resumes under any of them",
    )

    @model_validator(mode="after")
    def _decay_below_one(self) -> TrainingSpec:
        # AdamW multiplies every weight by (1 - lr x weight_decay) each step: at 1 or more
        # that zeroes or flips the weights
        if self.lr * self.weight_decay >= 1:
            raise ValueError(
                f"lr x weight_decay ({self.lr} x {self.weight_decay}) must be below 1: AdamW "
                "scales every weight by 1 - lr x weight_decay each step; lower either"
            )
        return self


@dataclass(frozen=True)
class ScheduleRule:
    """What a pipeline schedule needs of a layout (mirrors torch.distributed.pipelining)."""

    placement: Literal["loop", "v"]  # stage i on pipeline rank i % P, or V-shaped (0..P-1, P-1..0)
    min_virtual: int = 1  # stages per rank
    max_virtual: int | None = None
    microbatches: Literal["any", "at_least_stages", "multiple_of_rounds"] = "any"
    about: str = ""


SCHEDULES: dict[str, ScheduleRule] = {
    "gpipe": ScheduleRule("loop", 1, 1, about="all forwards, then all backwards"),
    "1f1b": ScheduleRule(
        "loop", 1, 1, "at_least_stages", "PipeDream-Flush: one forward, one backward"
    ),
    "interleaved-1f1b": ScheduleRule(
        "loop", 2, None, "multiple_of_rounds", "1F1B over several stages per rank"
    ),
    "looped-bfs": ScheduleRule("loop", 2, None, about="breadth-first over several stages per rank"),
    "interleaved-zb": ScheduleRule(
        "loop", 2, None, "multiple_of_rounds", "zero-bubble: weight gradients fill the bubbles"
    ),
    "zbv": ScheduleRule("v", 2, 2, about="zero-bubble with two V-placed stages per rank"),
    "dualpipev": ScheduleRule(
        "v", 2, 2, "at_least_stages", "DualPipe with two V-placed stages per rank"
    ),
}


def schedule_problem(schedule: str, ranks: int, virtual: int, microbatches: int) -> str | None:
    """Why `schedule` cannot run `virtual` stages on each of `ranks` pipeline ranks with
    `microbatches` micro-batches, or None if it can."""
    rule = SCHEDULES[schedule]
    if virtual < rule.min_virtual or (rule.max_virtual and virtual > rule.max_virtual):
        want = (
            f"exactly {rule.min_virtual}"
            if rule.min_virtual == rule.max_virtual
            else f"at least {rule.min_virtual}"
        )
        return (
            f"schedule {schedule!r} ({rule.about}) needs {want} stage(s) per rank; "
            f"set parallel.virtual_stages accordingly (got {virtual})"
        )
    stages = ranks * virtual
    if rule.microbatches == "at_least_stages" and microbatches < stages:
        return (
            f"schedule {schedule!r} needs at least as many micro-batches as stages "
            f"({stages}); got parallel.microbatches={microbatches}"
        )
    if rule.microbatches == "multiple_of_rounds":
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            return (
                f"schedule {schedule!r} needs parallel.microbatches to be a multiple of its "
                f"rounds (microbatches // stages-ranks = {rounds}); got {microbatches}"
            )
    return None


class ParallelSpec(_Strict):
    """`stages` pipeline ranks x `replicas` data-parallel replicas; each rank runs
    `virtual_stages` model chunks (interleaved and zero-bubble schedules need 2 or more)."""

    stages: Annotated[PositiveInt, Field(le=MAX_STAGES)] = 2
    replicas: Annotated[PositiveInt, Field(le=MAX_REPLICAS)] = 1
    microbatches: Annotated[PositiveInt, Field(le=MAX_MICROBATCHES)] | Literal["auto"] = Field(
        4, description="micro-batches per replica step, or 'auto' to choose from measurement"
    )
    schedule: Annotated[str, Field(max_length=MAX_NAME)] = "gpipe"
    virtual_stages: Annotated[PositiveInt, Field(le=MAX_VIRTUAL_STAGES)] = 1
    partition: Literal["uniform", "autopipe"] = Field(
        "uniform",
        description="'uniform' splits blocks evenly; 'autopipe' measures the model on the "
        "device and balances measured compute, transfers and memory",
    )
    recompute: bool | list[bool] = Field(
        False, description="activation recomputation, for all stages or per stage"
    )
    compile: bool = Field(
        False,
        description="torch.compile each transformer block (in place: parameter names, hence "
        "checkpoints, are unchanged); the first steps after a start or re-layout pay for "
        "compilation",
    )

    @model_validator(mode="after")
    def _known(self) -> ParallelSpec:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule {self.schedule!r} is not supported; choose one of {', '.join(SCHEDULES)}"
            )
        if self.num_stages > MAX_STAGES:
            raise ValueError(
                f"stages x virtual_stages ({self.stages} x {self.virtual_stages}) must be at "
                f"most {MAX_STAGES} pipeline stages per replica"
            )
        measured = self.partition == "autopipe" or self.microbatches == "auto"
        if measured and self.virtual_stages > 1:
            raise ValueError(
                "partition 'autopipe' and microbatches 'auto' plan one stage per rank: use "
                "virtual_stages 1 (schedules gpipe or 1f1b), or a fixed partition and count"
            )
        if self.microbatches != "auto":
            problem = schedule_problem(
                self.schedule, self.stages, self.virtual_stages, self.microbatches
            )
            if problem:
                raise ValueError(problem)
        if isinstance(self.recompute, list) and len(self.recompute) != self.num_stages:
            raise ValueError(
                f"recompute lists one flag per stage: {self.num_stages} needed "
                f"(stages x virtual_stages), got {len(self.recompute)}"
            )
        return self

    @property
    def num_stages(self) -> int:
        """Pipeline stages (model chunks) in one replica."""
        return self.stages * self.virtual_stages

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def recompute_for(self, stage: int) -> bool:
        return self.recompute[stage] if isinstance(self.recompute, list) else self.recompute

    @property
    def recomputes_any(self) -> bool:
        """Whether any stage recomputes activations (the planner's memory model is per job)."""
        return any(self.recompute_for(i) for i in range(self.num_stages))


class CheckpointSpec(_Strict):
    """When checkpoints are taken and how they are written (trainer/checkpoint.py).

    A periodic checkpoint is due as soon as ANY configured interval has elapsed since the last
    checkpoint (of whatever reason): the end of every `every_epochs`-th epoch, `every_steps`
    optimizer steps, or `every_seconds` of wall time (rank 0's clock, looked at on the
    control-key cadence, runtime.control_every_steps, and at epoch ends, so that every rank
    takes the same decision). `null` switches an interval off; at least one must be set.
    Checkpoints are also always taken before a re-layout, at stop and at the end; those are
    complete before training proceeds. With `async_save` the state is snapshotted in memory and
    training continues while the shards persist; the checkpoint is reported for commit once every
    shard is durable."""

    every_epochs: Annotated[PositiveInt, Field(le=MAX_EPOCHS)] | None = Field(
        1, description="checkpoint at the end of every this-many epochs (null: not by epoch)"
    )
    every_steps: Annotated[PositiveInt, Field(le=MAX_STEPS)] | None = Field(
        None, description="checkpoint once this many optimizer steps passed since the last one"
    )
    every_seconds: Annotated[Number, Field(gt=0, le=MAX_CHECKPOINT_SECONDS)] | None = Field(
        None, description="checkpoint once this many seconds passed since the last one"
    )
    async_save: bool = Field(
        True,
        description="write shards in the background while training continues (false: training "
        "waits for each checkpoint to be written)",
    )
    keep: Annotated[PositiveInt, Field(le=MAX_KEEP)] = Field(
        3, description="committed checkpoints kept on disk"
    )

    @field_validator("every_epochs", "every_steps", "every_seconds", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        # YAML `true` would otherwise pass as the interval 1
        if isinstance(value, bool):
            raise ValueError("must be a positive number or null, not a boolean")
        return value

    @model_validator(mode="after")
    def _some_interval(self) -> CheckpointSpec:
        if (self.every_epochs, self.every_steps, self.every_seconds) == (None, None, None):
            raise ValueError(
                "set at least one of checkpoint.every_epochs, checkpoint.every_steps or "
                "checkpoint.every_seconds (periodic checkpoints bound the work lost on failure)"
            )
        return self


class RuntimeSpec(_Strict):
    """How workers are launched and supervised, and how failures are ridden out.

    Workers run under torchrun agents ("nodes") that rendezvous over etcd. When a worker dies,
    hangs (its etcd lease lapses) or is told to leave (SIGTERM), the controller aborts the
    generation, the agents re-rendezvous with whoever is left (at least `min_nodes`), the
    controller plans a layout for that world and training resumes from the last committed
    checkpoint. A node that comes back joins at the next rendezvous and the job widens again."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where workers compute: 'cuda' (worker k of a node on cuda:k; NCCL for the "
        "pipeline and replica groups, gloo for control), 'cpu' (gloo), or 'auto': CUDA when "
        "the node has a GPU for each of its workers, else the CPU",
    )
    threads_per_worker: Annotated[PositiveInt, Field(le=MAX_THREADS)] = 1
    control_every_steps: Annotated[PositiveInt, Field(le=MAX_CONTROL_EVERY)] = Field(
        10,
        description="steps between reads of the etcd control key (stop); also each rank's "
        "stage-timing interval",
    )
    tensorboard: bool = Field(
        False,
        description="the controller also writes the job's figures (loss, samples/s, accuracy, "
        "layout, each rank's phases) as TensorBoard event files under the job's directory "
        "(jobs/<id>/tensorboard; needs the `tensorboard` extra)",
    )
    stage_timing: bool = Field(
        True,
        description="each rank measures where its time goes (forward, backward, waiting for a "
        "neighbour stage, gradient sync, optimizer, frozen prefix, data, checkpoints, "
        "evaluation) and reports it every control_every_steps steps: the dashboard's Pipeline "
        "view, `status`, the summary (CUDA events on GPUs; false turns it off)",
    )
    lease_ttl_s: Annotated[PositiveInt, Field(le=MAX_LEASE_TTL_S)] = Field(
        5,
        description="seconds a worker's etcd lease outlives its last refresh: a hung or "
        "partitioned worker is declared lost after at most this long",
    )
    nodes: Annotated[PositiveInt, Field(le=MAX_NODES)] = Field(
        1,
        description="torchrun agents `pipetransformer run` starts on this machine; the layout's "
        "workers are split evenly among them (2 nodes x 1 process simulate two machines)",
    )
    min_nodes: Annotated[PositiveInt, Field(le=MAX_NODES)] | None = Field(
        None,
        description="fewest nodes the job keeps training with after a node is lost (default: "
        "1); it waits for capacity below that",
    )
    max_restarts: Annotated[NonNegativeInt, Field(le=MAX_RESTARTS)] = Field(
        10,
        description="times each agent restarts its workers after a failure before the job "
        "gives up (0: the first failure interrupts the job; `resume` continues it)",
    )


class FreezeSpec(_Strict):
    """AutoFreeze: freeze a growing prefix of blocks (0 .. F-1) as they converge (PipeTransformer).

    At each decision point T (1, 2, ...), the automatic boundary may grow to at most the
    alpha-bound ceil(L * (1 - (1 - alpha)^T')) (L = model.depth, T' = T - warmup_decisions, the
    decision points after warm-up) and never past
    L - keep_trainable; it never decreases. The classifier head is never frozen. A manual override
    (`pipetransformer freeze`) is applied at the next decision point, may only move forward and
    is bounded by the model and keep_trainable, not by alpha. Implemented in core/freeze.py.

    How the job re-lays itself out when F moves (`relayout`; planned in core/planner.py):
    'elastic' (the default: AutoPipe + AutoDP) takes the frozen blocks out of the pipeline (the
    first stage's rank runs them forward-only, AutoCache may serve them), re-partitions the
    active blocks and turns freed ranks into replicas; 'repartition' (AutoPipe without AutoDP)
    does the same but keeps the current number of replicas, hence the pipeline depth, so every
    stage needs an active block: keep_trainable must be at least parallel.stages x
    parallel.virtual_stages; 'off' keeps every stage, replica and the micro-batch count as they
    are and freezes blocks in place (no gradient, no optimizer, no gradient sync; they still run
    forward in their stages, without AutoCache)."""

    policy: Literal["gradient", "schedule", "off"] = Field(
        "off",
        description="'gradient': freeze the longest prefix of blocks that have settled (see "
        "`criterion`), bounded by the alpha-schedule; "
        "'schedule': freeze exactly the alpha-bound at every decision point; 'off': never freeze "
        "automatically (manual overrides still apply)",
    )
    alpha: Annotated[Number, Field(gt=0, lt=1)] = Field(
        0.25,
        description="PipeTransformer's alpha in (0, 1): T' decision points after warm-up at "
        "most ceil(model.depth * (1 - (1 - alpha)^T')) blocks are frozen; larger freezes faster",
    )
    every: Literal["epoch"] | PositiveInt = Field(
        "epoch",
        description="decision points: at the end of every epoch, or every K optimizer steps",
    )
    keep_trainable: Annotated[PositiveInt, Field(le=MAX_DEPTH)] = Field(
        1,
        description="at least this many of the last blocks stay trainable (the head always "
        "does); must be less than model.depth unless policy is 'off'",
    )
    threshold: Annotated[Number, Field(gt=0, le=1)] = Field(
        0.2,
        description="criterion 'decay': a block has converged when its mean per-step gradient "
        "norm over the last interval has decayed to at most this fraction of its peak (the "
        "largest such mean so far): n_T <= threshold * max(n_1 .. n_T)",
    )
    criterion: Literal["auto", "decay", "noise"] = Field(
        "auto",
        description="gradient policy: when a block has settled. 'decay': its mean gradient norm "
        "has decayed to `threshold` times its peak (training from scratch); 'noise': its "
        "gradient over the interval is mostly noise, the norm of the summed gradient at most "
        "`noise_ratio` times the root of the summed squared step norms (fine-tuning, where the "
        "norms rise while a new head grows); 'auto': 'noise' when the job starts from trained "
        "weights (model.pretrained or init.checkpoint), else 'decay'",
    )
    noise_ratio: Annotated[Number, Field(gt=0, le=100)] = Field(
        1.5,
        description="criterion 'noise': a block has settled when ||sum of its step gradients|| "
        "<= noise_ratio x sqrt(sum of their squared norms) over the interval (about 1 for pure "
        "noise, up to sqrt(steps) for a steady direction)",
    )
    warmup_decisions: Annotated[NonNegativeInt, Field(le=MAX_WARMUP_DECISIONS)] = Field(
        0,
        description="no automatic freezing at the first this-many decision points (they still "
        "record gradient norms); the alpha-bound counts decision points from the end of warm-up",
    )
    cache: Literal["off", "auto", "on"] = Field(
        "auto",
        description="AutoCache: serve the frozen prefix's output per sample from a cache (RAM, "
        "spilling to disk) instead of recomputing it. 'auto' uses it where measurement says it "
        "is cheaper. Cached outputs are only valid for deterministic inputs: a data pipeline "
        "with random augmentation must use 'off'",
    )
    relayout: Literal["elastic", "repartition", "off"] = Field(
        "elastic",
        description="what happens to the layout when the freeze boundary moves: 'elastic' "
        "(AutoPipe + AutoDP) moves the frozen blocks out of the pipeline, re-partitions the "
        "active blocks and makes freed ranks replicas; 'repartition' (AutoPipe only) moves the "
        "frozen blocks out and re-partitions the active blocks over the same number of stages, "
        "keeping the replicas (needs keep_trainable >= parallel.stages x "
        "parallel.virtual_stages); 'off' keeps the stages, replicas and micro-batches and "
        "freezes blocks in place (they still run forward in their stages; no AutoCache)",
    )
    handover: Literal["memory", "checkpoint"] = Field(
        "memory",
        description="how a re-layout moves weights and optimizer state to their new owners: "
        "'memory' sends them between the running ranks directly (each rank keeps what it keeps, "
        "receives what it gains from a rank that held it; nothing is written or read back, and "
        "durability stays with the checkpoint section's schedule); 'checkpoint' commits a "
        "checkpoint under the old layout and every rank reads its blocks back from it (a "
        "committed checkpoint at every re-layout, at the price of a storage round trip)",
    )

    @field_validator("every", mode="before")
    @classmethod
    def _every(cls, value: Any) -> Any:
        if value == "epoch":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_STEPS:
            return value
        raise ValueError(
            f"must be 'epoch' or a positive whole number of optimizer steps (at most {MAX_STEPS})"
        )


_UNIT_RE = re.compile(r"^(embed|head|blocks\.(0|[1-9][0-9]*))$")


class InitSpec(_Strict):
    """Fine-tuning: start from the model weights of a checkpoint another job committed, instead
    of a seeded random initialisation. Only weights are taken: the optimizer, LR schedule,
    sampler and freeze state start afresh (a resume of this job, by contrast, continues from its
    own checkpoints and never reads this one again).

    The architecture must match the checkpoint's (model.family, dim, depth, heads, mlp_ratio and
    the family's input fields); units listed in `skip` keep their fresh initialisation, so a
    new classifier head (`skip: [head]`) may have a different model.num_classes."""

    checkpoint: Annotated[str, Field(max_length=MAX_PATH)] | None = Field(
        None,
        description="a committed checkpoint directory (`.../checkpoints/step-NNNNNNNN`), or a "
        "checkpoints directory to take its newest complete checkpoint from; a path as the "
        "controller and workers see it (a relative one is resolved at submission)",
    )
    skip: list[Annotated[str, Field(max_length=MAX_NAME)]] = Field(
        [],
        max_length=MAX_DEPTH + 2,
        description="units left freshly initialised: 'embed', 'head' or 'blocks.<i>'",
    )
    checksum: Annotated[str, Field(max_length=MAX_NAME * 2)] | None = Field(
        None,
        description="the checkpoint's manifest checksum; filled in at submission, so the "
        "workers load exactly the checkpoint that was checked (give it to pin one)",
    )

    @field_validator("skip")
    @classmethod
    def _units(cls, value: list[str]) -> list[str]:
        bad = [u for u in value if not _UNIT_RE.match(u)]
        if bad:
            raise ValueError(
                f"unknown unit(s) {', '.join(map(repr, bad))}: use 'embed', 'head' or "
                "'blocks.<i>' (i from 0 to model.depth - 1)"
            )
        return value

    @model_validator(mode="after")
    def _needs_checkpoint(self) -> InitSpec:
        if self.checkpoint is None and (self.skip or self.checksum):
            raise ValueError(
                "init.skip and init.checksum need init.checkpoint; set it or remove them"
            )
        return self


class JobSpec(_Strict):
    name: str = Field(
        ..., max_length=40, description="lowercase letters, digits and '-', at most 40 characters"
    )
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    training: TrainingSpec = TrainingSpec()
    parallel: ParallelSpec = ParallelSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    runtime: RuntimeSpec = RuntimeSpec()
    freeze: FreezeSpec = FreezeSpec()
    init: InitSpec = InitSpec()

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if not _NAME_RE.match(self.name):
            raise ValueError(
                f"name {self.name!r} must be 1-40 lowercase letters, digits or '-', "
                "starting and ending with a letter or digit"
            )
        if problem := self.data.model_problem(self.model):
            raise ValueError(problem)
        p, t = self.parallel, self.training
        if self.model.pending:
            pass  # the depth checks below wait until the checkpoint has filled in the model
        elif p.num_stages > self.model.depth:
            raise ValueError(
                f"parallel.stages x parallel.virtual_stages ({p.stages} x {p.virtual_stages}) "
                f"exceeds model.depth ({self.model.depth}): each stage needs at least one block; "
                "lower stages or raise depth"
            )
        fz = self.freeze
        if self.model.pending:
            pass
        elif fz.policy != "off" and fz.keep_trainable >= self.model.depth:
            raise ValueError(
                f"freeze.keep_trainable ({fz.keep_trainable}) must be less than model.depth "
                f"({self.model.depth}) when freeze.policy is {fz.policy!r}: at least one block "
                "must be freezable; lower freeze.keep_trainable or raise model.depth"
            )
        if fz.relayout == "repartition" and fz.keep_trainable < p.num_stages:
            # checked whatever the policy: manual overrides freeze up to keep_trainable too
            raise ValueError(
                f"freeze.keep_trainable ({fz.keep_trainable}) must be at least parallel.stages "
                f"x parallel.virtual_stages ({p.stages} x {p.virtual_stages} = {p.num_stages}) "
                "with freeze.relayout 'repartition': it keeps every stage, and each needs a "
                "trainable block after freezing; raise freeze.keep_trainable, lower "
                "parallel.stages or use freeze.relayout 'elastic'"
            )
        beyond = [
            u
            for u in self.init.skip
            if u.startswith("blocks.") and int(u[7:]) >= self.model.depth and not self.model.pending
        ]
        if beyond:
            raise ValueError(
                f"init.skip names {', '.join(beyond)}, beyond the model's blocks "
                f"(blocks.0 .. blocks.{self.model.depth - 1})"
            )
        rt = self.runtime
        if rt.min_nodes is not None and rt.min_nodes > rt.nodes:
            raise ValueError(
                f"runtime.min_nodes ({rt.min_nodes}) exceeds runtime.nodes ({rt.nodes}); "
                "lower min_nodes or raise nodes"
            )
        world = p.world_size
        if world % rt.nodes:
            raise ValueError(
                f"runtime.nodes ({rt.nodes}) must divide the workers of the layout "
                f"(parallel.stages x parallel.replicas = {world}): every node runs the same "
                "number of processes"
            )
        per_step = p.replicas * (1 if p.microbatches == "auto" else p.microbatches)
        if t.global_batch_size % per_step:
            raise ValueError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"parallel.replicas x parallel.microbatches ({per_step})"
            )
        return self

    def to_json(self) -> str:
        return self.model_dump_json()


def _shown(value: Any, limit: int = 80) -> str:
    """`value` as the error message quotes it: its repr, cut to `limit` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr (Python caps int <-> str at 4300 digits)
        text = f"<a {type(value).__name__} too long to show>"
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} chars)"


def _problems(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<spec>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
            msg = f"{msg} (got {_shown(e['input'])})"
        out.append((field, msg))
    return out


def parse_spec(data: Any, source: str | None = None) -> JobSpec:
    """Validate a mapping into a JobSpec, raising SpecError with every problem found."""
    if not isinstance(data, dict):
        raise SpecError([("<spec>", "must be a mapping of fields to values")], source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_problems(err), source) from None


def spec_from_text(text: str, source: str) -> JobSpec:
    """Validate a spec's YAML text that did not come from a file (an environment variable, where
    a container receives it); the same bounds and checks as `load_spec`."""
    if len(text.encode()) > MAX_BYTES:
        raise SpecError([("<file>", f"larger than {MAX_BYTES // 1024} KiB")], source)
    try:
        data = parse_yaml(text, source)
    except SpecFileError as exc:
        raise SpecError([("<file>", str(exc))], source) from None
    return parse_spec(data, source)


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML (or JSON) job spec file. A file that is not a bounded, UTF-8,
    well-formed YAML document without duplicate keys or alias bombs is refused as `<file>`
    (core/specfile.py says what is refused and why)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([("<file>", f"no such file: {path}")], str(path))
    try:
        data = read_spec_file(path)
    except SpecFileError as exc:
        raise SpecError([("<file>", str(exc))], str(path)) from None
    return parse_spec(data, str(path))


def gpu_shortfall(setting: str, workers_per_node: int, gpus: int) -> str | None:
    """Why `runtime.device: <setting>` cannot give each of a node's `workers_per_node` workers
    its own GPU when the node has `gpus` (None if it can, or if the setting does not ask for
    CUDA)."""
    if setting != "cuda":
        return None
    if gpus == 0:
        return (
            "runtime.device is 'cuda' but this node has no CUDA device (or this torch is a "
            "CPU build); use 'cpu' or 'auto'"
        )
    if workers_per_node > gpus:
        return (
            f"runtime.device is 'cuda' and each node runs {workers_per_node} worker(s), one per "
            f"GPU, but this node has {gpus} GPU(s): lower parallel.stages x parallel.replicas / "
            "runtime.nodes (workers per node), raise runtime.nodes, or use 'cpu'"
        )
    return None


def local_device_type(setting: str, workers: int, gpus: int) -> str:
    """The device type, "cuda" or "cpu", that `runtime.device: <setting>` means for `workers`
    workers sharing `gpus` GPUs (a node, or every simulated node of one machine)."""
    if setting == "cuda" or (setting == "auto" and gpus and workers <= gpus):
        return "cuda"
    return "cpu"
