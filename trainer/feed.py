"""The first stage's inputs, step by step. An in-memory split (the built-in data sets) is indexed;
a data source (`trainer.sources.splits.SourceSplit`) is read ahead by `torch.utils.data`
DataLoader workers in exactly the order the elastic sampler hands out, from where the job is:
a new reader starts at a re-layout (another replica count) or resume, from the cursor, so every
sample is still read exactly once per epoch; a training reader runs on across epoch ends (given
the job's `epochs`), an evaluation reader reads its one epoch. The loop receives a batch as one
shared-memory tensor (`trainer.sources.dataset.collate_samples`).

`wait_s` and `steps` count the time the training loop waited for inputs, for the stall
fraction (`bench/data_loading.py`)."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pipetransformer.core.sampler import Batch, ElasticSampler

Position = tuple[int, int, int, int]  # epoch, cursor, replicas, replica
PREFETCH = 4  # batches each loader process reads ahead


class Feed:
    """Inputs for the batches of one split as the sampler gives them to one replica."""

    def __init__(
        self,
        split: Any,
        sampler: ElasticSampler,
        workers: int = 0,
        pin_memory: bool = False,
        epochs: int | None = None,
    ) -> None:
        """`epochs` (training: the job's epoch count): a reader runs on from an epoch's end into
        the next epochs before `epochs` instead of starting anew (new loader processes, the first
        batches read while the loop waits) at each; None: a reader reads one epoch."""
        self.split, self.sampler = split, sampler
        self.workers, self.pin_memory = workers, pin_memory
        self.epochs = epochs
        self.streaming = hasattr(split, "dataset")  # a SourceSplit: rows are decoded
        self._reader: Iterator[Any] | None = None
        self._next: Position | None = None
        self.wait_s = 0.0
        self.steps = 0

    def inputs(
        self, epoch: int, cursor: int, replicas: int, replica: int, b: Batch
    ) -> torch.Tensor:
        """The inputs of batch `b`, which the sampler gave for (epoch, cursor, replicas, replica)."""
        if not self.streaming:
            return self.split.inputs[b.indices]
        t0 = time.perf_counter()
        if self._next != (epoch, cursor, replicas, replica):
            self._start(epoch, cursor, replicas, replica)
        assert self._reader is not None
        sample = next(self._reader)
        ids = np.asarray(sample.id)
        if not np.array_equal(ids, b.indices):  # a bug, never a data problem
            raise RuntimeError(
                f"the data reader is out of step with the sampler at epoch {epoch} cursor "
                f"{cursor}: read ids {ids[:4].tolist()}..., expected {b.indices[:4].tolist()}..."
            )
        self._next = (epoch, b.next_cursor, replicas, replica)
        if b.next_cursor >= self.sampler.num_samples and epoch + 1 < (self.epochs or 0):
            self._next = (epoch + 1, 0, replicas, replica)  # the reader runs on into it
        self.wait_s += time.perf_counter() - t0
        self.steps += 1
        return sample.inputs

    def _start(self, epoch: int, cursor: int, replicas: int, replica: int) -> None:
        from pipetransformer.trainer.sources.dataset import EpochBatches, elastic_loader

        self.close()
        end = max(self.epochs or 0, epoch + 1)
        batches = EpochBatches(self.sampler, epoch, cursor, replicas, replica, end)
        loader = elastic_loader(
            self.split.dataset,
            batches,
            num_workers=self.workers,
            pin_memory=self.pin_memory,
            prefetch_factor=PREFETCH if self.workers else None,
        )
        self._reader = _forked_reader(loader) if self.workers else iter(loader)

    def close(self) -> None:
        """Stop the reader's worker processes (a new one starts where it is next asked)."""
        reader, self._reader, self._next = self._reader, None, None
        if reader is not None and hasattr(reader, "_shutdown_workers"):
            reader._shutdown_workers()


def _forked_reader(loader: Any) -> Any:
    """`iter(loader)`, which forks its worker processes, with this process's objects kept out
    of the children's garbage collections: a forked child must never run a finalizer of an
    object it inherited (a gRPC channel's or stream's takes locks that another thread of this
    process held at the fork, and the child then waits on them forever: seen as a loader stuck
    in `futex_wait` under "Garbage-collecting"). The cycles already dead are collected here
    first; this process collects normally again once the children are forked."""
    gc.collect()
    gc.freeze()
    try:
        return iter(loader)
    finally:
        gc.unfreeze()
