"""A torch `Dataset` over a memory-mapped `datasets.Dataset` (an image folder or a table) that
decodes one row when it is read: `dataset[i]` is `Sample(inputs, label, id=i)`, inputs a float
[3, H, W] image or an int64 [3, T] token tensor. Nothing is loaded whole; the object pickles
small (arrow tables pickle as their memory-mapped file paths), so a
`torch.utils.data.DataLoader(num_workers>0)` works.

`ElasticBatches` is the `batch_sampler` that lets `core.sampler.ElasticSampler` drive which rows
are read: from a cursor in an epoch, one replica's share of each global batch, step by step, so
after a change of replica count a new `ElasticBatches` from the returned cursor continues the
same epoch and every sample is read exactly once (docs/architecture.md, Invariants 6). Padding
entries of the last batch (the sampler repeats a real index) come back with label IGNORE.
`EpochBatches` runs on through the following epochs, so a training reader need not restart at
each epoch. A loader reads a batch's rows together (`SourceDataset.__getitems__`: one arrow read
and one image-processor call per 32 rows) and hands it over as `collate_samples` makes it: one shared-memory
tensor of inputs, labels and ids inline."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import datasets
import numpy as np
import torch
from PIL import Image as PILImage
from torch.utils.data import DataLoader, Sampler, default_collate
from torch.utils.data import Dataset as TorchDataset

from pipetransformer.core.sampler import IGNORE, ElasticSampler
from pipetransformer.edge import proctitle
from pipetransformer.trainer.sources import DataError
from pipetransformer.trainer.sources.image_folder import (
    Augmentation,
    ImagePreprocessor,
    decode_image,
)
from pipetransformer.trainer.sources.tabular import Columns
from pipetransformer.trainer.sources.text import TextEncoder

ROWS_PER_READ = 32  # rows read from arrow, and images preprocessed, at once
DECODED_BYTES_PER_CALL = 64 << 20  # decoded pixels held at most before the processor runs


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

    def _key(self, key: int | SampleKey) -> SampleKey:
        if isinstance(key, tuple):
            index, epoch, valid = SampleKey(*key)
            return SampleKey(int(index), epoch, valid)
        return SampleKey(int(key), self.epoch, True)

    def __getitem__(self, key: int | SampleKey) -> Sample:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[int | SampleKey]) -> list[Sample]:
        """The samples of several rows (a DataLoader worker fetches a whole batch through this),
        read `ROWS_PER_READ` rows at a time: one arrow read of them and one call of the model's
        image processor (per-row reads and processor calls cost twice the time,
        bench/data_loading.py); the processor runs sooner when the decoded images reach
        `DECODED_BYTES_PER_CALL`, so large photographs are not all held at once."""
        parsed = [self._key(k) for k in keys]
        out: list[Sample] = []
        for start in range(0, len(parsed), ROWS_PER_READ):
            out.extend(self._read(parsed[start : start + ROWS_PER_READ]))
        return out

    def _read(self, keys: list[SampleKey]) -> list[Sample]:
        rows = self.table[[k.index for k in keys]]  # column -> values, in the keys' order
        c = self.columns
        if self.image is not None:
            inputs = self._images(rows[c.image], keys)
        else:
            assert self.text is not None
            pairs = rows[c.text_pair] if c.text_pair else [None] * len(keys)
            inputs = [self.text.encode(t, p) for t, p in zip(rows[c.text], pairs, strict=True)]
        labels = rows[c.label] if c.label is not None else [IGNORE] * len(keys)
        return [
            Sample(x, int(y) if k.valid and c.label is not None else IGNORE, k.index)
            for x, y, k in zip(inputs, labels, keys, strict=True)
        ]

    def _images(self, values: list[object], keys: list[SampleKey]) -> list[torch.Tensor]:
        assert self.image is not None
        inputs: list[torch.Tensor] = []
        group: list[PILImage.Image] = []
        held = 0
        for value, k in zip(values, keys, strict=True):
            try:
                picture = decode_image(value)
            except DataError as exc:
                raise DataError(f"{exc} (row {k.index})") from exc
            if self.augmentation is not None:
                picture = self.augmentation(picture, k.epoch, k.index)
            group.append(picture)
            held += picture.width * picture.height * 3
            if held >= DECODED_BYTES_PER_CALL:
                inputs.extend(self.image.batch(group))
                group, held = [], 0
        if group:
            inputs.extend(self.image.batch(group))
        return inputs


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


class EpochBatches(Sampler[list[SampleKey]]):
    """One replica's batches of `epoch` from `cursor` (`ElasticBatches`), then of each following
    epoch before `end_epoch` from its start: a reader that carries on across an epoch's end, so
    its loader processes start (and read their first batches) once, not at every epoch."""

    def __init__(
        self,
        sampler: ElasticSampler,
        epoch: int,
        cursor: int,
        replicas: int,
        replica: int,
        end_epoch: int,
    ) -> None:
        self.first = ElasticBatches(sampler, epoch, cursor, replicas, replica)  # validates
        self.sampler, self.epoch, self.end_epoch = sampler, epoch, max(end_epoch, epoch + 1)
        self.replicas, self.replica = replicas, replica

    def __len__(self) -> int:
        return len(self.first) + (self.end_epoch - self.epoch - 1) * self.sampler.steps_per_epoch()

    def __iter__(self) -> Iterator[list[SampleKey]]:
        yield from self.first
        for e in range(self.epoch + 1, self.end_epoch):  # made when reached: nothing up front
            yield from ElasticBatches(self.sampler, e, 0, self.replicas, self.replica)


def collate_samples(samples: list[Sample]) -> Sample:
    """A batch as one `Sample`: the inputs stacked (into shared memory in a loader process), the
    labels and ids as int64 numpy arrays. Those travel inside the pickled batch: as tensors each
    would be one more shared-memory segment whose file descriptor the training process fetches
    over its own authenticated connection to the loader process, milliseconds apiece on a busy
    machine, paid while the training loop waits (bench/data_loading.py)."""
    return Sample(
        default_collate([s.inputs for s in samples]),
        np.fromiter((s.label for s in samples), np.int64, len(samples)),  # type: ignore[arg-type]
        np.fromiter((s.id for s in samples), np.int64, len(samples)),  # type: ignore[arg-type]
    )


def elastic_loader(
    dataset: SourceDataset,
    batches: ElasticBatches | EpochBatches,
    num_workers: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """A DataLoader reading `dataset` in the order `batches` gives (batches as
    `collate_samples` makes them, unless `collate_fn` says otherwise); checks the sizes agree.
    Its loader processes are titled as their worker's loaders (edge/proctitle.py)."""
    if batches.sampler.num_samples != len(dataset):
        raise ValueError(
            f"the sampler has {batches.sampler.num_samples} samples but the data set {len(dataset)}"
        )
    kwargs.setdefault("collate_fn", collate_samples)
    kwargs.setdefault("worker_init_fn", proctitle.title_loader)
    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers, **kwargs)
