"""In-memory re-layouts (`freeze.handover: memory`): the plan of who keeps and who sends which
unit (core/handover.py), and, in real gloo processes, that the state the ranks hand each other
is bit for bit what the checkpoint path loads: every rank's weights and optimizer state after
the re-layout, and the step trained after it (docs/architecture.md, Invariants 3 and 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetransformer.core.handover import Move, held_units, plan_handover, rank_units, trains
from pipetransformer.core.sampler import IGNORE, ElasticSampler
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout
from pipetransformer.trainer.checkpoint import save_checkpoint, state_tensors
from pipetransformer.trainer.device import Compute
from pipetransformer.trainer.handover import Previous, handover_group
from pipetransformer.trainer.relayout import build_training
from tests.mp import run_distributed

DEPTH = 8
SPEC = JobSpec(
    name="handover",
    model={"depth": DEPTH, "dim": 16, "heads": 2},
    training={"global_batch_size": 16, "lr": 1e-2, "warmup_steps": 0, "grad_clip": 1.0},
    parallel={"stages": 2, "microbatches": 2},
)
SAMPLES = 48


def _layout(ranges, replicas=1, f=0, version=1, microbatches=2, **kw) -> Layout:
    return Layout.build(
        ranges,
        num_blocks=DEPTH,
        replicas=replicas,
        microbatches=microbatches,
        freeze_boundary=f,
        version=version,
        **kw,
    )


QUARTERS = [(0, 2), (2, 4), (4, 6), (6, 8)]
# (old, new): the re-layouts the issue names, planned shapes a freezing job goes through
CASES = {
    "2x1-1x2": (_layout([(0, 4), (4, 8)]), _layout([(5, 8)], 2, f=5, version=2)),
    "4x1-2x2": (_layout(QUARTERS), _layout([(4, 6), (6, 8)], 2, f=4, version=2)),
    "4x1-1x4": (_layout(QUARTERS), _layout([(6, 8)], 4, f=6, version=2)),
    # virtual stages: zbv's V placement (rank 0 runs stages 0 and 3) to interleaved 1F1B's
    # loop placement (rank 0 runs stages 0 and 2), so blocks and the head change ranks
    "virtual": (
        _layout(QUARTERS, microbatches=4, schedule="zbv", virtual_stages=2, placement="v"),
        _layout(
            [(3, 4), (4, 6), (6, 7), (7, 8)],
            f=3,
            version=2,
            microbatches=4,
            schedule="interleaved-1f1b",
            virtual_stages=2,
        ),
    ),
}


# -- the plan (pure) -----------------------------------------------------------------------------


def test_held_units_follow_the_stages() -> None:
    two = _layout([(0, 4), (4, 8)])
    assert rank_units(two, 0) == ["embed", *(f"blocks.{i}" for i in range(4))]
    assert rank_units(two, 1) == [*(f"blocks.{i}" for i in range(4, 8)), "head"]
    # the first stage's rank also holds the frozen prefix it runs outside the pipeline
    packed = _layout([(5, 8)], 2, f=5)
    assert rank_units(packed, 1) == ["embed", *(f"blocks.{i}" for i in range(8)), "head"]
    v = CASES["virtual"][0]  # V placement: rank 0 runs the first and the last stage
    assert rank_units(v, 0) == ["embed", "blocks.0", "blocks.1", "blocks.6", "blocks.7", "head"]
    assert held_units(v.stages[1:3], DEPTH) == [f"blocks.{i}" for i in range(2, 6)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_unit_is_kept_or_moved_from_a_rank_that_held_it(case: str) -> None:
    old, new = CASES[case]
    plan = plan_handover(old, new)
    for rank in range(new.world_size):
        before = set(rank_units(old, rank))
        gained = [m.unit for m in plan.receives(rank)]
        assert set(plan.keeps[rank]) == set(rank_units(new, rank)) & before
        assert sorted([*plan.keeps[rank], *gained]) == sorted(rank_units(new, rank))
        assert len(gained) == len(set(gained))  # each unit arrives once
    for m in plan.moves:
        assert m.src != m.dst and m.unit in rank_units(old, m.src)
        assert m.optimizer == trains(m.unit, new.freeze_boundary)
    assert list(plan.moves) == sorted(plan.moves)


def test_sends_spread_over_the_replicas_that_hold_a_unit() -> None:
    # 1x2 -> 1x2 with more frozen: nothing moves; 2x2 -> 1x4: the two ranks gaining the
    # embedding and blocks 0..3 get them from different holders where two hold them
    same = plan_handover(_layout([(0, 8)], 2), _layout([(3, 8)], 2, f=3, version=2))
    assert same.moves == ()
    old = _layout([(0, 4), (4, 8)], 2)  # ranks 0 and 2 hold embed and blocks 0..3
    new = _layout([(6, 8)], 4, f=6, version=2)
    plan = plan_handover(old, new)
    senders = {m.src for m in plan.moves if m.unit == "embed"}
    assert senders == {0, 2}
    assert Move(0, 1, "embed", False) in plan.moves  # frozen now: weights only
    assert all(m.optimizer == (m.unit in ("head", "blocks.6", "blocks.7")) for m in plan.moves)


def test_a_plan_refuses_what_an_in_memory_re_layout_cannot_be() -> None:
    two = _layout([(0, 4), (4, 8)])
    with pytest.raises(ValueError, match="keeps the ranks: 2 ranks before, 4 after"):
        plan_handover(two, _layout([(6, 8)], 4, f=6))
    with pytest.raises(ValueError, match="moves back"):
        plan_handover(_layout([(5, 8)], 2, f=5), _layout([(3, 8)], 2, f=3))


# -- the state moved, in real processes ----------------------------------------------------------


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(SAMPLES, 1, 8, 8, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)


def _step(pipe, opt, layout: Layout, rank: int, at: int) -> None:
    """One optimizer step on the global batch at sample `at` (each replica its slice)."""
    x, y = _data()
    b = ElasticSampler(SAMPLES, 16, seed=1).batch(0, at, 1, 0)
    replica, per = layout.placement(rank)[1], 16 // layout.replicas
    sl = slice(replica * per, (replica + 1) * per)
    targets = y[b.indices].clone()
    targets[~torch.from_numpy(b.valid)] = IGNORE
    inputs = x[b.indices][sl] if pipe.is_first else None
    pipe.train_step(inputs, targets[sl], b.global_valid)
    master = pipe.model.master
    if master is not None:
        master.load_grads()
    pipe.sync_and_clip(1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if master is not None:
        master.write_back()


def _snapshot(pipe, opt) -> dict[str, torch.Tensor]:
    state = state_tensors(pipe.model.state_module, opt)
    out = {f"model/{k}": v.detach().clone() for k, v in state["model"].items()}
    out |= {f"optim/{k}": v.detach().clone() for k, v in state["optim"].items()}
    # the computing model too (bf16-weights: the masters rounded)
    out |= {f"weights/{k}": v.detach().clone() for k, v in pipe.model.state_dict().items()}
    return out


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if set(a) != set(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))}"]
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def _both_paths(rank: int, world: int, case: str, ckpt: str, precision: str) -> dict:
    old, new = CASES[case]
    compute = Compute(precision=precision)
    spec = SPEC
    group = handover_group(world, compute.backend, compute.device)
    pipe, opt = build_training(spec, old, rank, compute=compute)
    for k in range(2):  # optimizer state to move: moments and step counts that are not zeros
        _step(pipe, opt, old, rank, at=16 * k)
    before = _snapshot(pipe, opt)
    save_checkpoint(ckpt, pipe.model.state_module, opt, {"step": 2})
    pipe.destroy_groups()
    # the checkpoint path: every rank reads its units of the new layout back
    by_ckpt, opt_ckpt = build_training(spec, new, rank, load_from=ckpt, compute=compute)
    # the in-memory path, from the old layout's live state
    previous = Previous(old, pipe.model.state_module, opt, group, compute.device)
    by_memory, opt_memory = build_training(spec, new, rank, compute=compute, previous=previous)
    after = {"checkpoint": _snapshot(by_ckpt, opt_ckpt), "memory": _snapshot(by_memory, opt_memory)}
    moved = _differences(after["checkpoint"], after["memory"])
    # a frozen unit this rank kept has its exact weights (moved ones: compared to the checkpoint)
    kept = {
        k: v
        for k, v in after["memory"].items()
        if k.startswith("model/") and k in before and not trains(_unit(k), new.freeze_boundary)
    }
    frozen_changed = [k for k, v in kept.items() if not torch.equal(v, before[k])]
    # and the next step is the same from either
    results = {}
    for name, (p, o) in {
        "checkpoint": (by_ckpt, opt_ckpt),
        "memory": (by_memory, opt_memory),
    }.items():
        torch.manual_seed(0)
        _step(p, o, new, rank, at=32)
        results[name] = _snapshot(p, o)
    by_ckpt.destroy_groups()
    by_memory.destroy_groups()
    return {
        "differ": moved,
        "differ_after_step": _differences(results["checkpoint"], results["memory"]),
        "frozen_changed": frozen_changed,
        "moved_bytes": previous.moved_bytes,
        "tensors": len(after["memory"]),
        "optim": sum(k.startswith("optim/") for k in after["memory"]),
    }


def _unit(key: str) -> str:
    name = key.split("/", 1)[1].removeprefix("state.")
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "precision"),
    [(c, "fp32") for c in sorted(CASES)] + [("2x1-1x2", "bf16-weights")],
)
def test_in_memory_state_is_the_checkpoint_paths_bit_for_bit(
    tmp_path: Path, case: str, precision: str
) -> None:
    old, new = CASES[case]
    results = run_distributed(_both_paths, old.world_size, case, str(tmp_path / "ckpt"), precision)
    plan = plan_handover(old, new)
    for rank, r in enumerate(results):
        assert r["differ"] == [], (rank, r["differ"][:5])
        assert r["differ_after_step"] == [], (rank, r["differ_after_step"][:5])
        assert r["frozen_changed"] == [], (rank, r["frozen_changed"][:5])
        assert r["optim"] > 0 and r["tensors"] > r["optim"]
        # what a rank received over the wire is what it gained, and nothing when it gained none
        assert (r["moved_bytes"] > 0) == bool(plan.receives(rank)), rank
