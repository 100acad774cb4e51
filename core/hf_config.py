"""What a Hugging Face checkpoint directory holds, read from its `config.json` alone (plain JSON,
no network, no `transformers` or torch import, so the controller reads it at submission too):
the family (vit, deit, bert, roberta), the task its `architectures` entry names, and the sizes a
pipeline plan needs, as a frozen `HFArchitecture`.
Anything else is refused with a `ValueError` naming the field and what is allowed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Family = Literal["vit", "deit", "bert", "roberta"]
# what a checkpoint's head does; "body": no usable head (a base model, or a pretraining head such
# as masked language modelling), so a job gives it a new one for its task
Task = Literal["image-classification", "sequence-classification", "question-answering", "body"]

# (model_type, architectures[0]) -> task: the classes whose weights the units read
ARCHITECTURES: dict[str, dict[str, Task]] = {
    "vit": {"ViTModel": "body", "ViTForImageClassification": "image-classification"},
    "deit": {"DeiTModel": "body", "DeiTForImageClassification": "image-classification"},
    "bert": {
        "BertModel": "body",
        "BertForPreTraining": "body",
        "BertForMaskedLM": "body",
        "BertForSequenceClassification": "sequence-classification",
        "BertForQuestionAnswering": "question-answering",
    },
    "roberta": {
        "RobertaModel": "body",
        "RobertaForMaskedLM": "body",
        "RobertaForSequenceClassification": "sequence-classification",
        "RobertaForQuestionAnswering": "question-answering",
    },
}
# the `transformers` class a job trains (and exports), by family and task
TASK_CLASSES: dict[tuple[str, str], str] = {
    ("vit", "image-classification"): "ViTForImageClassification",
    ("deit", "image-classification"): "DeiTForImageClassification",
    ("bert", "sequence-classification"): "BertForSequenceClassification",
    ("bert", "question-answering"): "BertForQuestionAnswering",
    ("roberta", "sequence-classification"): "RobertaForSequenceClassification",
    ("roberta", "question-answering"): "RobertaForQuestionAnswering",
}
IMAGE_FAMILIES = ("vit", "deit")
TEXT_FAMILIES = ("bert", "roberta")


@dataclass(frozen=True)
class HFArchitecture:
    """A checkpoint's model as the pipeline sees it. Image fields are set for vit/deit, text
    fields for bert/roberta; the others are None. `num_labels` is the head's output count (2 for
    question answering: start and end logits)."""

    family: Family
    task: Task
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

    @property
    def is_text(self) -> bool:
        return self.family in TEXT_FAMILIES

    def for_task(
        self, task: Literal["classification", "question-answering"], num_labels: int
    ) -> HFArchitecture:
        """The model a job trains from this checkpoint: the spec's task (`core.spec` words) and
        label count (question answering: 2). Another task or label count than the checkpoint's,
        or a checkpoint without a usable head, means a new head."""
        hf_task: Task
        if task == "question-answering":
            hf_task, num_labels = "question-answering", 2
        else:
            hf_task = "sequence-classification" if self.is_text else "image-classification"
        cls = TASK_CLASSES.get((self.family, hf_task))
        if cls is None:
            raise ValueError(f"model.task: {task!r} is not available for {self.family} models")
        return dataclasses.replace(self, task=hf_task, architecture=cls, num_labels=num_labels)

    def same_head(self, other: HFArchitecture) -> bool:
        """Whether `other`'s head (task and outputs) is this one's: its weights can be read."""
        return self.task == other.task and self.num_labels == other.num_labels

    def unit_names(self) -> list[str]:
        """The partition units in model order: `embed`, `blocks.0` .. `blocks.<depth-1>`, `head`."""
        return ["embed", *(f"blocks.{i}" for i in range(self.depth)), "head"]

    @property
    def max_seq_len(self) -> int | None:
        """The longest token sequence the position table holds (text): RoBERTa's positions
        start after its padding index, so two fewer."""
        if self.max_position_embeddings is None:
            return None
        return self.max_position_embeddings - (2 if self.family == "roberta" else 0)

    def spec_fields(self) -> dict[str, Any]:
        """The job spec's `model` fields this checkpoint decides (core.spec.ModelSpec names);
        `num_classes` is the checkpoint's label count, which a spec may change (a new head), and
        `task` its head's, which a spec may change too (a new head); a body has neither."""
        fields: dict[str, Any] = {
            "family": self.family,
            "dim": self.hidden_size,
            "depth": self.depth,
            "heads": self.heads,
            "mlp_ratio": self.intermediate_size / self.hidden_size,
        }
        if self.task != "body":
            fields["num_classes"] = self.num_labels
            fields["task"] = (
                "question-answering" if self.task == "question-answering" else "classification"
            )
        if self.is_text:
            fields["vocab_size"] = self.vocab_size
        else:
            fields |= {
                "image_size": self.image_size,
                "patch_size": self.patch_size,
                "channels": self.num_channels,
            }
        return fields


