"""Policy `output` (core/freeze.py): what each block computes, read on a fixed probe batch.

At the start of a run (a start, resume or recovery) and at every decision point, every rank runs
the probe batch through its replica's pipeline, forward only, and keeps a sketch of each block's
output; the change of a block's sketch between two probes, per unit of learning rate spent in
between, is its output rate (`core.freeze.output_rate`).

The probe batch is the first global batch of the held-out rows in the evaluation's order (at most
`PROBE_ROWS` of them): replica r of R runs rows [r G/R, (r+1) G/R) of it, as evaluation does, so
the rows and their places in the sketch are the same whatever the layout, and the reference taken
under one layout compares with a probe under the next. Every (block, row) is computed by exactly
one rank, so one all-reduce (a sum) over the control group gives every rank the whole sketch.

A sketch keeps `SKETCH_TOKENS` evenly spaced positions of each row and projects each position's
hidden state onto `SKETCH_WIDTH` fixed random directions (Johnson-Lindenstrauss: norms and
distances are kept to a few per cent over the thousand-odd positions a probe holds), so the probe
costs one forward pass of one batch and a collective of about a hundred thousand numbers per
decision point, whatever the model's width. Not checkpointed: a restarted run probes again at its
first step, and its first interval counts the learning rate from there."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipetransformer.core.freeze import output_rate
from pipetransformer.core.sampler import Batch, ElasticSampler
from pipetransformer.core.state import Layout
from pipetransformer.trainer.feed import Feed
from pipetransformer.trainer.pipeline import RankPipeline

PROBE_ROWS = 64
SKETCH_TOKENS = 16
SKETCH_WIDTH = 16


def sketch(hidden: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """A block's output [B, S, H] (or [B, H]) as [B, min(S, SKETCH_TOKENS), SKETCH_WIDTH]:
    evenly spaced positions, each projected onto the columns of `projection` [H, k]."""
    h = hidden.detach().float()
    if h.dim() == 2:
        h = h.unsqueeze(1)
    keep = torch.linspace(0, h.shape[1] - 1, min(h.shape[1], SKETCH_TOKENS)).round().long()
    return h[:, keep.to(h.device)] @ projection.to(h.device)


def projection(width: int, seed: int = 0) -> torch.Tensor:
    """The fixed random directions [width, SKETCH_WIDTH] (the same on every rank and run)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(width, SKETCH_WIDTH, generator=gen) / math.sqrt(SKETCH_WIDTH)


def block_changes(current: torch.Tensor, reference: torch.Tensor) -> list[tuple[float, float]]:
    """Per block (dim 0): (||current - reference||, ||reference||) over the whole sketch."""
    diff = (current.double() - reference.double()).flatten(1).norm(dim=1)
    ref = reference.double().flatten(1).norm(dim=1)
    return list(zip(diff.tolist(), ref.tolist(), strict=True))


class OutputProbe:
    """The probe's memory on one rank: the last sketch (the reference) and the learning rate
    spent since it was taken. `targets(pipe, b)` gives the last stage its batch's targets (the
    pipeline's schedule evaluates its loss too)."""

    def __init__(
        self,
        test: Any,
        global_batch: int,
        num_blocks: int,
        width: int,
        tokens: int,
        targets: Callable[[RankPipeline, Batch], torch.Tensor | None],
    ) -> None:
        self.test, self.num_blocks, self.targets = test, num_blocks, targets
        self.sampler = ElasticSampler(len(test), global_batch, seed=0)
        self.rows = min(global_batch, PROBE_ROWS)
        self.shape = (num_blocks, self.rows, min(tokens, SKETCH_TOKENS), SKETCH_WIDTH)
        self.projection = projection(width)
        self.reference: torch.Tensor | None = None
        self.lr_sum = 0.0
        self.seconds = 0.0  # the last probe's cost (forward, sketches and the all-reduce)

    def add_lr(self, lr: float) -> None:
        """One optimizer step at learning rate `lr` since the reference."""
        self.lr_sum += lr

    def start(self, pipe: RankPipeline, layout: Layout, replica: int) -> None:
        """Take the reference if there is none (collective): the start of a run."""
        if self.reference is None:
            self.reference, self.lr_sum = self.measure(pipe, layout, replica), 0.0

    def rates(self, pipe: RankPipeline, layout: Layout, replica: int) -> list[float]:
        """A decision point (collective): each block's output rate since the reference (NaN
        where unknown), and the probe just taken becomes the reference."""
        current = self.measure(pipe, layout, replica)
        if self.reference is None:
            out = [math.nan] * self.num_blocks
        else:
            changes = block_changes(current, self.reference)
            out = [output_rate(d, r, self.lr_sum) for d, r in changes]
        self.reference, self.lr_sum = current, 0.0
        return out

    def measure(self, pipe: RankPipeline, layout: Layout, replica: int) -> torch.Tensor:
        """The whole probe's sketch, [blocks, rows, tokens, k], on every rank (collective over
        the control group: every rank runs its replica's part of the probe batch)."""
        t0 = time.perf_counter()
        per = self.sampler.global_batch // layout.replicas
        b = self.sampler.batch(0, 0, layout.replicas, replica)
        inputs = None
        if pipe.is_first:
            feed = Feed(self.test, self.sampler)
            try:
                inputs = feed.inputs(0, 0, layout.replicas, replica, b)
            finally:
                feed.close()
        captured: dict[int, list[torch.Tensor]] = {}
        hooks = []
        for name, module in pipe.model.units().items():
            if name.startswith("blocks."):
                i = int(name.split(".")[1])

                def hook(_m: Any, _args: Any, out: Any, i: int = i) -> None:
                    captured.setdefault(i, []).append(sketch(out, self.projection).cpu())

                hooks.append(module.register_forward_hook(hook))
        try:
            pipe.forward_only(inputs, pipe.to_device(self.targets(pipe, b)))
        finally:
            for h in hooks:
                h.remove()
        whole = torch.zeros(self.shape)
        lo = replica * per
        hi = min(lo + per, self.rows)
        for i, parts in captured.items():
            rows = torch.cat(parts)
            if rows.shape[0] != per:  # micro-batches of one replica batch, in order
                raise RuntimeError(
                    f"output probe: block {i} ran {rows.shape[0]} rows, expected {per}"
                )
            if lo < hi:
                whole[i, lo:hi] = rows[: hi - lo]
        dist.all_reduce(whole)
        self.seconds = time.perf_counter() - t0
        return whole
