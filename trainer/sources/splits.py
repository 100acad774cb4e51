"""A job's data source opened as two splits for training (`data.dataset: image-folder | table`):
each a `SourceSplit`, rows decoded through the pretrained model's own image processor or
tokenizer when they are read, labels held whole (one int64 per row) for the last stage, which
needs no inputs. Everything is checked before the first step: columns, nulls, label range, the
class folders of both image splits, the tokenizer's vocabulary against the model's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import datasets
import numpy as np
import torch

from pipetransformer.core.spec import DataSpec, ModelSpec
from pipetransformer.core.tasks import CAUSAL_LM, QUESTION_ANSWERING
from pipetransformer.trainer.sources import DataError
from pipetransformer.trainer.sources.dataset import SourceDataset
from pipetransformer.trainer.sources.image_folder import (
    Augmentation,
    ImagePreprocessor,
    open_image_folder,
)
from pipetransformer.trainer.sources.qa import QASplit, qa_columns, qa_splits
from pipetransformer.trainer.sources.tabular import Columns, open_split, open_splits
from pipetransformer.trainer.sources.text import TextEncoder

if TYPE_CHECKING:
    from pipetransformer.trainer.sources.lm.split import LMSplit


@dataclass
class SourceSplit:
    """One split: rows read on demand (`dataset`), labels in memory."""

    dataset: SourceDataset
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def deterministic(self) -> bool:
        """Whether a row reads the same every time (no augmentation): AutoCache needs it."""
        return self.dataset.deterministic

    def read(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        """The inputs of some rows, read here (no loader processes)."""
        return torch.stack([s.inputs for s in self.dataset.__getitems__([int(i) for i in indices])])


def _labels(table: datasets.Dataset, column: str) -> torch.Tensor:
    if table._indices is None:  # the arrow column as it lies, without a Python list
        values = table.data.column(column).to_numpy()
    else:
        values = np.asarray(table[column])
    return torch.from_numpy(np.asarray(values, dtype=np.int64).copy())


def _image_folders(data: DataSpec, model: ModelSpec) -> tuple[datasets.Dataset, datasets.Dataset]:
    assert data.train is not None and data.test is not None
    train = open_image_folder(data.train[0])
    test = open_image_folder(data.test[0])
    names = train.features["label"].names
    if test.features["label"].names != names:
        raise DataError(
            f"the class folders of {data.test[0]} ({', '.join(test.features['label'].names)}) "
            f"differ from {data.train[0]}'s ({', '.join(names)}); labels are the sorted folder "
            "names, so both splits need the same folders"
        )
    if len(names) != model.num_classes:
        raise DataError(
            f"{data.train[0]} has {len(names)} class folders but model.num_classes is "
            f"{model.num_classes}; set model.num_classes: {len(names)}"
        )
    return train, test


def _tables(
    data: DataSpec, columns: Columns, num_labels: int | None = None
) -> list[tuple[str, datasets.Dataset]]:
    """The training and held-out tables of `data.dataset: table`, each checked
    (`trainer.sources.tabular`), with its split's name: from a DatasetDict (`data.path`) or from
    files (`data.train`, `data.test`)."""
    if data.path is not None:
        names = (data.train_split, data.test_split)
        splits = open_splits(data.path, columns, names, num_labels)
        return [(name, splits[name]) for name in names]
    assert data.train is not None and data.test is not None
    return [
        ("train", open_split(data.train, "train", columns, num_labels)),
        ("test", open_split(data.test, "test", columns, num_labels)),
    ]


def image_folder_splits(data: DataSpec, model: ModelSpec) -> tuple[SourceSplit, SourceSplit]:
    """`image-folder`: both class folders checked, images through the model's processor."""
    path = _pretrained_path(model)
    train, test = _image_folders(data, model)
    return _source_splits(data, model, path, Columns(image="image", label="label"), train, test)


def table_splits(
    data: DataSpec, model: ModelSpec
) -> tuple[SourceSplit, SourceSplit] | tuple[QASplit, QASplit] | tuple[LMSplit, LMSplit]:
    """`table`: the rows the job's task reads (`model.task`): question answering's windows
    (`trainer.sources.qa`), a language model's packed sequences (`trainer.sources.lm`), else an
    image or text column and a label."""
    path = _pretrained_path(model)
    if model.task == CAUSAL_LM.name:
        from pipetransformer.trainer.sources.lm.split import lm_splits

        return lm_splits(data, model, path)
    if model.task == QUESTION_ANSWERING.name:
        return qa_splits(_tables(data, qa_columns(data)), data, model)
    cols = data.columns
    columns = Columns(image=cols.image, text=cols.text, text_pair=cols.text_pair, label=cols.label)
    (_, train), (_, test) = _tables(data, columns, model.num_classes)
    return _source_splits(data, model, path, columns, train, test)


def _pretrained_path(model: ModelSpec) -> str:
    """The resolved checkpoint directory whose tokenizer or image processor reads the rows."""
    pre = model.pretrained
    if pre is None or pre.path is None:
        raise ValueError("a data source needs a resolved model.pretrained (submit the job)")
    return pre.path


def _source_splits(
    data: DataSpec,
    model: ModelSpec,
    path: str,
    columns: Columns,
    train: datasets.Dataset,
    test: datasets.Dataset,
) -> tuple[SourceSplit, SourceSplit]:
    """Two checked tables read through the tokenizer or image processor in `path` (the
    model's checkpoint)."""
    image = text = None
    if model.is_text:
        assert model.seq_len is not None
        text = TextEncoder(path, max_length=model.seq_len)
    else:
        image = ImagePreprocessor(path, backend=data.image_backend)
        if image.size != (model.image_size, model.image_size):
            raise DataError(
                f"the image processor in {path} makes {image.size[0]}x{image.size[1]} "
                f"images but the model takes {model.image_size}x{model.image_size}"
            )
    augment = Augmentation(seed=data.seed) if data.augment else None
    out = []
    for table, augmentation in ((train, augment), (test, None)):  # held-out: never augmented
        dataset = SourceDataset(table, columns, image=image, text=text, augmentation=augmentation)
        out.append(SourceSplit(dataset, _labels(table, columns.label or "label")))
    return out[0], out[1]