def _int(raw: dict[str, Any], field: str, default: int | None = None) -> int:
    value = raw.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: `{field}` must be a positive integer, got {value!r}")
    return value


def num_labels_of(raw: dict[str, Any]) -> int:
    """The label count a config.json gives: `id2label`'s size if present (what `transformers`
    writes), else `num_labels`, else 2 (the `transformers` default)."""
    if isinstance(raw.get("id2label"), dict) and raw["id2label"]:
        return len(raw["id2label"])
    return _int(raw, "num_labels", 2)


def parse_architecture(raw: dict[str, Any]) -> HFArchitecture:
    """An `HFArchitecture` from a parsed config.json."""
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config.json: unsupported `model_type` {model_type!r}; "
            f"allowed: {', '.join(sorted(ARCHITECTURES))}"
        )
    allowed = ARCHITECTURES[model_type]
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in allowed:
        raise ValueError(
            f"config.json: unsupported `architectures` {archs!r} for model_type {model_type!r}; "
            f"allowed: one of {', '.join(sorted(allowed))}"
        )
    architecture = archs[0]
    task = allowed[architecture]
    hidden, heads = _int(raw, "hidden_size"), _int(raw, "num_attention_heads")
    if hidden % heads:
        raise ValueError(
            f"config.json: `hidden_size` {hidden} is not a multiple of "
            f"`num_attention_heads` {heads}"
        )
    common: dict[str, Any] = {
        "family": model_type,
        "task": task,
        "architecture": architecture,
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
    if model_type in IMAGE_FAMILIES:
        return HFArchitecture(
            **common,
            image_size=_int(raw, "image_size"),
            patch_size=_int(raw, "patch_size"),
            num_channels=_int(raw, "num_channels", 3),
        )
    return HFArchitecture(
        **common,
        vocab_size=_int(raw, "vocab_size"),
        max_position_embeddings=_int(raw, "max_position_embeddings"),
        type_vocab_size=_int(raw, "type_vocab_size", 2),
    )


def read_config_json(directory: str | Path) -> dict[str, Any]:
    """A checkpoint directory's config.json, parsed."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no config.json in the checkpoint directory") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw


def read_architecture(directory: str | Path) -> HFArchitecture:
    """The `HFArchitecture` of the checkpoint in `directory` (its config.json only)."""
    return parse_architecture(read_config_json(directory))


WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
_MAX_HEADER = 100 << 20  # safetensors caps its JSON header at 100 MB


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, else the one file."""
    directory = Path(directory)
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError) as e:
            raise ValueError(f"{index}: not valid JSON ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no `weight_map` object")
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / WEIGHTS_FILE).is_file():
        return [directory / WEIGHTS_FILE]
    if (directory / "pytorch_model.bin").is_file():
        raise ValueError(
            f"{directory}: only pytorch_model.bin (a pickle); load it in transformers and "
            "save_pretrained it again to get model.safetensors"
        )
    raise ValueError(f"{directory}: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}")


def fingerprint(directory: str | Path) -> str:
    """A digest of a checkpoint's config.json and each safetensors file's size and header
    (tensor names, dtypes, shapes, offsets): cheap at any model size, and it changes when the
    checkpoint is replaced by another one (weights rewritten in place with the same layout are
    not seen)."""
    directory = Path(directory)
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for path in weight_files(directory):
        try:
            with path.open("rb") as f:
                raw = f.read(8)
                n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
                if not 0 < n <= _MAX_HEADER:
                    raise ValueError(f"{path}: not a safetensors file")
                digest.update(path.name.encode() + path.stat().st_size.to_bytes(8, "little"))
                digest.update(f.read(n))
        except FileNotFoundError:
            raise ValueError(f"{path}: missing (named by {WEIGHTS_INDEX})") from None
    return digest.hexdigest()[:32]
