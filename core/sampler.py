"""Elastic sampler: a seeded global order per epoch and a cursor of samples consumed.

The next global batch is always `order[cursor : cursor + global_batch]`, split contiguously among
however many replicas there are *now*, so a change of replica count mid-epoch re-splits the rest
of the epoch and every sample is still seen exactly once. The last batch of an epoch is padded to
the full batch shape with masked entries (label -1 weight 0), keeping pipeline shapes static.
Pure and deterministic."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IGNORE = -100  # label of padding entries; cross_entropy(ignore_index=IGNORE) skips them


@dataclass(frozen=True)
class Batch:
    indices: np.ndarray  # sample indices for this replica (padding entries repeat a real index)
    valid: np.ndarray  # bool mask: False for padding
    global_valid: int  # real samples in the whole global batch
    next_cursor: int
    # what the loss of the global batch is divided by: its real samples, or with per-sample
    # weights (a language model's counted tokens per sequence) their sum
    loss_count: int = 0


@dataclass(frozen=True)
class ElasticSampler:
    num_samples: int
    global_batch: int
    seed: int
    # int [num_samples]: what each sample counts in the loss denominator (None: 1 each)
    weights: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_samples <= 0 or self.global_batch <= 0:
            raise ValueError("num_samples and global_batch must be positive")
        if self.weights is not None and len(self.weights) != self.num_samples:
            raise ValueError(f"{len(self.weights)} sample weights for {self.num_samples} samples")

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def steps_per_epoch(self) -> int:
        return -(-self.num_samples // self.global_batch)

    def batch(self, epoch: int, cursor: int, replicas: int, replica: int) -> Batch:
        """The slice of the global batch starting at `cursor` that `replica` of `replicas` runs."""
        if not 0 <= cursor < self.num_samples:
            raise ValueError(f"cursor {cursor} outside epoch of {self.num_samples} samples")
        if self.global_batch % replicas or not 0 <= replica < replicas:
            raise ValueError(
                f"cannot split a batch of {self.global_batch} into {replicas} replicas"
            )
        real = self.order(epoch)[cursor : cursor + self.global_batch]
        n_real = len(real)
        padded = np.resize(real, self.global_batch)  # repeats real indices as placeholders
        valid = np.arange(self.global_batch) < n_real
        per = self.global_batch // replicas
        sl = slice(replica * per, (replica + 1) * per)
        count = n_real if self.weights is None else int(np.asarray(self.weights)[real].sum())
        return Batch(padded[sl], valid[sl], n_real, cursor + n_real, count)
