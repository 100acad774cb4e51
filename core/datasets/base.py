"""What a kind of data (`data.dataset`) is to a job, without torch: `DataKind`, subclassed once
per kind (one module each in this package; the registry is `pipetransformer.core.datasets`).

A kind says which `data.*` fields it needs and allows (`problem`), whether it can feed a model
(`model_problem`), how many classes it has where it decides that (`num_classes`), what every
worker holds of it (`size`, for admission), what it reads (`columns`, for provenance), which of
its paths must be folders (`folders`), and which data-plane function opens it as two splits
(`opens`: `module:function`, `(data, model) -> (train, test)`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetransformer.core import families

if TYPE_CHECKING:
    from pipetransformer.core.spec import DataSpec, ModelSpec
    from pipetransformer.core.tasks import Task

SOURCE_FIELDS = ("train", "test", "path")  # where a kind of the user's files reads from


@dataclass(frozen=True)
class DataSize:
    """What every worker holds of the data set (admission: orchestrator/admission.py)."""

    samples: int  # loaded by every worker (before digits' class filter)
    train: int  # the training split (expected; exact for digits)
    train_at_least: int  # what the stratified split leaves at worst (every class rounds up)
    about: str  # where `train` comes from, for messages


def seeded_names(modality: str) -> str:
    """The seeded families of a modality, as a message names them."""
    names = [f.name for f in families.FAMILIES if f.source == "seed" and f.modality == modality]
    return " or ".join(repr(n) for n in names)


@dataclass(frozen=True)
class DataKind:
    name: str
    files: bool  # the user's files, read through the model's own preprocessing
    opens: str  # `module:function` of the data plane that opens it as (train, test)

    def problem(self, data: DataSpec) -> str | None:
        """Why `data`'s fields do not fit this kind (naming them), or None."""
        return self.classes_problem(data)

    def classes_problem(self, data: DataSpec) -> str | None:
        """`data.classes` selects digits: refused by every other kind."""
        if data.classes is not None:
            return (
                f"data.classes selects digits and needs dataset 'digits' (got {self.name!r}); "
                "remove it"
            )
        return None

    def model_problem(self, data: DataSpec, model: ModelSpec) -> str | None:
        """Why this data set cannot feed `model` (a message naming the fields), or None."""
        return None

    def num_classes(self, data: DataSpec) -> int | None:
        """Classes the data set has (None where the model's num_classes decides)."""
        return None

    def size(self, data: DataSpec, model: ModelSpec) -> DataSize:
        return DataSize(0, 0, 0, "your files, read as training goes")

    def columns(self, data: DataSpec, task: Task) -> dict[str, str] | None:
        """The columns it reads for `task`, by role (None for a data set made here)."""
        return None

    def folders(self) -> bool:
        """Whether its `train` and `test` paths are folders (not files)."""
        return False

    def details(self, data: DataSpec) -> str | None:
        """What a person reading the provenance should know of a data set made here."""
        return None


@dataclass(frozen=True)
class BuiltinKind(DataKind):
    """Made here, whole, by every worker: for the seeded models of one modality."""

    modality: str = "image"

    def problem(self, data: DataSpec) -> str | None:
        if problem := super().problem(data):
            return problem
        given = [f for f in SOURCE_FIELDS if getattr(data, f) is not None]
        if given or data.augment:
            return (
                f"data.{(given or ['augment'])[0]} is for dataset 'image-folder' or 'table' "
                f"(got {self.name!r}); remove it"
            )
        return None

    def model_problem(self, data: DataSpec, model: ModelSpec) -> str | None:
        if model.pretrained is not None:
            return (
                f"data.dataset {self.name!r} is built for the seeded models; a pretrained "
                "model reads your files through its own preprocessing: use 'image-folder' or "
                "'table'"
            )
        if model.family_info.modality != self.modality:
            return (
                f"data.dataset {self.name!r} is {self.modality_words} and needs model.family "
                f"{seeded_names(self.modality)} (got {model.family!r})"
            )
        return None

    @property
    def modality_words(self) -> str:
        return "images" if self.modality == "image" else "token sequences"


@dataclass(frozen=True)
class FilesKind(DataKind):
    """The user's files, for a pretrained model (read through its image processor or
    tokenizer, a row at a time, by `data.loader_workers` processes per rank)."""

    def problem(self, data: DataSpec) -> str | None:
        if problem := super().problem(data):
            return problem
        if data.path is not None:
            if data.train is not None or data.test is not None:
                return "give either data.path (a DatasetDict) or data.train and data.test, not both"
            return None
        if data.train is None or data.test is None:
            missing = "data.train" if data.train is None else "data.test"
            what = "folder" if self.folders() else "file(s)"
            return f"dataset {self.name!r} needs {missing} (the split's {what})"
        return None

    def model_problem(self, data: DataSpec, model: ModelSpec) -> str | None:
        if model.pretrained is None:
            return (
                f"data.dataset {self.name!r} reads your files through the model's own image "
                "processor or tokenizer and needs model.pretrained (a Hugging Face checkpoint)"
            )
        return None
