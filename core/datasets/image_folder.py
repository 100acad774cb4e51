"""`image-folder`: the user's images, `data.train` and `data.test` each one folder of
`<class>/<image>` files (jpg, png; labels are the sorted class folder names), read through the
pretrained model's own image processor (`pipetransformer.trainer.sources.image_folder`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetransformer.core.datasets.base import FilesKind

if TYPE_CHECKING:
    from pipetransformer.core.spec import DataSpec, ModelSpec
    from pipetransformer.core.tasks import Task

COLUMNS = {"image": "image", "label": "label"}  # fixed: the image file and its folder


@dataclass(frozen=True)
class ImageFolder(FilesKind):
    def folders(self) -> bool:
        return True

    def problem(self, data: DataSpec) -> str | None:
        if data.path is not None:
            return "data.path (a DatasetDict) is for dataset 'table'"
        if problem := super().problem(data):
            return problem
        if len(data.train or []) > 1 or len(data.test or []) > 1:
            return "an image folder split is one folder: give one path for data.train and data.test"
        return None

    def model_problem(self, data: DataSpec, model: ModelSpec) -> str | None:
        from pipetransformer.core.spec import ColumnsSpec
        from pipetransformer.core.tasks import task_of

        if problem := super().model_problem(data, model):
            return problem
        if model.pending:
            return None  # the family is known once the checkpoint is read
        if task_of(model).fixed_outputs is not None:
            return "question answering reads a table of SQuAD-style rows: data.dataset 'table'"
        if data.doc_stride is not None:
            return "data.doc_stride is for question answering (model.task); remove it"
        if model.is_text:
            return f"data.dataset 'image-folder' is images; model.family is {model.family!r}"
        if data.columns != ColumnsSpec():
            return "an image folder's columns are fixed (image, label); remove data.columns"
        return None

    def columns(self, data: DataSpec, task: Task) -> dict[str, str] | None:
        return dict(COLUMNS)


IMAGE_FOLDER = ImageFolder(
    "image-folder", files=True, opens="pipetransformer.trainer.sources.splits:image_folder_splits"
)
