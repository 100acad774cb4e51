"""Seeded data made by every worker, for benchmarks and tests: `synthetic` (random images of the
model's shape whose class shifts their mean; the seeded ViT) and `synthetic-text` (token
sequences of the model's seq_len whose label is whichever of the num_classes keyword tokens,
ids 0 .. num_classes-1, occurs most often; the seeded BERT), `data.synthetic_samples` each."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetransformer.core.datasets.base import BuiltinKind, DataSize

if TYPE_CHECKING:
    from pipetransformer.core.spec import DataSpec, ModelSpec


@dataclass(frozen=True)
class Synthetic(BuiltinKind):
    def details(self, data: DataSpec) -> str | None:
        return f"{data.synthetic_samples:,} samples, seed {data.seed}"

    def size(self, data: DataSpec, model: ModelSpec) -> DataSize:
        n, tf = data.synthetic_samples, data.test_fraction
        classes = min(n, model.num_classes)
        return DataSize(
            n,
            math.floor(n * (1 - tf)),
            math.floor(n * (1 - tf) - classes),
            f"data.synthetic_samples {n} x (1 - data.test_fraction {tf})",
        )


@dataclass(frozen=True)
class SyntheticText(Synthetic):
    def model_problem(self, data: DataSpec, model: ModelSpec) -> str | None:
        if problem := super().model_problem(data, model):
            return problem
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


SYNTHETIC = Synthetic(
    "synthetic", files=False, opens="pipetransformer.trainer.data:synthetic_images"
)
SYNTHETIC_TEXT = SyntheticText(
    "synthetic-text",
    files=False,
    opens="pipetransformer.trainer.data:synthetic_sequences",
    modality="text",
)
