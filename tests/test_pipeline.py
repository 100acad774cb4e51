"""Pipeline-parallel gradients equal single-process gradients for the same batch
(docs/architecture.md, Invariants 2), for every schedule and for S x R layouts 2x1, 4x1, 2x2 and
1x4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipetransformer.core.partition import uniform_partition
from pipetransformer.core.sampler import IGNORE
from pipetransformer.core.spec import SCHEDULES, ModelSpec, schedule_problem
from pipetransformer.core.state import Layout
from pipetransformer.models.seeded import build_model
from pipetransformer.trainer.pipeline import build_rank_pipeline
from tests.mp import run_distributed

# float results compared across computations: run again under other kernels (scripts/test.sh)
pytestmark = pytest.mark.numerics

# float32 sums in a different order (per micro-batch, per stage) differ in the last bits only
RTOL, ATOL = 1e-4, 1e-6
MODEL = ModelSpec(depth=8, dim=16, heads=2)
BATCH, N_VALID = 32, 29  # the tail is padding, as in an epoch's last batch


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    y[N_VALID:] = IGNORE
    return x, y


def _layouts(stages: int, replicas: int) -> dict[str, Layout]:
    """Every schedule that can run this S x R shape, with its layout."""
    microbatches = max(4, 2 * stages)
    out = {}
    for name, rule in SCHEDULES.items():
        virtual = rule.min_virtual
        if schedule_problem(name, stages, virtual, microbatches):
            continue
        ranges = uniform_partition(MODEL.depth, stages * virtual)
        out[name] = Layout.build(
            ranges,
            num_blocks=MODEL.depth,
            replicas=replicas,
            microbatches=microbatches,
            schedule=name,
            virtual_stages=virtual,
            placement=rule.placement,
        )
    return out


def _grads_per_schedule(rank: int, world: int, stages: int, replicas: int):
    x, y = _batch()
    per = BATCH // replicas
    results = {}
    for name, layout in _layouts(stages, replicas).items():
        pipe = build_rank_pipeline(MODEL, 0, layout, rank, per)
        replica = layout.placement(rank)[1]
        sl = slice(replica * per, (replica + 1) * per)
        loss = pipe.train_step(x[sl] if pipe.is_first else None, y[sl], loss_count=N_VALID)
        pipe.sync_and_clip(max_norm=0.0)
        grads = {n: p.grad.clone() for n, p in pipe.model.named_parameters()}
        results[name] = {"loss": loss, "grads": grads, "replica": replica}
    return results


@pytest.fixture(scope="module")
def reference():
    ref = build_model(MODEL, 0)
    x, y = _batch()
    loss = F.cross_entropy(ref(x[:N_VALID]), y[:N_VALID])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize(("stages", "replicas"), [(2, 1), (4, 1), (2, 2), (1, 4)])
def test_every_schedule_matches_single_process(stages: int, replicas: int, reference) -> None:
    ref_loss, ref_grads = reference
    per_rank = run_distributed(_grads_per_schedule, stages * replicas, stages, replicas)
    expected = set(_layouts(stages, replicas))
    assert {"gpipe", "1f1b"} <= expected and len(expected) >= 5, expected
    for name in expected:
        seen: dict[str, int] = {}
        for res in (r[name] for r in per_rank):
            for pname, g in res["grads"].items():
                torch.testing.assert_close(
                    g, ref_grads[pname], rtol=RTOL, atol=ATOL, msg=f"{name}: {pname}"
                )
                seen[pname] = seen.get(pname, 0) + 1
        # every parameter lives on exactly one rank of each replica
        assert seen == dict.fromkeys(ref_grads, replicas), name
        replica0 = [r[name]["loss"] for r in per_rank if r[name]["replica"] == 0]
        losses = [r[name]["loss"] for r in per_rank if r[name]["loss"] is not None]
        assert len(losses) == replicas and len([v for v in replica0 if v is not None]) == 1
        assert sum(losses) == pytest.approx(ref_loss, rel=1e-5), name


def test_layouts_cover_the_expected_schedules() -> None:
    assert set(_layouts(2, 1)) == set(SCHEDULES)
    # one rank per pipeline: V-shaped schedules still fit (both stages on that rank)
    assert {"gpipe", "1f1b", "interleaved-1f1b"} <= set(_layouts(1, 4))


def _evaluate_with_dropout(rank: int, world: int):
    model = MODEL.model_copy(update={"dropout": 0.5})
    layout = _layouts(2, 1)["gpipe"]
    pipe = build_rank_pipeline(model, 0, layout, rank, BATCH)
    x, y = _batch()
    logits = [pipe.forward_only(x if pipe.is_first else None, y) for _ in range(2)]
    training = pipe.model.training and all(m.training for m in pipe.model.modules())
    return {"logits": logits, "training": training}


@pytest.mark.slow
def test_evaluation_runs_in_eval_mode_and_restores_train_mode() -> None:
    """Held-out accuracy is the model's, not a sample of it under dropout: the pipeline's
    forward-only pass gives the single-process eval-mode logits, the same twice, and leaves the
    model training."""
    results = run_distributed(_evaluate_with_dropout, 2)
    ref = build_model(MODEL.model_copy(update={"dropout": 0.5}), 0).eval()
    x, _ = _batch()
    with torch.no_grad():
        expected = ref(x)
    last = results[1]["logits"]
    assert results[0]["logits"] == [None, None]
    assert torch.equal(last[0], last[1])  # the same computation twice: no dropout noise
    torch.testing.assert_close(last[0], expected, rtol=RTOL, atol=ATOL)  # micro-batches of 8
    assert all(r["training"] for r in results)
