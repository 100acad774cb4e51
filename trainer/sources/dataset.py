"""A torch `Dataset` over a memory-mapped `datasets.Dataset` (an image folder or a table) that
decodes one row when it is read: `dataset[i]` is `Sample(inputs, label, id=i)`, inputs a float
[3, H, W] image or an int64 [3, T] token tensor. Nothing is loaded whole; the object pickles
small (arrow tables pickle as their memory-mapped file paths), so a
`torch.utils.data.DataLoader(num_workers>0)` works.

`ElasticBatches` is the `batch_sampler` that lets `core.sampler.ElasticSampler` drive which rows
are read: from a cursor in an epoch, one replica's share of each global batch, step by step, so
after a change of replica count a new `ElasticBatches` from the returned cursor continues the
same epoch and every sample is read exactly once (docs/architecture.md, Invariants 6). Padding
entries of the last batch (the sampler repeats a real index) come back with label IGNORE."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import datasets
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data import Dataset as TorchDataset

from core.sampler import IGNORE, ElasticSampler
from trainer.sources import DataError
from trainer.sources.image_folder import Augmentation, ImagePreprocessor, decode_image
from trainer.sources.tabular import Columns
from trainer.sources.text import TextEncoder


class SampleKey(NamedTuple):
    """Which row to read, in which epoch (augmentation draws from it), and whether it is real."""

    index: int
    epoch: int = 0
    valid: bool = True


class Sample(NamedTuple):
    inputs: torch.Tensor
    label: int  # IGNORE for padding entries and unlabelled rows
    id: int  # the row index: the sample id the elastic sampler hands out


class SourceDataset(TorchDataset[Sample]):
    """Rows of `table` as samples. An image source needs `image` (the model's preprocessing) and
    `columns.image`; a text source needs `text` (the model's tokenizer) and `columns.text`
    (and `columns.text_pair` for sentence pairs). `augmentation` (images only) makes the source
    non-`deterministic`: the same id reads differently in different epochs."""

    def __init__(
        self,
        table: datasets.Dataset,
        columns: Columns,
        image: ImagePreprocessor | None = None,
        text: TextEncoder | None = None,
        augmentation: Augmentation | None = None,
    ) -> None:
        if (image is None) == (text is None):
            raise ValueError("give exactly one of image (preprocessing) and text (tokenizer)")
        if image is not None and columns.image is None:
            raise ValueError("an image source needs columns.image")
        if text is not None and columns.text is None:
            raise ValueError("a text source needs columns.text")
        if augmentation is not None and image is None:
            raise ValueError("augmentation is for image sources")
        if augmentation is not None and not image.do_resize:  # type: ignore[union-attr]
            raise ValueError("augmentation crops at random sizes and needs do_resize")
        missing = [c for c in columns.required() if c not in table.column_names]
        if missing:
            raise DataError(f"the table has no column(s) {', '.join(missing)}")
        table = table.select_columns(columns.required())
        if columns.image is not None and isinstance(
            table.features[columns.image], datasets.Image
        ):  # decode here, so a bad file raises DataError naming it
            table = table.cast_column(columns.image, datasets.Image(decode=False))
        self.table = table
        self.columns = columns
        self.image = image
        self.text = text
        self.augmentation = augmentation
        self.epoch = 0  # for plain integer keys; SampleKey carries its own

    @property
    def deterministic(self) -> bool:
        return self.augmentation is None

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, key: int | SampleKey) -> Sample:
        if isinstance(key, tuple):
            index, epoch, valid = SampleKey(*key)
        else:
            index, epoch, valid = int(key), self.epoch, True
        row = self.table[int(index)]
        c = self.columns
        if self.image is not None:
            picture = decode_image(row[c.image])
            if self.augmentation is not None:
                picture = self.augmentation(picture, epoch, index)
            inputs = self.image(picture)
        else:
            assert self.text is not None
            inputs = self.text.encode(row[c.text], row[c.text_pair] if c.text_pair else None)
        label = int(row[c.label]) if c.label is not None and valid else IGNORE
        return Sample(inputs, label, int(index))


class ElasticBatches(Sampler[list[SampleKey]]):
    """One replica's batches of an epoch from `cursor`, as `ElasticSampler` splits them among
    `replicas`; `steps` limits how many (None: to the end of the epoch). `end_cursor` is where
    the next `ElasticBatches` (perhaps for another replica count) continues."""

    def __init__(
        self,
        sampler: ElasticSampler,
        epoch: int,
        cursor: int,
        replicas: int,
        replica: int,
        steps: int | None = None,
    ) -> None:
        sampler.batch(epoch, cursor, replicas, replica)  # validates the arguments
        self.sampler, self.epoch, self.cursor = sampler, epoch, cursor
        self.replicas, self.replica = replicas, replica
        left = -(-(sampler.num_samples - cursor) // sampler.global_batch)
        self.steps = left if steps is None else min(steps, left)

    @property
    def end_cursor(self) -> int:
        return min(self.cursor + self.steps * self.sampler.global_batch, self.sampler.num_samples)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[SampleKey]]:
        cursor = self.cursor
        for _ in range(self.steps):
            b = self.sampler.batch(self.epoch, cursor, self.replicas, self.replica)
            yield [
                SampleKey(int(i), self.epoch, bool(v))
                for i, v in zip(b.indices, b.valid, strict=True)
            ]
            cursor = b.next_cursor


def elastic_loader(
    dataset: SourceDataset, batches: ElasticBatches, num_workers: int = 0, **kwargs: object
) -> DataLoader:
    """A DataLoader reading `dataset` in the order `batches` gives; checks the sizes agree."""
    if batches.sampler.num_samples != len(dataset):
        raise ValueError(
            f"the sampler has {batches.sampler.num_samples} samples but the data set {len(dataset)}"
        )
    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers, **kwargs)  # type: ignore[arg-type]
