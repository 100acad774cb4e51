"""The model families a job can train, one registry: `FAMILIES`.

A family is one module here (its description: `core/families/base.py` says what that holds)
and one module of `pipetransformer.models` (its torch build, named by `Family.build`). Adding a
family is its two modules, one line below, and its tests.

A spec names a family (`model.family`) and where the weights come from: a seed (no
`model.pretrained`) or a checkpoint, whose config.json's `model_type` names the family."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipetransformer.core.families import bert, decoder, seeded, vit
from pipetransformer.core.families.base import (
    Architecture,
    Family,
    HeadTask,
    Modality,
    Source,
    TiedParameter,
    block_index,
    num_labels_of,
    unit_names,
)

if TYPE_CHECKING:
    from pipetransformer.core.spec import ModelSpec

FAMILIES: tuple[Family, ...] = (
    seeded.VIT,
    seeded.BERT,
    vit.VIT,
    vit.DEIT,
    bert.BERT,
    bert.ROBERTA,
    decoder.LLAMA,
    decoder.QWEN2,
    decoder.QWEN3,
    decoder.MISTRAL,
    decoder.GPT2,
)

_BY_SOURCE: dict[tuple[str, str], Family] = {(f.name, f.source): f for f in FAMILIES}
_BY_MODEL_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES if f.model_type}
NAMES: tuple[str, ...] = tuple(dict.fromkeys(f.name for f in FAMILIES))
SEEDED: tuple[str, ...] = tuple(f.name for f in FAMILIES if f.source == "seed")

__all__ = [
    "FAMILIES",
    "NAMES",
    "SEEDED",
    "Architecture",
    "Family",
    "HeadTask",
    "Modality",
    "Source",
    "TiedParameter",
    "block_index",
    "checkpoint_family",
    "family_of",
    "lookup",
    "num_labels_of",
    "parse_architecture",
    "unit_names",
]


def lookup(name: str, pretrained: bool) -> Family | None:
    """The family `name` whose weights come from a checkpoint (`pretrained`) or a seed."""
    return _BY_SOURCE.get((name, "checkpoint" if pretrained else "seed"))


def family_of(model: ModelSpec) -> Family:
    """The family a job's model belongs to (ValueError naming model.family otherwise)."""
    found = lookup(model.family, model.pretrained is not None)
    if found is None:
        if model.pretrained is None:
            raise ValueError(
                f"family {model.family!r} comes from a checkpoint: set model.pretrained "
                f"(or use {' / '.join(repr(n) for n in SEEDED)} for a model built from a seed)"
            )
        raise ValueError(f"family {model.family!r} is not read from a checkpoint")
    return found


def checkpoint_family(raw: dict[str, Any]) -> Family:
    """The family of a parsed config.json, by its `model_type`."""
    model_type = raw.get("model_type")
    found = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if found is None:
        raise ValueError(
            f"config.json: unsupported `model_type` {model_type!r}; "
            f"allowed: {', '.join(sorted(_BY_MODEL_TYPE))}"
        )
    return found


def parse_architecture(raw: dict[str, Any]) -> Architecture:
    """A checkpoint's `Architecture` from its parsed config.json."""
    return checkpoint_family(raw).parse_config(raw)
