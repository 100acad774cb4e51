"""Packed sequences of a token cache as a torch Dataset, and a job's two splits.

`pack` lays out a token cache's documents (all, or a subset: a document-level split) as the
windows of `packing` and keeps those with at least one counted label, numbered 0 .. N-1 in
stream order: the stable sequence ids an elastic sampler hands out. The windows' starts and
counted labels are computed once, in one pass over the stream, and kept beside the tokens
(`cache`'s `packed-<digest>/`). `PackedSequences[i]` is (inputs int64 [2, T], labels int64
[T]) as `packing.pack_window` makes it; it reads T + 1 tokens from the memory maps, which a
DataLoader worker reopens after unpickling (the object pickles as paths and a few numbers).

Decisions: the tail (the stream's last tokens, fewer than T + 1) is kept as a last sequence,
padded with the tokenizer's pad token (EOS without one) and IGNORE labels, so every document's
tokens are trained on (chat data with few conversations loses none); a window with no counted
label (possible in chat data: a window inside a long user turn) is left out, so no sequence
costs a step without a loss. The loss is normalised by the counted labels of the whole global
batch, known without a collective: `counted_tokens(indices)`.

Held-out data (`open_lm_splits`): files of its own, tokenised into an entry of their own; or,
given only training files, a seeded, deterministic `test_fraction` of the documents
(`packing.split_documents`): whole documents, laid back to back in their own stream, read from
the one cache entry without copying."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset

from pipetransformer.trainer.sources import DataError
from pipetransformer.trainer.sources.lm.cache import (
    DEFAULT_CHUNK_ROWS,
    FORMAT,
    TokenCache,
    Verify,
    describe_files,
    entry,
    tokenize_files,
    write_meta,
)
from pipetransformer.trainer.sources.lm.encode import LMData
from pipetransformer.trainer.sources.lm.packing import (
    IGNORE,
    RangeReader,
    count_labels,
    pack_window,
    split_documents,
    stream_reader,
    subset_reader,
    subset_starts,
    window_range,
)
from pipetransformer.trainer.sources.lm.reading import Files, PathLike


class PackedSequences(TorchDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The packed sequences of a token cache (made by `pack`). `dataset[i]` is (inputs int64
    [2, T], labels int64 [T]); `i` may also be a (index, epoch, valid) key (the sources'
    `SampleKey`): an entry with valid False (the padding of an epoch's last batch) has every
    label IGNORE."""

    def __init__(
        self, cache: TokenCache, path: Path, meta: dict[str, Any], cross_document_attention: bool
    ) -> None:
        self.cache, self.path, self.meta = cache, path, meta
        self.cross_document_attention = cross_document_attention
        self.seq_len = cache.seq_len
        self.subset = bool(meta["subset"])
        self.stream_tokens = int(meta["stream_tokens"])
        self.num_documents = int(meta["documents"])
        self._arrays: dict[str, np.ndarray] = {}
        self._read: RangeReader | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrays"], state["_read"] = {}, None
        return state

    def _npy(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = np.load(self.path / name, mmap_mode="r")
        return self._arrays[name]

    @property
    def sequences(self) -> np.ndarray:
        """int64 [N]: the window each sequence is (`packing.window_range`)."""
        return self._npy("sequences.npy")

    @property
    def counted(self) -> np.ndarray:
        """int64 [N]: the labels each sequence counts (not IGNORE)."""
        return self._npy("counted.npy")

    @property
    def num_labels(self) -> int:
        """Counted labels over every sequence."""
        return int(self.meta["labels"])

    def counted_tokens(self, indices: Any, valid: Any = None) -> int:
        """The counted labels of the sequences `indices` (those where `valid`, if given): the
        denominator of a global batch's mean token loss."""
        idx = np.asarray(indices, dtype=np.int64)
        if valid is not None:
            idx = idx[np.asarray(valid, dtype=bool)]
        return int(np.asarray(self.counted[idx]).sum())

    def reader(self) -> RangeReader:
        """Ranges of this split's stream (tokens, document starts, mask)."""
        if self._read is None:
            c = self.cache
            if self.subset:
                self._read = subset_reader(
                    c.tokens, c.offsets, c.mask, self._npy("documents.npy"), self._npy("starts.npy")
                )
            else:
                self._read = stream_reader(c.tokens, c.offsets, c.mask)
        return self._read

    def __len__(self) -> int:
        return int(self.meta["sequences"])

    def __getitem__(self, key: Any) -> tuple[torch.Tensor, torch.Tensor]:
        valid = True
        if isinstance(key, tuple):
            index = int(key[0])
            valid = bool(key[2]) if len(key) > 2 else True
        else:
            index = int(key)
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} outside 0 .. {len(self) - 1}")
        a, b = window_range(int(self.sequences[index]), self.stream_tokens, self.seq_len)
        tokens, starts, mask = self.reader()(a, b)
        inputs, labels = pack_window(
            tokens, starts, mask, self.seq_len, self.cross_document_attention, self.cache.pad_id
        )
        if not valid:
            labels[:] = IGNORE
        return torch.from_numpy(inputs), torch.from_numpy(labels)

    def read(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, 2, T], labels [B, T]) of several sequences, read here."""
        pairs = [self[int(i)] for i in np.asarray(indices).reshape(-1)]
        if not pairs:
            t = self.seq_len
            return torch.zeros(0, 2, t, dtype=torch.int64), torch.zeros(0, t, dtype=torch.int64)
        return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


def _pack_key(cross: bool, seq_len: int, documents: np.ndarray | None) -> str:
    docs = "all" if documents is None else hashlib.sha256(documents.tobytes()).hexdigest()
    parts = {"format": FORMAT, "cross": cross, "seq_len": seq_len, "documents": docs}
    return "packed-" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def pack(
    cache: TokenCache,
    cross_document_attention: bool = False,
    documents: Any = None,
    verify: Verify = "full",
) -> PackedSequences:
    """The packed sequences of `cache`'s documents (`documents`: the indices of some, sorted,
    e.g. `packing.split_documents`'; None: all), computed once and kept in the cache entry.
    DataError when no sequence has a label to learn."""
    docs = None
    if documents is not None:
        docs = np.asarray(documents, dtype=np.int64)
        n = cache.num_documents
        if docs.ndim != 1 or not len(docs) or docs[0] < 0 or docs[-1] >= n:
            raise ValueError(f"documents must be indices in 0 .. {n - 1}")
        if np.any(np.diff(docs) <= 0):
            raise ValueError("documents must be sorted and distinct")
    t = cache.seq_len

    def build(out: Path) -> None:
        c = cache
        if docs is None:
            read, total = stream_reader(c.tokens, c.offsets, c.mask), c.num_tokens
        else:
            starts = subset_starts(c.offsets, docs)
            read, total = subset_reader(c.tokens, c.offsets, c.mask, docs, starts), int(starts[-1])
        counts = count_labels(read, total, t, cross_document_attention)
        keep = np.flatnonzero(counts > 0).astype(np.int64)
        if not len(keep):
            raise DataError(
                f"{', '.join(s['path'] for s in c.meta['sources'])}: no sequence has a token to "
                "learn"
            )
        names = ["sequences.npy", "counted.npy"]
        np.save(out / "sequences.npy", keep)
        np.save(out / "counted.npy", counts[keep].astype(np.int64))
        if docs is not None:
            np.save(out / "documents.npy", docs)
            np.save(out / "starts.npy", starts)
            names += ["documents.npy", "starts.npy"]
        write_meta(
            out,
            {
                "format": FORMAT,
                "cross_document_attention": cross_document_attention,
                "seq_len": t,
                "subset": docs is not None,
                "documents": c.num_documents if docs is None else len(docs),
                "stream_tokens": total,
                "sequences": len(keep),
                "labels": int(counts.sum()),
                "files": describe_files(out, names),
            },
        )

    path, meta = entry(cache.path, _pack_key(cross_document_attention, t, docs), build, verify)
    return PackedSequences(cache, path, meta, cross_document_attention)


def open_lm_splits(
    train: Files,
    tokenizer: PathLike,
    data: LMData,
    *,
    test: Files | None = None,
    test_fraction: float = 0.1,
    seed: int = 0,
    cross_document_attention: bool = False,
    cache_dir: PathLike | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    verify: Verify = "full",
) -> tuple[PackedSequences, PackedSequences]:
    """A causal language-modelling job's (training, held-out) sequences: `train` (and `test`,
    if given) tokenised through the tokenizer in the directory `tokenizer` (`tokenize_files`),
    packed (`pack`). Without `test`, the held-out split is `test_fraction` of the training
    files' documents, drawn with `seed` (`packing.split_documents`)."""
    options = {"cache_dir": cache_dir, "chunk_rows": chunk_rows, "verify": verify}
    corpus = tokenize_files(train, tokenizer, data, **options)  # type: ignore[arg-type]
    if test is not None:
        held = tokenize_files(test, tokenizer, data, **options)  # type: ignore[arg-type]
        return (
            pack(corpus, cross_document_attention, verify=verify),
            pack(held, cross_document_attention, verify=verify),
        )
    try:
        train_docs, test_docs = split_documents(corpus.num_documents, test_fraction, seed)
    except ValueError as exc:
        where = ", ".join(s["path"] for s in corpus.meta["sources"])
        raise DataError(f"{where}: {exc}; give the held-out split files of its own (test)") from exc
    return (
        pack(corpus, cross_document_attention, train_docs, verify),
        pack(corpus, cross_document_attention, test_docs, verify),
    )
