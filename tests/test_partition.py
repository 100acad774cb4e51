"""Partition planner: the DP answer equals exhaustive search; the even split is even; layouts
are well formed."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetransformer.core.partition import PlanError, uniform_partition
from pipetransformer.core.planner import plan_layout, recompute_flags
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from baselines import balanced_partition  # noqa: E402  (a benchmark-only split)


def _initial(spec: JobSpec) -> Layout:
    return plan_layout(spec).layout


def _for_world(spec: JobSpec, world: int, frozen: int = 0, current: Layout | None = None) -> Layout:
    """A re-formed world's layout (what the controller plans when workers re-join)."""
    return plan_layout(spec, world=world, boundary=frozen, current=current).layout


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


@settings(max_examples=80, deadline=None)
@given(blocks=st.integers(1, 40), stages=st.integers(1, 12))
def test_uniform_partition_is_the_even_split(blocks: int, stages: int) -> None:
    if stages > blocks:
        with pytest.raises(PlanError, match="cannot split"):
            uniform_partition(blocks, stages)
        return
    ranges = uniform_partition(blocks, stages)
    sizes = [b - a for a, b in ranges]
    assert ranges[0][0] == 0 and ranges[-1][1] == blocks
    assert all(r1[1] == r2[0] for r1, r2 in itertools.pairwise(ranges))
    # sizes differ by at most one, and the earlier stages take the remainder
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1


def test_plan_layout_ranks_and_ranges() -> None:
    spec = JobSpec(
        name="x",
        model={"depth": 6},
        parallel={"stages": 2, "replicas": 2, "microbatches": 4},
        training={"global_batch_size": 64},
    )
    layout = _initial(spec)
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


# -- re-forming for a changed world (node loss / rejoin) -------------------------------------


def _world_spec(**parallel) -> JobSpec:
    base = {"stages": 2, "replicas": 2, "microbatches": 4}
    return JobSpec.model_validate(
        {
            "name": "w",
            "model": {"depth": 6},
            "training": {"global_batch_size": 64},
            "parallel": {**base, **parallel},
        }
    )


def test_plan_for_world_keeps_depth_and_drops_replicas() -> None:
    spec = _world_spec()
    current = _initial(spec)  # 2 x 2
    shrunk = _for_world(spec, 2, 0, current)
    assert (shrunk.pipeline_ranks, shrunk.replicas, shrunk.microbatches) == (2, 1, 4)
    assert shrunk.version == current.version + 1 and shrunk.world_size == 2
    widened = _for_world(spec, 4, 0, shrunk)
    assert (widened.pipeline_ranks, widened.replicas) == (2, 2)
    # an odd world: 3 does not split a depth-2 pipeline, so the deepest shape that divides it
    three = _for_world(spec, 3, 0, current)
    assert three.world_size == 3 and 3 % three.pipeline_ranks == 0


def test_plan_for_world_keeps_frozen_blocks_out_of_the_pipeline() -> None:
    spec = _world_spec()
    layout = _for_world(spec, 1, 4, _initial(spec))
    assert layout.freeze_boundary == 4
    assert [(s.start, s.end) for s in layout.stages] == [(4, 6)]
    # two active blocks cannot fill a 4-deep pipeline: fewer, longer stages instead
    deep = _for_world(_world_spec(stages=4, replicas=1), 4, 4, None)
    assert deep.pipeline_ranks <= 2 and deep.world_size == 4


def test_plan_for_world_says_why_nothing_fits() -> None:
    spec = _world_spec(stages=2, replicas=1, microbatches=4)
    spec = spec.model_copy(
        update={"training": spec.training.model_copy(update={"global_batch_size": 5})}
    )
    with pytest.raises(PlanError, match="no layout fits 2 worker"):
        _for_world(spec, 2, 5)  # one active block for two ranks, batch 5 for two replicas
    with pytest.raises(PlanError, match="no workers"):
        _for_world(spec, 0)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.integers(0, 5), st.sampled_from([1, 2, 4]))
def test_plan_for_world_fits_the_world_whenever_it_succeeds(world, frozen, stages) -> None:
    spec = _world_spec(stages=stages, replicas=1)
    try:
        layout = _for_world(spec, world, frozen, _initial(spec))
    except PlanError:
        return
    assert layout.world_size == world and layout.freeze_boundary == frozen
    assert layout.stages[0].start == frozen and layout.stages[-1].end == 6
    assert 64 % layout.replicas == 0 and (64 // layout.replicas) % layout.microbatches == 0


def test_a_per_stage_recompute_list_carries_over_by_block() -> None:
    spec = _world_spec(stages=2, replicas=1, recompute=[False, True])  # blocks 3-5 recompute
    assert recompute_flags(spec, _initial(spec)) == [False, True]
    three = _for_world(_world_spec(stages=3, replicas=1), 3, 0, None)  # [0,2) [2,4) [4,6)
    assert recompute_flags(spec, three) == [False, True, True]
    one = _for_world(spec, 1, 4, _initial(spec))  # frozen prefix, one stage [4, 6)
    assert recompute_flags(spec, one) == [True]
    assert recompute_flags(_world_spec(recompute=True), three) == [True, True, True]


# -- the even split where blocks do not divide evenly (issue 13: one uniform split) ------------


def _spec(depth: int, stages: int, **parallel) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "even",
            "model": {"depth": depth},
            "training": {"global_batch_size": 64},
            "parallel": {"stages": stages, "replicas": 1, "microbatches": 4, **parallel},
        }
    )


def test_initial_layout_splits_evenly_earlier_stages_taking_the_remainder() -> None:
    layout = _initial(_spec(10, 4))
    assert [(s.start, s.end) for s in layout.stages] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_reformed_world_splits_the_active_blocks_evenly() -> None:
    spec = _spec(12, 4)
    layout = _for_world(spec, 4, 2, _initial(spec))  # F=2: 10 active blocks on 4 stages
    assert layout.freeze_boundary == 2
    assert [(s.start, s.end) for s in layout.stages] == [(2, 5), (5, 8), (8, 10), (10, 12)]
    fresh = _for_world(_spec(10, 4), 4, 0, None)
    assert [(s.start, s.end) for s in fresh.stages] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_a_recompute_list_is_read_against_the_even_split() -> None:
    # the spec's stages are [0,3) [3,6) [6,8) [8,10): the list marks blocks 3-5 and 8-9
    spec = _spec(10, 4, recompute=[False, True, False, True])
    assert recompute_flags(spec, _initial(spec)) == [False, True, False, True]
    two = _for_world(spec, 2, 0, None)  # [0,5) [5,10)
    assert [(s.start, s.end) for s in two.stages] == [(0, 5), (5, 10)]
    assert recompute_flags(spec, two) == [True, True]
    tail = _for_world(spec, 1, 6, _initial(spec))  # one stage [6, 10)
    assert recompute_flags(spec, tail) == [True]
