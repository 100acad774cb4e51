"""Data sets. Built in, loaded whole into memory (they are small): scikit-learn's bundled
handwritten digits, seeded synthetic images for benchmarks (both for the ViT), and a seeded
synthetic sequence-classification task for the BERT-style encoder. Nothing is downloaded. A
user's files (`data.dataset: image-folder | table`) open as `trainer.sources.splits`, read a row
at a time. Which function opens a job's data is its kind's (`pipetransformer.core.datasets`)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from pipetransformer.core.spec import DataSpec, ModelSpec
from pipetransformer.trainer.sources import cache_root


@dataclass(frozen=True)
class Split:
    inputs: torch.Tensor  # vit: float32 N x C x H x W images; bert: int64 N x seq_len token ids
    labels: torch.Tensor  # int64, N

    deterministic = True  # a sample's inputs are the same every epoch (AutoCache may keep them)

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, indices: np.ndarray) -> torch.Tensor:
        return self.inputs[indices]


@dataclass(frozen=True)
class Dataset:
    train: Any  # a Split, or a data source's trainer.sources.splits.SourceSplit (same surface)
    test: Any


def onto_device(data: Dataset, device: torch.device, free_bytes: int) -> Dataset:
    """The built-in in-memory splits with their inputs in the GPU's memory when together they
    take at most an eighth of `free_bytes`: a batch is then a gather on the device instead of a
    host gather, a pinning copy and a transfer in the step's critical path (a ViT-B/16 batch of
    256 images is 154 MB). Labels stay on the host (the sampler's bookkeeping reads them); data
    sources, read ahead by loader processes, stay as they are."""
    splits = [data.train, data.test]
    if device.type != "cuda" or not all(isinstance(s, Split) for s in splits):
        return data
    if sum(s.inputs.numel() * s.inputs.element_size() for s in splits) > free_bytes // 8:
        return data
    moved = [replace(s, inputs=s.inputs.to(device)) for s in splits]
    return Dataset(train=moved[0], test=moved[1])


def _stratified_split(labels: np.ndarray, test_fraction: float, seed: int):
    """Deterministic per-class split, so the held-out set has every class in proportion."""
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        test_idx.extend(idx[: max(1, round(len(idx) * test_fraction))])
    test = np.zeros(len(labels), dtype=bool)
    test[np.asarray(test_idx)] = True
    return np.flatnonzero(~test), np.flatnonzero(test)


def synthetic_text(
    n: int, num_classes: int, vocab_size: int, seq_len: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """`n` token sequences (int64, n x seq_len) and their labels (int64, n).

    Ids 0 .. num_classes-1 are keywords, the rest filler. A sequence of class c holds keyword c
    `m` times (2 <= m, as many as fit) and every other keyword fewer than `m` times, at random
    positions among uniform filler tokens; so the label is the keyword that occurs most often,
    a strict majority a small encoder learns by attending from CLS to the keywords."""
    k = num_classes
    if k < 2 or vocab_size <= k or seq_len < 2 * k:
        raise ValueError(
            f"synthetic text needs num_classes >= 2, vocab_size > num_classes and "
            f"seq_len >= 2 x num_classes (got {k}, {vocab_size}, {seq_len})"
        )
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n).astype(np.int64)
    # the most a label keyword may occur with every other keyword below it still fitting
    m_max = (seq_len + k - 1) // k
    m = rng.integers(2, m_max + 1, n)
    counts = (rng.random((n, k)) * m[:, None]).astype(np.int64)  # others: 0 .. m-1
    counts[np.arange(n), labels] = m
    ids = rng.integers(k, vocab_size, (n, seq_len)).astype(np.int64)  # filler everywhere
    for i in range(n):
        keywords = np.repeat(np.arange(k, dtype=np.int64), counts[i])
        ids[i, rng.permutation(seq_len)[: len(keywords)]] = keywords
    return ids, labels


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (nothing is downloaded), kept as an .npz under
    `$PIPETRANSFORMER_CACHE` (default ~/.cache/pipetransformer): importing scikit-learn and
    parsing its CSV takes ~2 s, which every worker of a re-formed generation would pay again."""
    version = importlib.metadata.version("scikit-learn")
    path = cache_root() / "data" / f"digits-sklearn-{version}.npz"
    try:
        with np.load(path, allow_pickle=False) as cached:
            return cached["images"], cached["target"]
    except (OSError, KeyError, ValueError):
        pass  # absent or unreadable: build it again
    from sklearn.datasets import load_digits

    raw = load_digits()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, images=raw.images, target=raw.target)
        os.replace(tmp, path)  # atomic: concurrent workers never read a half-written file
    except OSError:
        pass  # a read-only cache only costs the time
    return raw.images, raw.target


