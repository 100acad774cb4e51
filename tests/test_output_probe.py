"""Policy 'output' on a real model: the probe's sketches (trainer/output_probe.py) of a small
residual network trained with Adam, read by the rule in core/freeze.py, in one process.

The two properties the rule exists for, each against a control that shows the test can fail:
a decaying learning rate on a model that has not converged does not freeze it (the same
movements, not divided by the learning rate, would); and a block whose inputs changed after a
re-initialisation below it is not frozen (the same model without the re-initialisation is).
The collective half of the probe (rows across replicas, the all-reduce) runs in the job tests."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from pipetransformer.core.freeze import FreezeState, decide, output_rate
from pipetransformer.core.spec import FreezeSpec
from pipetransformer.trainer.output_probe import (
    SKETCH_TOKENS,
    SKETCH_WIDTH,
    block_changes,
    projection,
    sketch,
)

WIDTH, TOKENS, BLOCKS = 16, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(1)).squeeze(-1)


def _task(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets from a fixed random teacher, and a held-out probe batch."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, TOKENS, WIDTH, generator=gen)
    torch.manual_seed(seed + 1)
    teacher = Net()
    with torch.no_grad():
        y = teacher(x)
    return x, y, torch.randn(32, TOKENS, WIDTH, generator=gen)


def _probe(net: Net, probe: torch.Tensor) -> torch.Tensor:
    """Every block's sketch on the probe batch, [blocks, rows, tokens, k], as the trainer takes it."""
    proj, out = projection(WIDTH), []
    with torch.no_grad():
        h = probe
        for b in net.blocks:
            h = b(h)
            out.append(sketch(h, proj))
    return torch.stack(out)


def _train(net: Net, opt: torch.optim.Optimizer, x, y, steps: int, lr: float, gen) -> float:
    """`steps` Adam steps on mini-batches of 32 at learning rate `lr`; the last loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss = torch.tensor(math.nan)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        loss = nn.functional.mse_loss(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


def _loss(net: Net, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(net(x), y))


SPEC = FreezeSpec(policy="output", output_ratio=0.3, alpha=0.9, keep_trainable=1)


def _decide(state: FreezeState, rates: list[float], boundary: int = 0):
    return decide(SPEC, state, None, BLOCKS, boundary=boundary, output_rates=rates)


def test_a_sketch_keeps_norms_and_distances() -> None:
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(32, 64, 128, generator=gen)
    b = a + 0.1 * torch.randn(32, 64, 128, generator=gen)
    proj = projection(128)
    sa, sb = sketch(a, proj), sketch(b, proj)
    assert sa.shape == (32, SKETCH_TOKENS, SKETCH_WIDTH)
    [(change, ref)] = block_changes(sb[None], sa[None])
    # the positions kept are a sample of the 64: the relative change is that of the whole
    # output to a few per cent (random projection: the tolerance is its error, not float noise)
    whole = float((b - a).norm() / a.norm())
    assert change / ref == pytest.approx(whole, rel=0.1)
    assert torch.equal(sketch(a, proj), sa)  # fixed directions: the same sketch every time


def test_a_decaying_learning_rate_does_not_freeze_a_model_still_learning() -> None:
    torch.manual_seed(0)
    x, y, probe = _task()
    net, gen = Net(), torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(net.parameters())
    start = _loss(net, x, y)
    state, ref, lr = FreezeState(), _probe(net, probe), 3e-4
    raw_state, frozen_raw, boundaries = FreezeState(), 0, []
    for _ in range(6):
        _train(net, opt, x, y, 20, lr, gen)
        now = _probe(net, probe)
        changes = block_changes(now, ref)
        ref = now
        d = _decide(state, [output_rate(c, r, 20 * lr) for c, r in changes])
        state = d.state
        boundaries.append(d.boundary)
        # the control: the same movements, not per unit of learning rate
        raw = decide(
            SPEC,
            raw_state,
            None,
            BLOCKS,
            boundary=frozen_raw,
            output_rates=[output_rate(c, r, 1.0) for c, r in changes],
        )
        raw_state, frozen_raw = raw.state, raw.boundary
        lr *= 0.3
    # far from converged, the decay stalled it: training on at the first rate still cuts its
    # loss by more than a third in one interval
    stalled = _loss(net, x, y)
    _train(net, opt, x, y, 20, 3e-4, gen)
    assert _loss(net, x, y) < 0.67 * stalled < 0.67 * start
    assert boundaries == [0] * 6
    assert frozen_raw > 0  # read without the learning rate, the decay would have frozen it


def _settled(seed: int = 0) -> tuple[Net, torch.optim.Optimizer, FreezeState, torch.Tensor]:
    """A model trained at a constant learning rate until the rule finds its first blocks
    settled (the state before that decision, and the probe reference then)."""
    torch.manual_seed(seed)
    x, y, probe = _task(seed)
    net, gen = Net(), torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters())
    state, ref = FreezeState(), _probe(net, probe)
    for _ in range(40):
        before = (copy.deepcopy(net), copy.deepcopy(opt.state_dict()), state, ref)
        _train(net, opt, x, y, 25, 3e-3, gen)
        now = _probe(net, probe)
        d = _decide(state, [output_rate(c, r, 25 * 3e-3) for c, r in block_changes(now, ref)])
        if d.boundary >= 2:
            return before[0], before[1], before[2], before[3]
        state, ref = d.state, now
    raise AssertionError("the model never settled: the test's model or budget is off")


def _interval_after_freezing_block0(reinit: bool) -> int:
    """From the settled model: block 0 frozen (re-initialised first or not), one interval of
    training, and the decision taken at boundary 1."""
    net, opt_state, state, ref = _settled()
    x, y, probe = _task()
    opt = torch.optim.Adam(net.parameters())
    opt.load_state_dict(opt_state)  # the run goes on: Adam's moments as they were
    if reinit:
        torch.manual_seed(99)
        net.blocks[0] = Block()  # its old parameters get no more gradients: Adam skips them
    net.blocks[0].requires_grad_(False)
    gen = torch.Generator().manual_seed(7)
    _train(net, opt, x, y, 25, 3e-3, gen)
    now = _probe(net, probe)
    rates = [output_rate(c, r, 25 * 3e-3) for c, r in block_changes(now, ref)]
    return _decide(state, rates, boundary=1).boundary


def test_a_block_whose_inputs_changed_after_a_reinitialisation_is_not_frozen() -> None:
    assert _interval_after_freezing_block0(reinit=False) > 1  # the control: it was settled
    assert _interval_after_freezing_block0(reinit=True) == 1
