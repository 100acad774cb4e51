"""A causal-lm job's data as the training loop reads a split (`data.dataset: table` with
`model.task: causal-lm`): `LMSplit`, the surface of `trainer.sources.splits.SourceSplit` over
packed sequences.

- `dataset[key]` is a `Sample` (inputs int64 [2, T]: token ids and document starts; no label,
  the id): the first stage's loader reads it as it reads any source's rows;
- `labels[indices]` is int64 [B, T] (the next tokens, IGNORE where nothing is learnt), read
  from the memory-mapped tokens by the last stage, which holds no label array: a corpus'
  labels are its tokens again;
- `tokens` is each sequence's count of labels that count: the sampler sums those of a global
  batch for the loss denominator (the mean over the batch's tokens, not of its sequences'
  means), known on every rank without a collective.

The sequences are tokenised once and cached by content (`trainer.sources.lm`); every rank opens
the same cache entry (the first builds it under a lock, the others wait for it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset

from pipetransformer.core.spec import DataSpec, ModelSpec
from pipetransformer.trainer.sources import DataError
from pipetransformer.trainer.sources.dataset import Sample, SampleKey
from pipetransformer.trainer.sources.lm.dataset import PackedSequences, open_lm_splits
from pipetransformer.trainer.sources.lm.encode import LMData
from pipetransformer.trainer.sources.lm.packing import IGNORE


class LMSamples(TorchDataset[Sample]):
    """Packed sequences as samples: `Sample(inputs [2, T], IGNORE, id)`."""

    deterministic = True  # a sequence reads the same every epoch: AutoCache may keep it

    def __init__(self, packed: PackedSequences) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, key: int | SampleKey) -> Sample:
        index = int(key.index if isinstance(key, SampleKey) else key)
        inputs, _ = self.packed[index]
        return Sample(inputs, IGNORE, index)

    def __getitems__(self, keys: list[int | SampleKey]) -> list[Sample]:
        return [self[k] for k in keys]


class TokenLabels:
    """`labels[indices]`: the sequences' labels, int64 [B, T], read from the memory maps."""

    def __init__(self, packed: PackedSequences) -> None:
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, indices: Any) -> torch.Tensor:
        return self.packed.read(np.asarray(indices).reshape(-1))[1]


@dataclass
class LMSplit:
    """One split of packed sequences (see the module docstring)."""

    packed: PackedSequences

    def __post_init__(self) -> None:
        self.dataset = LMSamples(self.packed)
        self.labels = TokenLabels(self.packed)

    def __len__(self) -> int:
        return len(self.packed)

    deterministic = True

    @property
    def tokens(self) -> np.ndarray:
        """int64 [N]: the labels that count in each sequence."""
        return np.asarray(self.packed.counted)

    @property
    def num_examples(self) -> int:
        """The rows (documents, conversations) packed into the split's sequences."""
        return self.packed.num_documents

    @property
    def num_labels(self) -> int:
        """The labels that count over the whole split (its held-out loss' denominator)."""
        return self.packed.num_labels

    def read(self, indices: np.ndarray | list[int]) -> torch.Tensor:
        """The inputs of some sequences, read here (no loader processes)."""
        return self.packed.read(np.asarray(indices).reshape(-1))[0]


def lm_splits(data: DataSpec, model: ModelSpec, checkpoint: str) -> tuple[LMSplit, LMSplit]:
    """`table` read for `causal-lm`: `data.train` / `data.test` (or `data.path`'s
    `train_split` / `test_split` directories), plain text (`data.columns.text`, default
    "text") or conversations (`data.columns.messages`), through the tokenizer in `checkpoint`,
    packed into `model.seq_len` tokens."""
    assert model.seq_len is not None
    cols = data.columns
    lm = LMData(
        seq_len=model.seq_len,
        mode="chat" if cols.messages is not None else "text",
        column=cols.messages or cols.text or "text",
    )
    if data.path is not None:
        train: Any = Path(data.path) / data.train_split
        test: Any = Path(data.path) / data.test_split
    else:
        train, test = data.train, data.test
    # every rank opens the entry at every generation's start: its files are checked by size
    # (entries are renamed into place whole; a truncated file would fault a memory map), not
    # hashed again, which would read the whole token file on each rank each time
    first, held = open_lm_splits(
        train,
        checkpoint,
        lm,
        test=test,
        cross_document_attention=data.cross_document_attention,
        verify="size",
    )
    vocab = int(first.cache.meta["vocab"])
    if model.vocab_size is not None and vocab > model.vocab_size:
        raise DataError(
            f"the tokenizer in {checkpoint} has {vocab} tokens but the model's vocab_size is "
            f"{model.vocab_size}; use the tokenizer the model was trained with"
        )
    return LMSplit(first), LMSplit(held)
