"""`model`: which transformer a job trains (a registered family, seeded or from a checkpoint)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipetransformer.core import families
from pipetransformer.core.spec.adapters import AdaptersSpec
from pipetransformer.core.spec.base import (
    MAX_CHANNELS,
    MAX_CLASSES,
    MAX_DEPTH,
    MAX_DIM,
    MAX_HEADS,
    MAX_IMAGE_SIZE,
    MAX_MLP_RATIO,
    MAX_NAME,
    MAX_PATH,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    Number,
    PositiveInt,
    _Strict,
)
from pipetransformer.core.tasks import task_of


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
    """A transformer whose blocks (`blocks.<i>`) are the partition units, of a registered model
    family (`pipetransformer.core.families`).

    Built here from a seeded initialisation: a ViT over small images (`family: vit`) or a
    BERT-style text encoder (`family: bert`). Shared: dim, depth, heads, mlp_ratio, num_classes,
    dropout. ViT only: image_size, patch_size, channels. BERT only (required for it):
    vocab_size, seq_len. The other family's fields are ignored (not validated), so a spec dumped
    with every field parses back unchanged.

    Or from a Hugging Face checkpoint (`pretrained`): ViT, DeiT, BERT or RoBERTa; its config.json
    decides family, task, dim, depth, heads, mlp_ratio and the input fields, which the spec then
    leaves out (a value that contradicts the checkpoint is an error naming the field). The spec
    still chooses `num_classes` (another label count than the checkpoint's gets a new head) and,
    for text, `seq_len` (tokens per input; default 128).

    Decoder-only language models (Llama, Qwen2, Qwen3, Mistral, GPT-2; task `causal-lm`) from a
    checkpoint also get `kv_heads`, `head_dim`, `tie_embeddings` and (GPT-2) `max_positions`
    from its config.json, and `num_classes` is their `vocab_size`."""

    pretrained: Annotated[PretrainedSpec | None, BeforeValidator(_pretrained_shorthand)] = None
    family: Annotated[str, Field(max_length=MAX_NAME)] = Field(
        "vit", description=f"the model family: {', '.join(families.NAMES)}"
    )
    task: Annotated[str, Field(max_length=MAX_NAME)] = Field(
        "classification",
        description="classification (images, sentences, sentence pairs), question-answering "
        "(extractive spans, SQuAD-style; BERT and RoBERTa) or causal-lm (the next token; "
        "decoder-only language models). Default: the checkpoint's head; another task than the "
        "checkpoint's gets a new head",
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
        "pretrained text models: tokens per input, [CLS] and [SEP] included (default 128); "
        "causal-lm: tokens per packed sequence",
    )
    dim: Annotated[PositiveInt, Field(le=MAX_DIM)] = 64
    depth: Annotated[PositiveInt, Field(le=MAX_DEPTH)] = Field(
        6, description="number of transformer blocks"
    )
    heads: Annotated[PositiveInt, Field(le=MAX_HEADS)] = 4
    mlp_ratio: Annotated[Number, Field(gt=0, le=MAX_MLP_RATIO)] = 2.0
    num_classes: Annotated[PositiveInt, Field(le=MAX_CLASSES)] = 10
    dropout: Annotated[Number, Field(ge=0, lt=1)] = 0.0
    # decoder-only language models (llama, qwen2, qwen3, mistral, gpt2), from config.json: what
    # their parameter counts and FLOPs need beyond the fields above; None/False for every other
    # model
    kv_heads: Annotated[PositiveInt, Field(le=MAX_HEADS)] | None = Field(
        None,
        description="decoder language models: heads of keys and values (grouped-query "
        "attention; config.json num_key_value_heads); default: heads",
    )
    head_dim: Annotated[PositiveInt, Field(le=MAX_DIM)] | None = Field(
        None,
        description="decoder language models: width of one attention head; default dim / heads",
    )
    tie_embeddings: bool = Field(
        False,
        description="decoder language models: the output projection is the input embedding "
        "(config.json tie_word_embeddings)",
    )
    max_positions: Annotated[PositiveInt, Field(le=MAX_SEQ_LEN)] | None = Field(
        None, description="gpt2: rows of its learned position table (config.json n_positions)"
    )
    adapters: AdaptersSpec | None = Field(
        None,
        description="LoRA adapters on a pretrained model's projections: only they (and a new "
        "head) train, the base weights stay the checkpoint's",
    )

    @property
    def pending(self) -> bool:
        """A pretrained model whose checkpoint was not read yet: its architecture fields are
        not known until submission resolves it."""
        return self.pretrained is not None and not self.pretrained.resolved

    @property
    def family_info(self) -> families.Family:
        """The registered family this model belongs to."""
        return families.family_of(self)

    @property
    def is_text(self) -> bool:
        return self.family_info.is_text

    @property
    def tokens(self) -> int:
        """Tokens in the hidden states between blocks (the family's count: patches + CLS for
        a ViT, DeiT adds its distillation token; seq_len + a prepended CLS for the seeded bert;
        seq_len for pretrained text, whose tokenizer writes [CLS] itself)."""
        return self.family_info.tokens(self)

    @property
    def width(self) -> int:
        """Channels of the hidden states between stages: dim, plus one for pretrained text
        models, whose stages carry the attention mask as an extra channel."""
        return self.family_info.width(self)

    @field_validator("family")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in families.NAMES:
            raise ValueError(
                f"family {value!r} is not available; choose one of {', '.join(families.NAMES)}"
            )
        return value

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str) -> str:
        return task_of(value).name

    @field_validator("vocab_size", "seq_len")
    @classmethod
    def _seeded_needs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None and info.data.get("pretrained") is None:
            family = families.lookup(info.data.get("family", ""), pretrained=False)
            if family is not None and info.field_name in family.required:
                raise ValueError(
                    f"required when family is {family.name!r} (set model.{info.field_name})"
                )
        return value

    @model_validator(mode="after")
    def _shapes(self) -> ModelSpec:
        family = families.family_of(self)  # a checkpoint-only family without one: refused
        if self.pretrained is None and self.task not in family.tasks:
            able = [f.name for f in families.FAMILIES if self.task in f.tasks]
            raise ValueError(
                f"task {self.task!r} needs a pretrained checkpoint (model.pretrained) of "
                f"{' or '.join(able)}"
            )
        if self.adapters is not None and self.pretrained is None:
            raise ValueError(
                "model.adapters needs a pretrained checkpoint (model.pretrained): LoRA adapts "
                "trained weights, and a seeded model has none"
            )
        if self.pending:
            return self  # checked once the checkpoint has filled in the architecture
        if self.adapters is not None and (problem := _adapters_problem(self, self.adapters)):
            raise ValueError(problem)
        if problem := family.problem(self):
            raise ValueError(problem)
        if self.head_dim is None and self.dim % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide dim ({self.dim})")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if int(self.dim * self.mlp_ratio) < 1:
            raise ValueError(
                f"mlp_ratio ({self.mlp_ratio}) x dim ({self.dim}) leaves the MLP no hidden "
                "units; raise mlp_ratio"
            )
        task = task_of(self)
        if task.vocab_outputs and self.num_classes != self.vocab_size:
            raise ValueError(
                f"task {self.task!r} predicts the next token over the vocabulary: num_classes "
                f"is vocab_size ({self.vocab_size}), got {self.num_classes}; leave it out"
            )
        fixed = task.fixed_outputs
        if fixed is not None and self.num_classes != fixed:
            raise ValueError(
                f"task {self.task!r} has {fixed} outputs (question answering: a start and an "
                f"end): num_classes must be {fixed} (got {self.num_classes})"
            )
        return self


def _adapters_problem(model: ModelSpec, adapters: AdaptersSpec) -> str | None:
    """Why `adapters` do not fit `model` (resolved), naming the field: a target the family's
    blocks do not have, or a rank wider than a targeted projection's narrowest side."""
    family = model.family_info
    targets = family.adapter_targets(model)
    if targets is None:
        able = [f.name for f in families.FAMILIES if f.adapter_layers(model) is not None]
        return (
            f"model.adapters: the {family.name} family takes no adapters (yet); LoRA runs on "
            f"{', '.join(able)}"
        )
    unknown = [t for t in adapters.targets or () if t not in targets]
    if unknown:
        return (
            f"model.adapters.targets: {', '.join(map(repr, unknown))} "
            f"{'is not a projection' if len(unknown) == 1 else 'are not projections'} of "
            f"{family.name}'s blocks; choose from {', '.join(targets)}"
        )
    chosen = adapters.targets or list(targets)
    narrowest = min(chosen, key=lambda t: targets[t])
    if adapters.rank > targets[narrowest]:
        return (
            f"model.adapters.rank ({adapters.rank}) is wider than {narrowest}, whose narrowest "
            f"side is {targets[narrowest]}: at most {targets[narrowest]} (a rank that wide "
            "is full fine-tuning)"
        )
    return None
