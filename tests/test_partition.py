"""Partition planner: the DP answer equals exhaustive search; layouts are well formed."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.spec import JobSpec
from orchestrator.state import Layout
from trainer.partition import balanced_partition, plan_layout


def _brute_force(costs: list[float], stages: int) -> float:
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@settings(max_examples=80, deadline=None)
@given(
    costs=st.lists(st.floats(0.1, 10.0, allow_nan=False), min_size=1, max_size=10),
    stages=st.integers(1, 4),
)
def test_dp_matches_exhaustive_search(costs: list[float], stages: int) -> None:
    if stages > len(costs):
        with pytest.raises(ValueError, match="cannot split"):
            balanced_partition(costs, stages)
        return
    ranges = balanced_partition(costs, stages)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
    assert all(a < b for a, b in ranges) and all(
        r1[1] == r2[0] for r1, r2 in itertools.pairwise(ranges)
    )
    bottleneck = max(sum(costs[a:b]) for a, b in ranges)
    assert bottleneck == pytest.approx(_brute_force(costs, stages))


def test_plan_layout_ranks_and_ranges() -> None:
    spec = JobSpec(
        name="x",
        model={"depth": 6},
        parallel={"stages": 2, "replicas": 2, "microbatches": 4},
        training={"global_batch_size": 64},
    )
    layout = plan_layout(spec)
    assert [(s.start, s.end) for s in layout.stages] == [(0, 3), (3, 6)]
    assert [s.ranks for s in layout.stages] == [[0, 2], [1, 3]]
    assert layout.world_size == 4 and layout.placement(3)[0].index == 1
    assert Layout.model_validate_json(layout.model_dump_json()) == layout


def test_layout_rejects_gaps() -> None:
    with pytest.raises(ValueError, match="expected start"):
        Layout(
            num_blocks=4,
            microbatches=2,
            stages=[
                {"index": 0, "start": 0, "end": 1, "ranks": [0]},
                {"index": 1, "start": 2, "end": 4, "ranks": [1]},
            ],
        )
