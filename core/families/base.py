"""What a model family is to the pipeline, without torch: `Family` (a base to subclass, one
instance per registered family) and `Architecture` (a Hugging Face checkpoint's model as its
`config.json` describes it).

A family says:

- where its models come from (`source`: a seed, or a checkpoint's `config.json`) and what they
  read (`modality`: images or token ids);
- for a checkpoint: which `config.json` classes it reads (`model_type`, `architectures`, each
  mapped to what its head does) and how they become the job's model description
  (`parse_config`, `spec_fields`); the class a job's model is exported as (`task_classes`);
- its units (`embed`, `blocks.<i>`, `head`) with the checkpoint's own parameter names
  (`unit_prefixes`, `key_prefix`), and the pair of parameters of two units that are one tensor
  in the checkpoint (`tied_parameters`: a language model's tied input and output embeddings);
- what travels between stages (`tokens`, `width`) and what enters the first (`input_shape`,
  `input_dtype`);
- its parameter counts and FLOPs for admission, the planner and MFU (`*_params`, `*_flops`);
- which module builds it with torch (`build`: one module of `pipetransformer.models`).

Every method takes the job's `ModelSpec` (or an `Architecture`) and is pure. The registry is
`pipetransformer.core.families`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pipetransformer.core.tasks import CLASSIFICATION, QUESTION_ANSWERING, task_of

if TYPE_CHECKING:
    from pipetransformer.core.spec import ModelSpec

Modality = Literal["image", "text"]
Source = Literal["seed", "checkpoint"]
# what a checkpoint's head does; "body": no usable head (a base model, or a pretraining head such
# as masked language modelling), so a job gives it a new one for its task; "causal-lm": the next
# token over the vocabulary (a decoder-only language model's `*ForCausalLM`)
HeadTask = Literal[
    "image-classification", "sequence-classification", "question-answering", "causal-lm", "body"
]
# one parameter of a tied pair: (unit name, the parameter's name in that unit's state_dict)
TiedParameter = tuple[str, str]


def unit_names(depth: int) -> list[str]:
    """The partition units in model order: `embed`, `blocks.0` .. `blocks.<depth-1>`, `head`."""
    return ["embed", *(f"blocks.{i}" for i in range(depth)), "head"]


def block_index(name: str, depth: int) -> int:
    """The index of unit `blocks.<i>` (ValueError naming it otherwise)."""
    try:
        i = int(name.removeprefix("blocks."))
    except ValueError:
        raise ValueError(f"unknown unit {name!r}: expected blocks.<i>") from None
    if not name.startswith("blocks.") or not 0 <= i < depth:
        raise ValueError(f"unit {name!r} outside a model of {depth} blocks")
    return i


def encoder_adapter_layers(dim: int, hidden: int) -> dict[str, list[tuple[int, int]]]:
    """A BERT or ViT layer's projections by `transformers`' names, each (inputs, outputs) of
    every layer of that name: query, key and value (d x d); `dense`, the attention output
    (d x d), the MLP's intermediate (d x h) and output (h x d)."""
    square = [(dim, dim)]
    return {
        "query": square,
        "key": square,
        "value": square,
        "dense": [(dim, dim), (dim, hidden), (hidden, dim)],
    }


@dataclass(frozen=True)
class Architecture:
    """A checkpoint's model as the pipeline sees it (from config.json alone). Image fields are
    set for image families, text fields for text families; the others are None. `num_labels` is
    the head's output count (2 for question answering: start and end logits; a language model's
    vocabulary). Decoder-only language models also set `kv_heads` (grouped-query attention: the
    heads of keys and values), `head_dim` (the width of one attention head) and
    `tie_embeddings` (the output projection is the input embedding's tensor)."""

    family: str
    task: HeadTask
    architecture: str
    depth: int
    hidden_size: int
    heads: int
    intermediate_size: int
    num_labels: int
    image_size: int | None = None
    patch_size: int | None = None
    num_channels: int | None = None
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    type_vocab_size: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    tie_embeddings: bool = False

    def same_head(self, other: Architecture) -> bool:
        """Whether `other`'s head (task and outputs) is this one's: its weights can be read."""
        return self.task == other.task and self.num_labels == other.num_labels

    def unit_names(self) -> list[str]:
        return unit_names(self.depth)

    # the checkpoint's family's answers, for this architecture

    @property
    def family_info(self) -> Family:
        from pipetransformer.core.families import lookup  # the registry imports this module

        found = lookup(self.family, pretrained=True)
        if found is None:
            raise ValueError(f"no checkpoint family {self.family!r}")
        return found

    @property
    def is_text(self) -> bool:
        return self.family_info.is_text

    def for_task(self, task: str, num_labels: int) -> Architecture:
        """The model a job trains from this checkpoint (`Family.for_task`)."""
        return self.family_info.for_task(self, task, num_labels)


