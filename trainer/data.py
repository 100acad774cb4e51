"""Data sets, loaded whole into memory (they are small): scikit-learn's bundled handwritten
digits, or seeded synthetic images for benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from orchestrator.spec import DataSpec, ModelSpec


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # float32, N x C x H x W
    labels: torch.Tensor  # int64, N

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class Dataset:
    train: Split
    test: Split


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


def load_dataset(data: DataSpec, model: ModelSpec) -> Dataset:
    if data.dataset == "digits":
        from sklearn.datasets import load_digits  # ships the data; nothing is downloaded

        if (model.image_size, model.channels, model.num_classes) != (8, 1, 10):
            raise ValueError(
                "dataset 'digits' is 8x8 grey images of 10 classes: set model.image_size=8, "
                "model.channels=1, model.num_classes=10"
            )
        raw = load_digits()
        images = (raw.images.astype(np.float32) / 16.0 - 0.5) / 0.5  # pixels 0..16 -> -1..1
        images = images[:, None, :, :]
        labels = raw.target.astype(np.int64)
    elif data.dataset == "synthetic":
        rng = np.random.default_rng(data.seed)
        n = data.synthetic_samples
        labels = rng.integers(0, model.num_classes, n).astype(np.int64)
        shape = (n, model.channels, model.image_size, model.image_size)
        # a learnable signal: class-dependent mean plus noise
        images = rng.standard_normal(shape).astype(np.float32) * 0.5
        images += (labels[:, None, None, None] / model.num_classes - 0.5).astype(np.float32)
    else:  # JobSpec validation makes this unreachable; keep the error explicit anyway
        raise ValueError(f"unknown dataset {data.dataset!r}")
    train_idx, test_idx = _stratified_split(labels, data.test_fraction, data.seed)

    def split(idx: np.ndarray) -> Split:
        return Split(torch.from_numpy(images[idx].copy()), torch.from_numpy(labels[idx].copy()))

    return Dataset(split(train_idx), split(test_idx))
