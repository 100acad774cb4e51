"""The project's own models, built from a seed (no checkpoint): a ViT over small images
(`family: vit`) and a BERT-style text encoder (`family: bert`), sharing a pre-norm block and a
classifier head (`pipetransformer.models.seeded`). Parameter counts are exact
(tests/test_admission.py counts the real modules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetransformer.core.families.base import Family

if TYPE_CHECKING:
    from pipetransformer.core.spec import ModelSpec


@dataclass(frozen=True)
class SeededText(Family):
    """Token ids [B, seq_len]; a learned CLS vector is prepended, so seq_len + 1 tokens travel."""

    def tokens(self, model: ModelSpec) -> int:
        return (model.seq_len or 0) + 1


VIT = Family(name="vit", source="seed", modality="image", build="pipetransformer.models.seeded")
BERT = SeededText(
    name="bert",
    source="seed",
    modality="text",
    build="pipetransformer.models.seeded",
    required=("vocab_size", "seq_len"),
)
