"""Criterion 'noise' (core/freeze.py): the drift meter's ratio ||sum g|| / sqrt(sum ||g||^2) per
block is sqrt(n) for a steady gradient, 0 for one that turns back, about 1 for noise, and it
reads only this rank's blocks (the rest comes from the other stages over the pipeline group)."""

from __future__ import annotations

import math

import torch

from pipetransformer.trainer.freezing import GradientDrift


def _step(meter: GradientDrift, grads: dict[str, torch.Tensor], blocks: int) -> None:
    """One step: the named gradients, and the per-block norms every rank has."""
    meter.add(list(grads.items()))
    norms = [0.0] * blocks
    for name, g in grads.items():
        if name.startswith("blocks."):
            i = int(name.split(".")[1])
            norms[i] = math.sqrt(norms[i] ** 2 + float(g.square().sum()))
    meter.add_norms(norms)


def test_steady_turning_and_noisy_gradients() -> None:
    gen = torch.Generator().manual_seed(0)
    meter, n = GradientDrift(3), 64
    steady = torch.randn(5, 4, generator=gen)
    for t in range(n):
        _step(
            meter,
            {
                "blocks.0.w": steady * (1 + t % 3),  # one direction, norms that vary
                "blocks.1.w": steady * (-1) ** t,  # back and forth: sums to nothing
                "blocks.1.b": torch.zeros(4),
                "blocks.2.w": torch.randn(50, generator=gen),  # noise
                "head.w": torch.ones(3),  # not a block: ignored
            },
            3,
        )
    r = meter.ratios(None, torch.device("cpu"))
    # steady: ratio = sum c / sqrt(sum c^2) for norms c_t (sqrt(n) if constant); float32 sums
    c = [1 + t % 3 for t in range(n)]
    assert math.isclose(r[0], sum(c) / math.sqrt(sum(x * x for x in c)), rel_tol=1e-5)
    assert r[1] == 0.0
    assert 0.7 < r[2] < 1.3  # 64 independent normal vectors of 50: 1 within a few percent
    meter.reset()
    assert all(math.isnan(x) for x in meter.ratios(None, torch.device("cpu")))


def test_blocks_this_rank_does_not_train_stay_unknown() -> None:
    meter = GradientDrift(4)
    _step(meter, {"blocks.2.w": torch.ones(3)}, 4)
    r = meter.ratios(None, torch.device("cpu"))
    assert r[2] == 1.0 and all(math.isnan(x) for x in (r[0], r[1], r[3]))
