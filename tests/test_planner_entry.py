"""core.planner.plan_layout, the one planning entry point: which situation its arguments
select, what each answers (checked against the planner search it wraps), the sizes a measured
plan needs, and the old entry points that still delegate to it."""

from __future__ import annotations

import pytest

from pipetransformer.core import planner
from pipetransformer.core.partition import BlockProfile, CostModel, PlanError, Profile, plan
from pipetransformer.core.planner import Planned, plan_layout, profile_sizes
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout
from pipetransformer.trainer import profile as profile_mod


def _spec(depth: int = 8, freeze: dict | None = None, **parallel) -> JobSpec:
    base = {"stages": 2, "replicas": 2, "microbatches": "auto", "partition": "autopipe"}
    return JobSpec.model_validate(
        {
            "name": "entry",
            "model": {"depth": depth},
            "training": {"global_batch_size": 48},
            "parallel": {**base, **parallel},
            "freeze": freeze or {},
        }
    )


def _profiles(depth: int, sizes: set[int]) -> dict[int, Profile]:
    """Made-up measurements: a fixed cost per micro-batch plus a per-sample one, blocks slower
    towards the end, so that different shapes and counts win for different reasons."""

    def unit(j: int, b: int) -> BlockProfile:
        return BlockProfile(0.3 + 0.01 * b + 0.002 * j * b, 0.6 + 0.02 * b, 100 * b, 1000, 50 * b)

    return {
        b: Profile(
            tuple(unit(j, b) for j in range(depth)),
            BlockProfile(0.1 + 0.01 * b, 0.1, 100 * b, 5000, 10 * b),
            BlockProfile(0.05, 0.05, 10 * b, 300, 5 * b),
            b,
        )
        for b in sizes
    }


def _ranges(layout: Layout) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in layout.stages]


# -- without measurement (the controller) ------------------------------------------------------


def test_initial_layout() -> None:
    spec = _spec(10, stages=4, replicas=1, microbatches=8, partition="uniform")
    planned = plan_layout(spec)
    assert isinstance(planned, Planned) and planned.reason == "initial"
    layout = planned.layout
    assert layout.version == 1 and layout.planner == "uniform" and layout.microbatches == 8
    assert _ranges(layout) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert _ranges(layout) == planner.initial_ranges(spec)
    # `auto` starts with the smallest candidate for the spec's depth until workers measure
    assert plan_layout(_spec()).layout.microbatches == 2
    with pytest.raises(ValueError, match="pass world"):
        plan_layout(spec, current=layout)  # a current layout without a world is a re-form


def test_reformed_world_reason_and_version() -> None:
    spec = _spec(partition="uniform", microbatches=4)
    current = plan_layout(spec).layout
    shrunk = plan_layout(spec, world=2, current=current)
    assert shrunk.reason == "re-formed for 2 worker(s)"
    assert shrunk.layout.version == current.version + 1 and shrunk.layout.world_size == 2
    frozen = plan_layout(spec, world=4, boundary=2, current=current)
    assert (
        frozen.reason == "re-formed for 4 worker(s) at the resumed checkpoint's freeze boundary 2"
    )
    assert frozen.layout.stages[0].start == 2
    assert plan_layout(spec, world=4).layout.version == 1  # nothing to re-form from
    with pytest.raises(PlanError, match="no workers"):
        plan_layout(spec, world=0)


# -- with measurement (the workers) ------------------------------------------------------------


