"""`digits`: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), for the
seeded ViT. `data.classes` keeps only some digits, relabelled 0 .. len(classes)-1 in the order
given; the held-out split is drawn from the whole data set first and then filtered, so jobs with
the same `seed` never train on each other's held-out images, whatever classes they keep."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetransformer.core.datasets.base import BuiltinKind, DataSize

if TYPE_CHECKING:
    from pipetransformer.core.spec import DataSpec, ModelSpec

# scikit-learn's digits per class (1797 images; a fixed data set since 1998)
DIGITS_PER_CLASS = (178, 182, 177, 183, 181, 182, 181, 179, 174, 180)


@dataclass(frozen=True)
class Digits(BuiltinKind):
    def classes_problem(self, data: DataSpec) -> str | None:
        if data.classes is not None and (
            len(data.classes) < 2 or len(set(data.classes)) != len(data.classes)
        ):
            return f"data.classes must list at least 2 different digits (got {data.classes})"
        return None

    def details(self, data: DataSpec) -> str | None:
        if data.classes is None:
            return None
        return f"classes {', '.join(map(str, data.classes))}"

    def num_classes(self, data: DataSpec) -> int | None:
        return 10 if data.classes is None else len(data.classes)

    def model_problem(self, data: DataSpec, model: ModelSpec) -> str | None:
        if problem := super().model_problem(data, model):
            return problem
        k = self.num_classes(data)
        if (model.image_size, model.channels, model.num_classes) != (8, 1, k):
            kept = "" if data.classes is None else " (the digits data.classes keeps)"
            return (
                f"dataset 'digits' is 8x8 grey images of {k} classes{kept}: set "
                f"model.image_size=8, model.channels=1, model.num_classes={k}"
            )
        return None

    def size(self, data: DataSpec, model: ModelSpec) -> DataSize:
        kept = data.classes if data.classes is not None else range(10)
        tf = data.test_fraction
        # trainer/data.py holds out max(1, round(n_c x test_fraction)) images of each class
        train = sum(DIGITS_PER_CLASS[c] - max(1, round(DIGITS_PER_CLASS[c] * tf)) for c in kept)
        return DataSize(
            sum(DIGITS_PER_CLASS),
            train,
            train,
            f"digits' {sum(DIGITS_PER_CLASS[c] for c in kept)} images of the kept classes "
            f"less data.test_fraction {tf} of each class",
        )


DIGITS = Digits("digits", files=False, opens="pipetransformer.trainer.data:digits")