def _int(raw: dict[str, Any], name: str, default: int | None = None) -> int:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: `{name}` must be a positive integer, got {value!r}")
    return value


def num_labels_of(raw: dict[str, Any]) -> int:
    """The label count a config.json gives: `id2label`'s size if present (what `transformers`
    writes), else `num_labels`, else 2 (the `transformers` default)."""
    if isinstance(raw.get("id2label"), dict) and raw["id2label"]:
        return len(raw["id2label"])
    return _int(raw, "num_labels", 2)


@dataclass(frozen=True)
class Family:
    """One registered family. The defaults describe a pre-norm transformer encoder of
    `model.depth` blocks of width `model.dim` (the project's seeded models); a family overrides
    what differs."""

    name: str  # the spec's model.family
    source: Source
    modality: Modality
    build: str  # the module of pipetransformer.models that builds it with torch
    tasks: tuple[str, ...] = (CLASSIFICATION.name,)  # the spec's model.task values it trains
    model_type: str | None = None  # config.json `model_type` (checkpoint families)
    # config.json `architectures[0]` it reads -> what that class's head does
    architectures: Mapping[str, HeadTask] = field(default_factory=dict)
    # the spec's model.task -> the `transformers` class a job's model is exported as
    task_classes: Mapping[str, str] = field(default_factory=dict)
    # spec fields a seeded model of this family cannot do without
    required: tuple[str, ...] = ()

    @property
    def is_text(self) -> bool:
        return self.modality == "text"

    # -- the job's model ------------------------------------------------------------------------

    def tokens(self, model: ModelSpec) -> int:
        """Tokens in the hidden states between blocks."""
        if self.is_text:
            return model.seq_len or 0
        return (model.image_size // model.patch_size) ** 2 + 1  # patches + CLS

    def width(self, model: ModelSpec) -> int:
        """Channels of the hidden states between stages."""
        return model.dim

    def input_shape(self, model: ModelSpec, batch: int) -> tuple[int, ...]:
        """One batch of model inputs: images [B, C, H, W], or token ids [B, T]."""
        if self.is_text:
            return (batch, model.seq_len or 0)
        return (batch, model.channels, model.image_size, model.image_size)

    def input_dtype(self, model: ModelSpec) -> Literal["int64", "float32"]:
        return "int64" if self.is_text else "float32"

    def problem(self, model: ModelSpec) -> str | None:
        """Why `model` (this family's, resolved) is not a valid model of it, or None."""
        if not self.is_text and model.image_size % model.patch_size:
            return f"patch_size ({model.patch_size}) must divide image_size ({model.image_size})"
        return None

    # -- parameters and FLOPs (orchestrator/admission.py, core/flops.py) ------------------------

    def hidden(self, model: ModelSpec) -> int:
        """The MLP's hidden units."""
        return int(model.dim * model.mlp_ratio)

    def block_params(self, model: ModelSpec) -> int:
        """qkv without bias, q/v biases, projection, two LayerNorms, the MLP."""
        d, h = model.dim, self.hidden(model)
        return 4 * d * d + 2 * d * h + 8 * d + h

    def embed_params(self, model: ModelSpec) -> int:
        d = model.dim
        if self.is_text:  # tokens, CLS, positions, LayerNorm
            return (model.vocab_size or 0) * d + d + self.tokens(model) * d + 2 * d
        return model.channels * model.patch_size**2 * d + d + d + self.tokens(model) * d

    def head_params(self, model: ModelSpec) -> int:
        return 2 * model.dim + model.dim * model.num_classes + model.num_classes

    def block_flops(self, model: ModelSpec) -> float:
        """Forward FLOPs of one block for one sample: 2 T (4 d^2 + 2 d H) for q/k/v, the
        output projection and the two MLP matrices, plus 4 T^2 d for attention."""
        t, d, h = self.tokens(model), model.dim, self.hidden(model)
        return float(2 * t * (4 * d * d + 2 * d * h) + 4 * t * t * d)

    def embed_flops(self, model: ModelSpec) -> float:
        """Forward FLOPs of the embedding for one sample: the patch projection (text: a table
        lookup, 0)."""
        if self.is_text:
            return 0.0
        patches = (model.image_size // model.patch_size) ** 2
        return float(2 * patches * model.channels * model.patch_size**2 * model.dim)

    def head_flops(self, model: ModelSpec) -> float:
        """Forward FLOPs of the head for one sample, as its task reads the hidden states."""
        return task_of(model).head_flops(model.dim, model.num_classes, self.tokens(model))

    # -- adapters (model.adapters) ---------------------------------------------------------------

    def adapter_layers(self, model: ModelSpec) -> dict[str, list[tuple[int, int]]] | None:
        """The projections of a block that LoRA may adapt, by module name (what `peft` matches
        a target against), each with the (inputs, outputs) of every layer of that name in a
        block. None: the family takes no adapters (the seeded models, which start from
        nothing)."""
        return None

    def adapter_targets(self, model: ModelSpec) -> dict[str, int] | None:
        """Each adaptable projection with the largest rank it takes: the narrowest side of
        every layer of that name."""
        layers = self.adapter_layers(model)
        if layers is None:
            return None
        return {name: min(min(io) for io in sides) for name, sides in layers.items()}

    def adapter_params(self, model: ModelSpec) -> int:
        """Parameters of one block's adapters (`model.adapters`): rank x (inputs + outputs) of
        every targeted layer (0 without adapters)."""
        layers, adapters = self.adapter_layers(model), model.adapters
        if layers is None or adapters is None:
            return 0
        chosen = adapters.targets or list(layers)
        return sum(adapters.rank * (i + o) for name in chosen for i, o in layers[name])

    # -- a checkpoint (checkpoint families) -----------------------------------------------------

    @property
    def key_prefix(self) -> str:
        """What the body's parameter names start with in a task model's checkpoint."""
        return self.model_type or self.name

    def parse_config(self, raw: dict[str, Any]) -> Architecture:
        """An `Architecture` from a parsed config.json of this family (ValueError naming the
        field otherwise)."""
        archs = raw.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in self.architectures:
            raise ValueError(
                f"config.json: unsupported `architectures` {archs!r} for model_type "
                f"{self.model_type!r}; allowed: one of {', '.join(sorted(self.architectures))}"
            )
        hidden, heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
        if hidden % heads:
            raise ValueError(
                f"config.json: `hidden_size` {hidden} is not a multiple of "
                f"`num_attention_heads` {heads}"
            )
        task = self.architectures[archs[0]]
        common: dict[str, Any] = {
            "family": self.name,
            "task": task,
            "architecture": archs[0],
            "depth": _int(raw, "num_hidden_layers"),
            "hidden_size": hidden,
            "heads": heads,
            "intermediate_size": _int(raw, "intermediate_size"),
            "num_labels": num_labels_of(raw),
        }
        if task == "question-answering" and common["num_labels"] != 2:
            raise ValueError(
                f"config.json: question answering needs `num_labels` 2 (start and end logits), "
                f"got {common['num_labels']}"
            )
        return Architecture(**common, **self.config_fields(raw))

    def config_fields(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The modality's own fields of an `Architecture`, from config.json."""
        if self.is_text:
            return {
                "vocab_size": _int(raw, "vocab_size"),
                "max_position_embeddings": _int(raw, "max_position_embeddings"),
                "type_vocab_size": _int(raw, "type_vocab_size", 2),
            }
        return {
            "image_size": _int(raw, "image_size"),
            "patch_size": _int(raw, "patch_size"),
            "num_channels": _int(raw, "num_channels", 3),
        }

    def max_seq_len(self, arch: Architecture) -> int | None:
        """The longest token sequence the checkpoint's position table holds (text)."""
        return arch.max_position_embeddings

    def head_task(self, task: str) -> HeadTask:
        """What a head trained for the spec's `task` does, in config.json's words."""
        if task == QUESTION_ANSWERING.name:
            return "question-answering"
        return "sequence-classification" if self.is_text else "image-classification"

    def for_task(self, arch: Architecture, task: str, num_labels: int) -> Architecture:
        """The model a job trains from this checkpoint: the spec's task and label count
        (question answering: 2). Another task or label count than the checkpoint's, or a
        checkpoint without a usable head, means a new head."""
        cls = self.task_classes.get(task)
        if cls is None:
            raise ValueError(f"model.task: {task!r} is not available for {self.name} models")
        return dataclasses.replace(
            arch,
            task=self.head_task(task),
            architecture=cls,
            num_labels=task_of(task).num_outputs(num_labels),
        )

    def spec_fields(self, arch: Architecture) -> dict[str, Any]:
        """The job spec's `model` fields this checkpoint decides (ModelSpec names);
        `num_classes` is the checkpoint's label count, which a spec may change (a new head), and
        `task` its head's, which a spec may change too (a new head); a body has neither."""
        fields: dict[str, Any] = {
            "family": self.name,
            "dim": arch.hidden_size,
            "depth": arch.depth,
            "heads": arch.heads,
            "mlp_ratio": arch.intermediate_size / arch.hidden_size,
        }
        if arch.task != "body":
            fields["num_classes"] = arch.num_labels
            fields["task"] = (
                QUESTION_ANSWERING.name
                if arch.task == "question-answering"
                else CLASSIFICATION.name
            )
        if self.is_text:
            fields["vocab_size"] = arch.vocab_size
        else:
            fields |= {
                "image_size": arch.image_size,
                "patch_size": arch.patch_size,
                "channels": arch.num_channels,
            }
        return fields

    def unit_prefixes(self, arch: Architecture, name: str) -> tuple[str, ...]:
        """The checkpoint key prefixes that belong to unit `name` (of a task model's
        checkpoint: the body's keys under `key_prefix`)."""
        p = self.key_prefix
        if name == "embed":
            return (f"{p}.embeddings.",)
        if name.startswith("blocks."):
            return (f"{p}.encoder.layer.{block_index(name, arch.depth)}.",)
        if name != "head":
            raise ValueError(f"unknown unit {name!r}: expected embed, blocks.<i> or head")
        return self.head_prefixes(arch)

    def head_prefixes(self, arch: Architecture) -> tuple[str, ...]:
        """The checkpoint key prefixes of the head unit (what the head holds for arch.task)."""
        raise NotImplementedError(f"{self.name} models are not read from a checkpoint")

    def tied_parameters(
        self, model: Architecture | ModelSpec
    ) -> tuple[TiedParameter, TiedParameter] | None:
        """The two parameters, each in its own unit, that are one tensor in the checkpoint (a
        language model's output projection tied to its input embedding): ((source unit, name),
        (tied unit, name)), names as in the units' state_dict (in a `StageModule` or a rank's
        model: `<unit>.<name>`); None when nothing is tied. Asked of the checkpoint's
        `Architecture` or of the job's resolved `ModelSpec` (its `tie_embeddings`).

        The units hold one copy each: the tied copy is read from the source's tensor when the
        checkpoint has no tensor of its own (save_pretrained writes a tied pair once), the
        pipeline sums the two copies' gradients where the units are on different stages, the
        pair freezes with the source (the embedding: the frozen prefix), and an export writes
        the source's tensor alone."""
        return None
