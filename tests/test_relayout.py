"""Training through a sequence of re-layouts (freeze boundary grows, frozen blocks leave the
pipeline, freed ranks become replicas) gives the same weights as the same steps in one process
with the same blocks frozen in place (docs/architecture.md, Invariants 1, 3, 5); frozen blocks
stay bit-identical and receive no gradient. The same holds under `freeze.relayout: off`, where
the stages stay and blocks freeze inside them, up to a first stage with nothing to train."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipetransformer.core.planner import plan_layout
from pipetransformer.core.sampler import IGNORE, ElasticSampler
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout
from pipetransformer.models.seeded import build_model
from pipetransformer.trainer.checkpoint import _optimizer_tensors, save_checkpoint
from pipetransformer.trainer.optim import build_optimizer
from pipetransformer.trainer.relayout import build_training
from tests.mp import run_distributed

# float results compared across computations: run again under other kernels (scripts/test.sh)
pytestmark = pytest.mark.numerics

SPEC = JobSpec(
    name="relayout",
    model={"depth": 4, "dim": 16, "heads": 2},
    training={"global_batch_size": 16, "lr": 1e-2, "warmup_steps": 0, "grad_clip": 1.0},
    parallel={"stages": 2, "microbatches": 2},
)
SAMPLES = 40
# step at which each layout takes over: 2x1 (F=0) -> 2x1 (F=1) -> 1x2 (F=3)
PLAN: list[tuple[int, Layout]] = [
    (0, Layout.build([(0, 2), (2, 4)], num_blocks=4, replicas=1, microbatches=2)),
    (
        2,
        Layout.build(
            [(1, 3), (3, 4)], num_blocks=4, replicas=1, microbatches=2, version=2, freeze_boundary=1
        ),
    ),
    (
        4,
        Layout.build(
            [(3, 4)], num_blocks=4, replicas=2, microbatches=2, version=3, freeze_boundary=3
        ),
    ),
]
STEPS = 6
RTOL, ATOL = 1e-4, 1e-5


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(SAMPLES, 1, 8, 8, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g)


def _batches():
    sampler = ElasticSampler(SAMPLES, SPEC.training.global_batch_size, seed=1)
    epoch, cursor = 0, 0
    for _ in range(STEPS):
        b = sampler.batch(epoch, cursor, 1, 0)  # the global batch; replicas slice it
        yield b
        cursor = b.next_cursor
        if cursor >= SAMPLES:
            epoch, cursor = epoch + 1, 0


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().numpy().tobytes()).hexdigest()


def _train_relayouts(
    rank: int,
    world: int,
    ckpt_dir: str,
    spec: JobSpec = SPEC,
    plan: list[tuple[int, Layout]] = PLAN,
):
    x, y = _data()
    switches = dict(plan)
    pipe = opt = None
    frozen_seen: dict[str, str] = {}
    # frozen blocks whose output required grad in a training forward (autograd would go back
    # through them)
    graded: set[str] = set()

    def watch(name: str):
        def hook(module, args, output) -> None:
            if torch.is_grad_enabled() and output.requires_grad:
                graded.add(name)

        return hook

    for step, b in enumerate(_batches()):
        if step in switches:
            layout = switches[step]
            path = None
            if pipe is not None:  # commit state under the old layout, then move
                path = str(Path(ckpt_dir) / f"step-{step}")
                save_checkpoint(path, pipe.model, opt, {"step": step})
                pipe.destroy_groups()
            pipe, opt = build_training(spec, layout, rank, load_from=path)
            for i, block in pipe.model.blocks.items():
                if int(i) < layout.freeze_boundary:
                    block.register_forward_hook(watch(f"blocks.{i}"))
            replica, per = layout.placement(rank)[1], 16 // layout.replicas
        sl = slice(replica * per, (replica + 1) * per)
        targets = y[b.indices].clone()
        targets[~torch.from_numpy(b.valid)] = IGNORE
        inputs = x[b.indices][sl] if pipe.is_first else None
        pipe.train_step(inputs, targets[sl], b.global_valid)
        norms = pipe.sync_and_clip(spec.training.grad_clip).per_block
        for name, p in pipe.model.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, f"frozen {name} got a gradient"
                frozen_seen.setdefault(name, _digest(p))
                assert _digest(p) == frozen_seen[name], f"frozen {name} changed"
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "replica": replica,
        "stages": [st.index for st, _ in layout.placements(rank)],
        "graded": sorted(graded),
        "norms": norms,  # the last step's per-block gradient norms
        "params": {k: v.detach().clone() for k, v in pipe.model.state_dict().items()},
        "optim": {k: v.clone() for k, v in _optimizer_tensors(pipe.model, opt).items()},
        "in_optimizer": sorted(
            n
            for n, p in pipe.model.named_parameters()
            if any(p is q for g in opt.param_groups for q in g["params"])
        ),
    }


def _reference(plan: list[tuple[int, Layout]] = PLAN) -> dict[str, torch.Tensor]:
    """One process, no pipeline: the same steps with the same blocks frozen in place."""
    model = build_model(SPEC.model, SPEC.training.seed)
    opt = build_optimizer(model, SPEC.training)
    x, y = _data()
    boundary_at = {step: layout.freeze_boundary for step, layout in plan}
    for step, b in enumerate(_batches()):
        if step in boundary_at and boundary_at[step] > 0:
            model.embed.requires_grad_(False)
            for i in range(boundary_at[step]):
                model.blocks[str(i)].requires_grad_(False)
        valid = torch.from_numpy(b.valid)
        logits = model(x[b.indices][valid])
        F.cross_entropy(logits, y[b.indices][valid]).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict()


def _replica_zero_matching(
    results: list[dict], ref: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Replica 0's parameters, gathered over its ranks, after checking that they are the
    one-process reference's (to the tolerance above)."""
    got: dict[str, torch.Tensor] = {}
    for r in results:
        if r["replica"] == 0:
            got.update(r["params"])
    assert set(got) == set(ref)
    for name, value in got.items():
        torch.testing.assert_close(value, ref[name], rtol=RTOL, atol=ATOL, msg=name)
    return got