def load_dataset(data: DataSpec, model: ModelSpec) -> Dataset:
    """The job's two splits, opened by the function its kind of data names
    (`pipetransformer.core.datasets`, `DataKind.opens`)."""
    problem = data.model_problem(model)
    if problem:
        raise ValueError(problem)
    module, _, function = data.kind.opens.partition(":")
    # a user's files need the `hf` extra's libraries: imported only for a job that reads them
    train, test = getattr(importlib.import_module(module), function)(data, model)
    return Dataset(train, test)


def digits(data: DataSpec, model: ModelSpec) -> tuple[Split, Split]:
    """`digits`: pixels 0..16 scaled to -1..1, the kept classes relabelled (data.classes)."""
    images, labels = _digits()
    inputs = (images.astype(np.float32) / 16.0 - 0.5) / 0.5  # pixels 0..16 -> -1..1
    return _split(data, inputs[:, None, :, :], labels.astype(np.int64))


def synthetic_images(data: DataSpec, model: ModelSpec) -> tuple[Split, Split]:
    """`synthetic`: images of the model's shape, a class-dependent mean plus noise."""
    rng = np.random.default_rng(data.seed)
    n = data.synthetic_samples
    labels = rng.integers(0, model.num_classes, n).astype(np.int64)
    shape = (n, model.channels, model.image_size, model.image_size)
    # a learnable signal: class-dependent mean plus noise, drawn in float32 in place (a
    # ViT-B/16 benchmark's 8,192 images are 4.9 GB: float64 draws took ~25 s of its start-up)
    inputs = rng.standard_normal(shape, dtype=np.float32)
    inputs *= 0.5
    inputs += (labels[:, None, None, None] / model.num_classes - 0.5).astype(np.float32)
    return _split(data, inputs, labels)


def synthetic_sequences(data: DataSpec, model: ModelSpec) -> tuple[Split, Split]:
    """`synthetic-text`: token sequences labelled by their most frequent keyword."""
    inputs, labels = synthetic_text(
        data.synthetic_samples, model.num_classes, model.vocab_size, model.seq_len, data.seed
    )
    return _split(data, inputs, labels)


def _split(data: DataSpec, inputs: np.ndarray, labels: np.ndarray) -> tuple[Split, Split]:
    """A built-in data set's stratified held-out split (then digits' class filter)."""
    train_idx, test_idx = _stratified_split(labels, data.test_fraction, data.seed)
    if data.classes is not None:
        # split first, then filter: the held-out images of a digit are the same whichever
        # digits a job keeps, so a pretraining job never sees a fine-tuning job's test set
        keep = np.asarray(data.classes)
        train_idx = train_idx[np.isin(labels[train_idx], keep)]
        test_idx = test_idx[np.isin(labels[test_idx], keep)]
        relabel = np.full(10, -1, dtype=np.int64)
        relabel[keep] = np.arange(len(keep))
        labels = relabel[labels]

    def split(idx: np.ndarray) -> Split:
        return Split(torch.from_numpy(inputs[idx].copy()), torch.from_numpy(labels[idx].copy()))

    return split(train_idx), split(test_idx)
