"""AutoCache for the held-out rows: once blocks are frozen, evaluation reads their output per
held-out sample from the cache instead of reading, decoding and recomputing it, with the same
results (real 2-rank pipeline, gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetransformer.core.spec import ModelSpec
from pipetransformer.trainer.cache import ActivationCache
from pipetransformer.trainer.data import Split
from pipetransformer.trainer.pipeline import build_rank_pipeline
from pipetransformer.trainer.trainer import evaluate
from tests.equivalence import uniform_layout
from tests.mp import run_distributed

pytestmark = pytest.mark.slow

MODEL = ModelSpec(depth=6, dim=16, heads=2)
HELD_OUT, GLOBAL_BATCH = 40, 16  # the last batch is padded (the sampler repeats a real row)


class Unread(Split):
    """A held-out split whose inputs, once `sealed`, cannot be read: what evaluation gets from
    the cache it must not read."""

    sealed = False

    @property
    def inputs(self) -> torch.Tensor:
        if self.sealed:
            raise AssertionError("the held-out inputs were read although the cache holds them")
        return self._inputs

    @inputs.setter
    def inputs(self, value: torch.Tensor) -> None:
        self._inputs = value


def _evaluations(rank: int, world: int, directory: str, stages: int) -> dict:
    g = torch.Generator().manual_seed(3)
    test = Unread(torch.randn(HELD_OUT, 1, 8, 8, generator=g), torch.randint(0, 10, (HELD_OUT,)))
    replicas = world // stages
    layout = uniform_layout(MODEL.depth, stages, replicas, microbatches=2, boundary=2)
    replica = layout.placement(rank)[1]
    pipe = build_rank_pipeline(MODEL, 0, layout, rank, GLOBAL_BATCH // replicas)
    plain = evaluate(pipe, test, GLOBAL_BATCH, layout, replica)
    cache = None
    if pipe.is_first:
        # one per process, none shared: a replica holds the rows it evaluates, and only those
        cache = ActivationCache.for_model(
            Path(directory) / str(rank), MODEL, HELD_OUT, shared=False
        )
        cache.set_boundary(2, pipe.model.prefix.fingerprints(2))
        pipe.heldout_cache = cache
    filled = evaluate(pipe, test, GLOBAL_BATCH, layout, replica)  # computes and stores the rows
    test.sealed = True
    served = evaluate(pipe, test, GLOBAL_BATCH, layout, replica)
    return {"evaluations": (plain, filled, served), "stats": cache and cache.stats()}


@pytest.mark.parametrize("stages", [2, 1])  # 2 stages x 1 replica, 1 stage x 2 replicas
def test_evaluation_serves_the_frozen_prefix_from_the_cache(tmp_path: Path, stages: int) -> None:
    results = run_distributed(_evaluations, 2, str(tmp_path), stages)
    first, last = results
    plain, filled, served = last["evaluations"]
    if stages == 2:
        assert first["evaluations"] == (None, None, None)  # known on the last stage only
    else:
        assert first["evaluations"] == last["evaluations"]  # summed over the replicas
    # the held-out batches and their shapes are the same in all three: the cached rows are the
    # recomputed ones; the blocks above run the same operations on them (float32 on this
    # machine's kernels, whose order the same shapes fix: a tolerance only for the loss's sum)
    assert filled.accuracy == plain.accuracy == served.accuracy
    assert filled.loss == pytest.approx(plain.loss, rel=1e-6)
    assert served.loss == pytest.approx(filled.loss, rel=1e-6)
    # rows served per first-stage rank, the padding's repeats too
    padded = -(-HELD_OUT // GLOBAL_BATCH) * GLOBAL_BATCH // (2 // stages)
    for rank in results[: 2 // stages]:
        stats = rank["stats"]
        assert (stats.computed, stats.hits_ram + stats.hits_disk) == (padded, padded)