@pytest.mark.slow
def test_relayouts_give_the_same_weights_as_freezing_in_place(tmp_path: Path) -> None:
    results = run_distributed(_train_relayouts, 2, str(tmp_path))
    got = _replica_zero_matching(results, _reference())
    # both replicas of the final 1x2 layout hold the same weights and optimizer state
    for key in ("params", "optim"):
        a, b = (r[key] for r in results)
        assert set(a) == set(b)
        for name in a:
            assert torch.equal(a[name], b[name]), f"{key}: {name}"
    # frozen blocks (embed, blocks 0-2) are in no optimizer
    for r in results:
        assert r["in_optimizer"] and all(
            n.startswith(("blocks.3.", "head.")) for n in r["in_optimizer"]
        ), r["in_optimizer"]
    init = build_model(SPEC.model, SPEC.training.seed).state_dict()
    # blocks.0 trained for the steps before it froze: bit-identical from then on inside the run
    # (`frozen_seen`, across the re-layouts too), but equal to the one-process reference, which
    # ran those steps with other batch shapes, only to float tolerance (the loop above)
    assert not torch.equal(got["blocks.0.norm1.weight"], init["blocks.0.norm1.weight"])
    assert not torch.equal(got["blocks.3.mlp.0.weight"], init["blocks.3.mlp.0.weight"])


def _off_plan(
    schedule: str, virtual: int, replicas: int
) -> tuple[JobSpec, list[tuple[int, Layout]]]:
    """`freeze.relayout: off` on 2 pipeline ranks of `virtual` stages each: F = 1, 2, 3 of 4
    blocks (with one stage per rank, [0-1|2-3]: block 0 frozen inside stage 0, then stage 0
    with nothing left to train, saving and loading an empty optimizer at the next re-layout,
    then block 2 frozen inside stage 1), each layout planned as a running job plans it."""
    parallel = {"schedule": schedule, "virtual_stages": virtual, "replicas": replicas}
    spec = SPEC.model_copy(
        update={
            "parallel": SPEC.parallel.model_copy(update=parallel),
            "freeze": SPEC.freeze.model_copy(update={"relayout": "off"}),
        }
    )
    layout = plan_layout(spec).layout
    plan = [(0, layout)]
    for step, boundary in ((2, 1), (3, 2), (4, 3)):
        world = layout.world_size
        layout = plan_layout(
            spec, world=world, boundary=boundary, current=layout, profiles={}
        ).layout
        plan.append((step, layout))
    return spec, plan