def test_startup_plans_the_spec_shape_from_measurement() -> None:
    spec = _spec()
    current = plan_layout(spec).layout
    sizes = profile_sizes(spec, boundary=0)
    assert sizes == {24 // m for m in (2, 3, 4, 6, 8, 12)}  # candidates in [S, 6S] of 24
    profiles = _profiles(8, sizes)
    planned = plan_layout(spec, world=4, current=current, profiles=profiles)
    expected = plan(
        profiles,
        devices=4,
        global_batch=48,
        cost=CostModel(schedule="gpipe"),
        microbatches=[2, 3, 4, 6, 8, 12],
        stages=2,
        replicas=2,
    )
    layout = planned.layout
    assert (layout.pipeline_ranks, layout.replicas) == (2, 2)  # S and R stay the spec's
    assert _ranges(layout) == list(expected.ranges)
    assert layout.microbatches == expected.microbatches
    assert layout.planner == "autopipe" and layout.version == current.version + 1
    assert planned.reason == f"autopipe: {expected.summary()}"
    # what the Pipeline view sets beside the measured: compute per micro-batch x micro-batches
    assert planned.predicted_stage_s == pytest.approx(
        [c * expected.microbatches for c in expected.stage_compute_s]
    )
    assert plan_layout(spec).predicted_stage_s is None  # not planned from measurement
    # world defaults to the spec's: the same situation
    assert plan_layout(spec, current=current, profiles=profiles) == planned


def test_startup_keeps_the_even_cuts_unless_the_partition_is_autopipe() -> None:
    spec = _spec(10, stages=4, replicas=1, partition="uniform")
    current = plan_layout(spec).layout
    profiles = _profiles(10, profile_sizes(spec))
    planned = plan_layout(spec, world=4, current=current, profiles=profiles)
    assert _ranges(planned.layout) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert planned.layout.planner == "autopipe"


def test_relayout_searches_every_shape_of_the_world() -> None:
    spec = _spec(microbatches=4)
    current = plan_layout(spec).layout
    sizes = profile_sizes(spec, world=4, boundary=2)
    # shapes 1x4 (batch 12), 2x2 (24), 4x1 (48), each with the spec's 4 micro-batches
    assert sizes == {3, 6, 12}
    profiles = _profiles(8, sizes)
    planned = plan_layout(spec, world=4, boundary=2, current=current, profiles=profiles)
    cost = CostModel(freeze_boundary=2)
    options = [
        plan(
            {48 // r // 4: profiles[48 // r // 4]},
            devices=4,
            global_batch=48,
            cost=cost,
            microbatches=[4],
            stages=s,
            replicas=r,
            allowed_cuts=range(3, 8),
        )
        for s, r in ((1, 4), (2, 2), (4, 1))
    ]
    best = min(options, key=lambda p: (p.step_time_s, p.stages))
    layout = planned.layout
    assert layout.freeze_boundary == 2 and layout.stages[0].start == 2  # frozen prefix left
    assert [(max(a, 2), c) for a, c in best.ranges] == _ranges(layout)
    assert (layout.replicas, layout.microbatches) == (best.replicas, best.microbatches)
    assert layout.planner == "autopipe" and layout.version == current.version + 1
    assert planned.reason == f"F=2: {best.summary()}"
    # a re-formed world the workers measure (boundary 0, another world) is a re-layout too
    again = plan_layout(spec, world=2, current=current, profiles=_profiles(8, {6, 12, 24}))
    assert again.reason.startswith("F=0: ") and again.layout.world_size == 2
    assert profile_sizes(spec, world=2) == {6, 12}  # 1x2 (batch 24) and 2x1 (48), m=4


def test_measured_plans_need_a_current_layout_and_a_shape_that_fits() -> None:
    spec = _spec()
    with pytest.raises(ValueError, match="pass current"):
        plan_layout(spec, profiles=_profiles(8, {4}))
    # 7 frozen blocks leave one active block: of 2x1 and 1x2 only 1 stage x 2 replicas fits
    assert profile_sizes(spec, world=2, boundary=7) == {24 // m for m in (1, 2, 3, 4, 6)}
    with pytest.raises(PlanError, match="no stages x replicas = 5"):
        profile_sizes(_spec(depth=2), world=5, boundary=1)  # 1 active block, batch 48 / 5


def test_fewer_measurements_than_asked_are_interpolated() -> None:
    spec = _spec()
    current = plan_layout(spec).layout
    planned = plan_layout(spec, current=current, profiles=_profiles(8, {2, 12}))
    assert planned.layout.world_size == 4 and planned.layout.planner == "autopipe"


# -- freeze.relayout: how a freeze re-lays the job out -------------------------------------------


def test_elastic_is_the_default_and_plans_as_before() -> None:
    spec = _spec(microbatches=4)
    assert spec.freeze.relayout == "elastic"
    explicit = _spec(microbatches=4, freeze={"relayout": "elastic"})
    current = plan_layout(spec).layout
    profiles = _profiles(8, profile_sizes(spec, world=4, boundary=2))
    assert profile_sizes(explicit, world=4, boundary=2) == profile_sizes(spec, world=4, boundary=2)
    assert plan_layout(
        explicit, world=4, boundary=2, current=current, profiles=profiles
    ) == plan_layout(spec, world=4, boundary=2, current=current, profiles=profiles)


def test_off_moves_only_the_boundary_and_measures_nothing(fake_measure) -> None:
    spec = _spec(freeze={"relayout": "off"}, partition="uniform", microbatches=4)
    current = plan_layout(spec).layout  # 2x2 [0-3|4-7]
    assert profile_sizes(spec, world=4, boundary=5, current=current) == set()
    for boundary in (3, 5):  # inside stage 0, then past all of its blocks
        planned = profile_mod.measured_layout(spec, world=4, boundary=boundary, current=current)
        layout = planned.layout
        assert layout.freeze_boundary == boundary and layout.version == current.version + 1
        assert layout.stages == current.stages  # ranges and ranks: frozen blocks stay in place
        assert (layout.replicas, layout.microbatches, layout.schedule) == (2, 4, "gpipe")
        assert planned.reason.startswith(f"F={boundary}: frozen in place")
        current = layout
    assert fake_measure == [], "nothing is measured"
    # the same without any profile at all (the planner does not read them)
    again = plan_layout(spec, world=4, boundary=6, current=current, profiles={})
    assert again.layout.freeze_boundary == 6 and again.layout.stages == current.stages
    # workers starting under such a layout (a re-formed world) measure nothing either
    measured = _spec(freeze={"relayout": "off"})
    assert planner.needs_measurement(measured, plan_layout(measured).layout)  # start-up
    reformed = plan_layout(measured, world=2, boundary=3, current=current).layout
    assert not planner.needs_measurement(measured, reformed)
    assert planner.needs_measurement(_spec(), plan_layout(_spec(), world=2, boundary=3).layout)
    # a re-formed world keeps the frozen blocks in the pipeline, so later freezes can stay in
    # place; elastic and repartition move them out
    assert reformed.stages[0].start == 0 and reformed.freeze_boundary == 3
    assert _ranges(reformed) == [(0, 4), (4, 8)]
    later = plan_layout(measured, world=2, boundary=5, current=reformed, profiles={}).layout
    assert later.stages == reformed.stages and later.freeze_boundary == 5
    for mode in ("elastic", "repartition"):
        moved = _spec(freeze={"relayout": mode, "keep_trainable": 2})
        assert plan_layout(moved, world=2, boundary=3, current=current).layout.stages[0].start == 3


def test_a_one_stage_relayout_with_one_count_measures_nothing(fake_measure) -> None:
    # one device (a one-GPU job) and a fixed micro-batch count: the re-layout can only be
    # [F, L) on that device, so nothing is measured and it is planned without profiles
    spec = _spec(stages=1, replicas=1, microbatches=2)
    current = plan_layout(spec).layout
    assert profile_sizes(spec, world=1, boundary=3, current=current) == set()
    planned = profile_mod.measured_layout(spec, world=1, boundary=3, current=current)
    assert fake_measure == [], "nothing is measured"
    layout = planned.layout
    assert _ranges(layout) == [(3, 8)] and (layout.replicas, layout.microbatches) == (1, 2)
    assert layout.version == current.version + 1 and layout.planner == "autopipe"
    assert "the only shape for 1 worker" in planned.reason
    # two replicas of one stage each, the same: 2 workers can only be 1x2 once 7 of 8 froze
    two = _spec(stages=2, replicas=1, microbatches=2)
    assert profile_sizes(two, world=2, boundary=7, current=plan_layout(two).layout) == set()
    # an automatic micro-batch count leaves a choice: measured as before
    auto = _spec(stages=1, replicas=1)
    assert profile_sizes(auto, world=1, boundary=3, current=plan_layout(auto).layout)


def test_repartition_keeps_the_replicas_and_moves_the_prefix_out(fake_measure) -> None:
    spec = _spec(freeze={"relayout": "repartition", "keep_trainable": 2}, microbatches=4)
    current = plan_layout(spec).layout  # 2x2
    sizes = profile_sizes(spec, world=4, boundary=3, current=current)
    assert sizes == {48 // 2 // 4}  # one shape: 2 stages x the current 2 replicas, m = 4
    planned = profile_mod.measured_layout(spec, world=4, boundary=3, current=current)
    assert fake_measure == [sizes]
    profiles = _profiles(8, sizes)
    expected = plan(
        profiles,
        devices=4,
        global_batch=48,
        cost=CostModel(freeze_boundary=3),
        microbatches=[4],
        stages=2,
        replicas=2,
        allowed_cuts=range(4, 8),
    )
    layout = planned.layout
    assert (layout.pipeline_ranks, layout.replicas, layout.microbatches) == (2, 2, 4)
    assert layout.freeze_boundary == 3 and layout.stages[0].start == 3  # the prefix left
    assert _ranges(layout) == [(max(a, 3), b) for a, b in expected.ranges]
    assert all(s.start > 3 for s in layout.stages[1:])  # cuts only after the boundary
    assert layout.planner == "autopipe" and layout.version == current.version + 1
    assert planned.reason == f"F=3: {expected.summary()} (repartition: 2 replica(s) kept)"
    # where elastic would choose another shape, repartition still keeps 2x2
    elastic = _spec(microbatches=4)
    shapes = {
        (p.layout.pipeline_ranks, p.layout.replicas)
        for f in range(1, 7)
        for p in [
            plan_layout(
                elastic,
                world=4,
                boundary=f,
                current=current,
                profiles=_profiles(8, profile_sizes(elastic, world=4, boundary=f)),
            )
        ]
    }
    assert shapes - {(2, 2)}, "elastic re-shapes the job somewhere"
    for f in range(1, 7):
        kept = plan_layout(
            spec,
            world=4,
            boundary=f,
            current=current,
            profiles=_profiles(8, profile_sizes(spec, world=4, boundary=f, current=current)),
        ).layout
        assert (kept.pipeline_ranks, kept.replicas) == (2, 2) and kept.stages[0].start == f
    # the replicas of the layout in force are kept, not the spec's
    one = plan_layout(spec, world=2, boundary=1, current=current).layout  # re-formed: 2x1
    assert (one.pipeline_ranks, one.replicas) == (2, 1)
    assert profile_sizes(spec, world=2, boundary=3, current=one) == {48 // 4}
    after = plan_layout(spec, world=2, boundary=3, current=one, profiles=_profiles(8, {12}))
    assert (after.layout.pipeline_ranks, after.layout.replicas) == (2, 1)
    with pytest.raises(ValueError, match="pass current"):
        profile_sizes(spec, world=4, boundary=3)


def test_repartition_needs_an_active_block_per_stage() -> None:
    # the spec check (keep_trainable >= stages) holds for the spec's shape; a re-formed world
    # may be deeper, and then the planner says why it cannot keep every stage
    spec = _spec(freeze={"relayout": "repartition", "keep_trainable": 2}, microbatches=4)
    deep = Layout.build([(0, 2), (2, 4), (4, 6), (6, 8)], num_blocks=8, replicas=1, microbatches=4)
    message = r"keeps 1 replica\(s\) of 4 stage\(s\) on 4 worker\(s\).*leaves 2 of 8 blocks active"
    with pytest.raises(PlanError, match=message):
        profile_sizes(spec, world=4, boundary=6, current=deep)
    with pytest.raises(PlanError, match="keep_trainable to at least 4"):
        plan_layout(spec, world=4, boundary=6, current=deep, profiles=_profiles(8, {12}))
    assert profile_sizes(spec, world=4, boundary=4, current=deep) == {12}  # 4 active: fits


# -- the measuring edge and the old entry points -------------------------------------------------


@pytest.fixture
def fake_measure(monkeypatch) -> list[set[int]]:
    asked: list[set[int]] = []

    def measure(model_spec, sizes, *args, **kwargs):
        asked.append(set(sizes))
        return _profiles(model_spec.depth, set(sizes))

    monkeypatch.setattr(profile_mod, "measure_profiles", measure)
    return asked


def test_measured_layout_measures_what_the_planner_asks_for(fake_measure) -> None:
    spec = _spec(microbatches=4)
    current = plan_layout(spec).layout
    planned = profile_mod.measured_layout(spec, world=4, boundary=2, current=current)
    assert fake_measure == [profile_sizes(spec, world=4, boundary=2)]
    direct = plan_layout(
        spec, world=4, boundary=2, current=current, profiles=_profiles(8, fake_measure[0])
    )
    assert planned == direct
