"""Pipeline-parallel gradients equal single-process gradients for the same batch (DESIGN §4.2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orchestrator.spec import JobSpec
from tests.mp import run_distributed
from trainer.models import build_model, build_stage
from trainer.partition import plan_layout
from trainer.pipeline import StagePipeline, build_groups
from trainer.sampler import IGNORE

# float32 sums in a different order (per micro-batch, per stage) differ in the last bits only
RTOL, ATOL = 1e-4, 1e-6


def _spec(stages: int, replicas: int, microbatches: int) -> JobSpec:
    return JobSpec(
        name="pipe-test",
        model={"depth": 4, "dim": 32, "heads": 4},
        training={"global_batch_size": 16},
        parallel={"stages": stages, "replicas": replicas, "microbatches": microbatches},
    )


def _batch(n_valid: int = 16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)
    y[n_valid:] = IGNORE  # padded tail of an epoch
    return x, y


def _pipeline_grads(rank: int, world: int, spec_json: str, n_valid: int):
    spec = JobSpec.model_validate_json(spec_json)
    layout = plan_layout(spec)
    stage, replica = layout.placement(rank)
    groups = build_groups(layout, rank)
    module = build_stage(spec.model, 0, stage.start, stage.end)
    per = spec.training.global_batch_size // layout.replicas
    pipe = StagePipeline(module, spec.model, stage, layout, groups, per)
    x, y = _batch(n_valid)
    sl = slice(replica * per, (replica + 1) * per)
    loss = pipe.train_step(x[sl], y[sl], global_valid=n_valid)
    pipe.sync_and_clip(max_norm=0.0)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return {"loss": loss, "grads": grads, "replica": replica}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stages", "replicas", "microbatches", "n_valid"),
    [(2, 1, 4, 16), (2, 1, 2, 11), (2, 2, 2, 13)],
)
def test_pipeline_gradients_equal_single_process(stages, replicas, microbatches, n_valid):
    spec = _spec(stages, replicas, microbatches)
    results = run_distributed(_pipeline_grads, stages * replicas, spec.model_dump_json(), n_valid)

    ref = build_model(spec.model, 0)
    x, y = _batch(n_valid)
    ref_loss = F.cross_entropy(ref(x[:n_valid]), y[:n_valid])
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    seen = set()
    for res in results:
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=RTOL, atol=ATOL, msg=name)
            seen.add(name)
    assert seen == set(ref_grads), "every parameter is owned by some stage"
    total_loss = sum(r["loss"] for r in results if r["loss"] is not None)
    assert total_loss == pytest.approx(ref_loss.item(), rel=1e-5)