def _units(layout: Layout, rank: int) -> tuple[set[str], set[str]]:
    """The units `rank` holds under `layout`, and those of them that train."""
    held: set[str] = set()
    for stage, _ in layout.placements(rank):
        held |= {f"blocks.{i}" for i in range(stage.start, stage.end)}
        held |= {"embed"} if stage.index == 0 else set()
        held |= {"head"} if stage.end == layout.num_blocks else set()
    f = layout.freeze_boundary
    frozen = {"embed", *(f"blocks.{i}" for i in range(f))} if f else set()
    return held, held - frozen


def _unit(name: str) -> str:
    return ".".join(name.split(".")[:2]) if name.startswith("blocks.") else name.split(".")[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "virtual", "replicas"),
    [("gpipe", 1, 1), ("1f1b", 1, 2), ("zbv", 2, 1)],
)
def test_freezing_in_place_gives_the_same_weights_as_one_process(
    tmp_path: Path, schedule: str, virtual: int, replicas: int
) -> None:
    spec, plan = _off_plan(schedule, virtual, replicas)
    first = plan[0][1]
    for _, layout in plan:  # the stages, ranks, replicas and micro-batches never change
        assert [(s.start, s.end, s.ranks) for s in layout.stages] == [
            (s.start, s.end, s.ranks) for s in first.stages
        ]
        assert (layout.replicas, layout.microbatches) == (replicas, first.microbatches)
    assert [layout.freeze_boundary for _, layout in plan] == [0, 1, 2, 3]
    last = plan[-1][1]
    results = run_distributed(_train_relayouts, last.world_size, str(tmp_path), spec, plan)
    # every unit stayed in its stage, and equals freezing in place in one process (to float
    # tolerance: micro-batches and replicas sum the batch's gradients in another order)
    got = _replica_zero_matching(results, _reference(plan))
    for rank, r in enumerate(results):
        held, trains = _units(last, rank)
        assert {_unit(n) for n in r["params"]} == held, rank
        assert {_unit(n) for n in r["in_optimizer"]} == trains, rank
        assert {_unit(n.removeprefix("state.")) for n in r["optim"]} == trains, rank
        if schedule != "zbv":
            # zero-bubble schedules need a stage's input to require grad (see
            # trainer.pipeline.carries_gradient): autograd crosses frozen blocks there
            assert r["graded"] == [], f"autograd went back through frozen {r['graded']}"
    # AutoFreeze's per-block norms, the same on every rank: 0 for the frozen blocks 0-2
    for r in results:
        assert r["norms"][:3] == [0.0, 0.0, 0.0] and r["norms"][3] > 0, r["norms"]
        assert r["norms"] == results[0]["norms"]
    # at F = 3 some rank has nothing left to train: the first stage's with one stage per rank,
    # the one running stages 1 and 2 with zbv's V placement
    assert any(not r["in_optimizer"] and not r["optim"] for r in results)
    # the replicas of each stage hold the same weights and optimizer state
    by_stage: dict[tuple[int, ...], list[dict]] = {}
    for r in results:
        by_stage.setdefault(tuple(r["stages"]), []).append(r)
    for group in by_stage.values():
        for key in ("params", "optim"):
            for other in group[1:]:
                assert set(other[key]) == set(group[0][key])
                for name in group[0][key]:
                    assert torch.equal(other[key][name], group[0][key][name]), f"{key}: {name}"
    init = build_model(SPEC.model, SPEC.training.seed).state_dict()
    # blocks 1 and 2 trained before they froze, block 3 throughout
    for name in ("blocks.1.norm1.weight", "blocks.2.mlp.0.weight", "blocks.3.mlp.0.weight"):
        assert not torch.equal(got[name], init[name]), name
