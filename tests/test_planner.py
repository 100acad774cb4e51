"""AutoPipe planner and measured profiles.

The planner's answers are checked against an exhaustive search that re-implements the cost model
of `core.partition`'s docstring from scratch (so a bug in the planner's range arithmetic cannot
hide behind the same bug in the check)."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetransformer.core.partition import (
    BlockProfile,
    CostModel,
    PlanError,
    Profile,
    evaluate_partition,
    microbatch_candidates,
    plan,
    profile_at,
    uniform_partition,
)
from pipetransformer.core.spec import ModelSpec
from pipetransformer.core.state import Layout
from pipetransformer.models.seeded import init_unit
from pipetransformer.trainer import profile as profile_mod
from pipetransformer.trainer.profile import measure_profile, measure_profiles, profile_cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from baselines import (  # noqa: E402  (benchmark-only baselines live in bench/)
    choose_microbatches,
    compare_partitions,
    measured_plan,
    param_greedy_partition,
)

INF = math.inf

# ---------------------------------------------------------------------------------------------
# An independent implementation of the documented cost model, and exhaustive search over it.


def _stage(prof: Profile, a: int, c: int, s: int, S: int, m: int, cfg: dict) -> tuple[float, float]:
    """(time, memory) of stage s = blocks [a, c), straight from the docstring's definitions."""
    L, F = prof.num_blocks, cfg["F"]
    units = [(prof.embed, F == 0, None)] if a == 0 else []
    units += [(prof.blocks[j], j >= F, j) for j in range(a, c)]
    units += [(prof.head, True, None)] if c == L else []
    compute = 0.0
    for p, trains, j in units:
        if trains:
            compute += p.forward_s + p.backward_s
            if cfg["recompute"] and j is not None:
                compute += p.forward_s
        elif not cfg["cached"]:
            compute += p.forward_s

    def cut(j: int) -> float:  # the cut after block j
        if math.isinf(cfg["bw"]):
            return 0.0
        return prof.blocks[j].output_bytes * (2 if j >= F else 1) / cfg["bw"]

    transfer = (cut(a - 1) if a > 0 else 0.0) + (cut(c - 1) if c < L else 0.0)
    in_flight = min(m, S - s) if cfg["schedule"] == "1f1b" else m
    weights = sum(p.param_bytes * (4.0 if trains else 1.0) for p, trains, _ in units)
    act, peak = 0.0, 0.0
    for p, trains, j in units:
        if not trains:
            continue
        if cfg["recompute"] and j is not None:
            act += (prof.blocks[j - 1] if j > 0 else prof.embed).output_bytes
            peak = max(peak, p.activation_bytes)
        else:
            act += p.activation_bytes
    return compute + transfer, weights + act * in_flight + peak


def _partitions(L: int, S: int, cuts: list[int]):
    for chosen in itertools.combinations(cuts, S - 1):
        bounds = (0, *chosen, L)
        yield list(itertools.pairwise(bounds))


def _brute_bottleneck(prof: Profile, S: int, m: int, cuts: list[int], cfg: dict) -> float | None:
    best = None
    for ranges in _partitions(prof.num_blocks, S, cuts):
        stages = [_stage(prof, a, c, s, S, m, cfg) for s, (a, c) in enumerate(ranges)]
        if any(mem > cfg["cap"] for _, mem in stages):
            continue
        worst = max(t for t, _ in stages)
        best = worst if best is None else min(best, worst)
    return best


units = st.builds(
    BlockProfile,
    forward_s=st.floats(0.01, 10.0),
    backward_s=st.floats(0.0, 20.0),
    output_bytes=st.integers(0, 10**6),
    param_bytes=st.integers(0, 10**6),
    activation_bytes=st.integers(0, 10**6),
)


@st.composite
def profiles(draw, min_blocks: int = 1, max_blocks: int = 10) -> Profile:
    blocks = draw(st.lists(units, min_size=min_blocks, max_size=max_blocks))
    return Profile(tuple(blocks), draw(units), draw(units), microbatch=draw(st.integers(1, 8)))


@st.composite
def configs(draw, L: int) -> dict:
    return {
        "F": draw(st.integers(0, L)),
        "cached": draw(st.booleans()),
        "bw": draw(st.sampled_from([INF, 1e5, 1e6])),
        "schedule": draw(st.sampled_from(["gpipe", "1f1b"])),
        "recompute": draw(st.booleans()),
        "cap": INF,
    }


def _cost(cfg: dict) -> CostModel:
    return CostModel(
        freeze_boundary=cfg["F"],
        cached=cfg["cached"],
        bandwidth=cfg["bw"],
        schedule=cfg["schedule"],
        recompute=cfg["recompute"],
        memory_cap=cfg["cap"],
    )


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_planner_equals_exhaustive_search(data: st.DataObject) -> None:
    prof = data.draw(profiles())
    L = prof.num_blocks
    cfg = data.draw(configs(L))
    S = data.draw(st.integers(1, min(4, L)))
    m = data.draw(st.integers(1, 4))
    # residual units spanning several blocks: cuts only where the drawn set allows
    cuts = sorted(data.draw(st.sets(st.integers(1, L - 1))) if L > 1 else set())
    if data.draw(st.integers(0, 3)):
        # a cap from 15% to 110% of the whole model on one device, so it binds in many examples;
        # integral caps and byte counts keep memory sums exact ("fits" is not a rounding call)
        whole = sum(u.param_bytes * 4 + u.activation_bytes * m for u in (prof.embed, *prof.blocks))
        cfg["cap"] = float(whole * data.draw(st.integers(15, 110)) // 100)
    if len(cuts) < S - 1:
        with pytest.raises(PlanError):
            plan(prof, devices=S, stages=S, global_batch=m * prof.microbatch, allowed_cuts=cuts)
        return
    expected = _brute_bottleneck(prof, S, m, cuts, cfg)
    kwargs = dict(
        devices=S,
        stages=S,
        replicas=1,
        microbatches=[m],
        global_batch=m * prof.microbatch,
        allowed_cuts=cuts,
        cost=_cost(cfg),
    )
    if expected is None:
        with pytest.raises(PlanError, match="does not fit"):
            plan(prof, **kwargs)
        return
    got = plan(prof, **kwargs)
    assert got.bottleneck_s == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert got.stages == S and got.microbatches == m
    # whole units only, contiguous cover of every block
    assert [a for a, _ in got.ranges[1:]] == [c for _, c in got.ranges[:-1]]
    assert got.ranges[0][0] == 0 and got.ranges[-1][1] == L
    assert all(a in cuts for a, _ in got.ranges[1:])
    # never over the cap, by the independent model's count too
    for s, (a, c) in enumerate(got.ranges):
        t, mem = _stage(prof, a, c, s, S, m, cfg)
        assert mem <= cfg["cap"]
        assert mem == pytest.approx(got.stage_memory_bytes[s])
        assert t == pytest.approx(got.stage_time_s[s], rel=1e-9, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    times=st.lists(st.integers(1, 6), min_size=2, max_size=9),
    S=st.integers(2, 4),
    ends=st.tuples(st.integers(0, 3), st.integers(0, 3)),
)
def test_ties_keep_the_most_slack(times: list[int], S: int, ends: tuple[int, int]) -> None:
    """Among partitions with the same bottleneck the planner takes the one whose stage times,
    sorted in decreasing order, are lexicographically smallest (integral times: exact ties)."""
    if S > len(times):
        return
    prof = Profile(
        tuple(_unit(float(t), 0.0) for t in times),
        embed=_unit(float(ends[0]), 0.0),
        head=_unit(float(ends[1]), 0.0),
        microbatch=1,
    )
    cfg = {"F": 0, "cached": False, "bw": INF, "schedule": "gpipe", "recompute": False}
    best = min(
        sorted((_stage(prof, a, c, s, S, 1, cfg)[0] for s, (a, c) in enumerate(r)), reverse=True)
        for r in _partitions(len(times), S, list(range(1, len(times))))
    )
    got = plan(prof, devices=S, stages=S, global_batch=1)
    assert sorted(got.stage_time_s, reverse=True) == best


@settings(max_examples=60, deadline=None)
@given(
    prof=profiles(max_blocks=6),
    devices=st.integers(1, 4),
    global_batch=st.sampled_from([4, 6, 8, 12]),
    bw=st.sampled_from([INF, 1e6]),
)
def test_stage_replica_microbatch_search_equals_exhaustive(
    prof: Profile, devices: int, global_batch: int, bw: float
) -> None:
    """Over every S x R <= devices, every m the docstring allows and every partition, the planner
    finds the lowest predicted step time (m + S - 1) * bottleneck + ring all-reduce."""
    L = prof.num_blocks
    cfg = {"F": 0, "cached": False, "bw": bw, "schedule": "gpipe", "recompute": False, "cap": INF}
    best = INF
    for S in range(1, min(devices, L) + 1):
        for R in range(1, devices // S + 1):
            if global_batch % R:
                continue
            rb = global_batch // R
            divs = [d for d in range(1, rb + 1) if rb % d == 0]
            for m in [d for d in divs if S <= d <= 6 * S] or divs:
                scaled = profile_at(prof, rb // m)
                for ranges in _partitions(L, S, list(range(1, L))):
                    t = max(
                        _stage(scaled, a, c, s, S, m, cfg)[0] for s, (a, c) in enumerate(ranges)
                    )
                    ring = 0.0
                    if R > 1 and not math.isinf(bw):
                        ring = max(
                            2 * (R - 1) / R * _trainable_bytes(scaled, a, c) / bw for a, c in ranges
                        )
                    best = min(best, (m + S - 1) * t + ring)
    got = plan(prof, devices=devices, global_batch=global_batch, cost=CostModel(bandwidth=bw))
    assert got.step_time_s == pytest.approx(best, rel=1e-9)
    assert got.devices <= devices
    assert global_batch % (got.replicas * got.microbatches) == 0


def _trainable_bytes(prof: Profile, a: int, c: int) -> int:
    n = sum(b.param_bytes for b in prof.blocks[a:c])
    if a == 0:
        n += prof.embed.param_bytes
    if c == prof.num_blocks:
        n += prof.head.param_bytes
    return n


# ---------------------------------------------------------------------------------------------
# Specific behaviour


def _unit(f: float, b: float, out: int = 100, params: int = 1000, act: int = 10) -> BlockProfile:
    return BlockProfile(f, b, out, params, act)


def _toy(L: int = 4) -> Profile:
    return Profile(
        tuple(_unit(1.0, 2.0) for _ in range(L)),
        embed=_unit(0.5, 1.0, params=500),
        head=_unit(0.25, 0.5, params=50),
        microbatch=4,
    )


def test_frozen_blocks_cost_forward_only_or_nothing_when_cached() -> None:
    prof = _toy()
    one = dict(global_batch=4, microbatches=1)
    full = evaluate_partition(prof, [(0, 4)], **one)
    assert full.stage_compute_s[0] == pytest.approx(1.5 + 4 * 3.0 + 0.75)
    frozen = evaluate_partition(prof, [(0, 4)], cost=CostModel(freeze_boundary=2), **one)
    # embedding and blocks 0-1 forward only; blocks 2-3 and the head forward + backward
    assert frozen.stage_compute_s[0] == pytest.approx(0.5 + 2 * 1.0 + 2 * 3.0 + 0.75)
    cached = evaluate_partition(
        prof, [(0, 4)], cost=CostModel(freeze_boundary=2, cached=True), **one
    )
    assert cached.stage_compute_s[0] == pytest.approx(2 * 3.0 + 0.75)
    # frozen weights carry no gradient or optimizer state, and keep no activations
    assert frozen.stage_memory_bytes[0] == pytest.approx(
        500 + 2 * 1000 + 2 * 1000 * 4 + 50 * 4 + (2 * 10 + 10)
    )
    # a cut inside the frozen prefix carries the activation forward only, no gradient back
    slow = CostModel(freeze_boundary=2, bandwidth=100.0)
    split = evaluate_partition(prof, [(0, 1), (1, 4)], cost=slow, **one)
    assert split.stage_transfer_s == (1.0, 1.0)
    split = evaluate_partition(prof, [(0, 3), (3, 4)], cost=slow, **one)
    assert split.stage_transfer_s == (2.0, 2.0)


def test_freezing_moves_blocks_onto_the_first_stage() -> None:
    prof = _toy(8)
    before = plan(prof, devices=2, stages=2, global_batch=8)
    after = plan(prof, devices=2, stages=2, global_batch=8, cost=CostModel(freeze_boundary=4))
    assert after.ranges[0][1] > before.ranges[0][1]
    assert after.bottleneck_s < before.bottleneck_s


def test_infeasible_request_names_the_numbers() -> None:
    prof = _toy()
    with pytest.raises(PlanError) as err:
        plan(prof, devices=2, global_batch=8, cost=CostModel(memory_cap=3000))
    msg = str(err.value)
    assert "does not fit" in msg and "3,000 B" in msg
    # the per-stage needs are listed, and the over-cap stage is marked
    assert "stage 0 blocks" in msg and "(over)" in msg
    with pytest.raises(PlanError, match="freeze boundary 9"):
        plan(prof, devices=2, global_batch=8, cost=CostModel(freeze_boundary=9))
    with pytest.raises(PlanError, match="divides global batch"):
        plan(prof, devices=2, global_batch=8, microbatches=[3])


def test_memory_cap_can_force_a_different_split() -> None:
    # block 0 holds huge activations: unconstrained, the time balance puts 2 blocks with it
    blocks = (_unit(1.0, 2.0, act=10_000), *(_unit(1.0, 2.0) for _ in range(3)))
    prof = Profile(blocks, _unit(0.0, 0.0, params=0, act=0), _unit(0.0, 0.0, params=0, act=0), 1)
    free = plan(prof, devices=2, stages=2, global_batch=4, microbatches=[4])
    assert free.ranges == ((0, 2), (2, 4))
    tight = plan(
        prof,
        devices=2,
        stages=2,
        global_batch=4,
        microbatches=[4],
        cost=CostModel(memory_cap=4 * 10_000 + 8000),
    )
    assert tight.ranges == ((0, 1), (1, 4))
    assert max(tight.stage_memory_bytes) <= 4 * 10_000 + 8000
    # 1F1B holds 2 micro-batches on the first of 2 stages where GPipe holds all 4
    cap = 2 * 10_000 + 4000 + 1000
    one_f_one_b = dict(devices=2, stages=2, global_batch=4, microbatches=[4])
    cost = CostModel(schedule="1f1b", memory_cap=cap)
    assert plan(prof, cost=cost, **one_f_one_b).ranges == ((0, 1), (1, 4))
    with pytest.raises(PlanError, match="does not fit"):
        plan(prof, cost=CostModel(schedule="gpipe", memory_cap=cap), **one_f_one_b)


def test_plan_to_layout() -> None:
    frozen = CostModel(freeze_boundary=2)
    p = plan(_toy(8), devices=4, stages=2, replicas=2, global_batch=16, cost=frozen)
    layout = p.to_layout(version=3)
    assert layout.version == 3 and layout.freeze_boundary == 2
    assert [s.ranks for s in layout.stages] == [[0, 2], [1, 3]]
    assert [(s.start, s.end) for s in layout.stages] == list(p.ranges)
    assert layout.microbatches == p.microbatches and layout.replicas == 2
    assert Layout.model_validate_json(layout.model_dump_json()) == layout


def test_planner_prefers_fewer_stages_when_the_bubble_costs_more() -> None:
    # 4 devices, no bandwidth cost: data parallelism has no bubble, so 1 stage x 4 replicas wins
    p = plan(_toy(8), devices=4, global_batch=16)
    assert (p.stages, p.replicas) == (1, 4)
    # with a slow link, the all-reduce of a replica's full weights costs more than the bubble
    p = plan(_toy(8), devices=4, global_batch=16, cost=CostModel(bandwidth=1e3))
    assert p.stages > 1


@settings(max_examples=60, deadline=None)
@given(prof=profiles(), stages=st.integers(1, 4), frozen=st.integers(0, 10))
def test_baselines_are_valid_partitions(prof: Profile, stages: int, frozen: int) -> None:
    L = prof.num_blocks
    if stages > L:
        with pytest.raises(PlanError):
            uniform_partition(L, stages)
        return
    for ranges in (
        uniform_partition(L, stages),
        param_greedy_partition(prof, stages, min(frozen, L)),
    ):
        assert len(ranges) == stages and ranges[0][0] == 0 and ranges[-1][1] == L
        assert all(a < c for a, c in ranges)
        assert all(r1[1] == r2[0] for r1, r2 in itertools.pairwise(ranges))


def test_param_greedy_follows_parameters_not_time() -> None:
    # a BERT-like embedding: many parameters, almost no compute
    prof = Profile(
        tuple(_unit(1.0, 2.0) for _ in range(6)),
        embed=_unit(0.01, 0.01, params=3000),
        head=_unit(0.01, 0.01, params=10),
        microbatch=1,
    )
    assert param_greedy_partition(prof, 2) == [(0, 2), (2, 6)]
    assert uniform_partition(6, 2) == [(0, 3), (3, 6)]
    plans = compare_partitions(prof, 2, global_batch=4, microbatches=4)
    assert plans["autopipe"].ranges == ((0, 3), (3, 6))
    assert plans["autopipe"].bottleneck_s < plans["param_greedy"].bottleneck_s
    # PipeTransformer puts frozen blocks on stage 0, each weighted at 1/6 of its parameters
    assert param_greedy_partition(prof, 2, freeze_boundary=3)[0][1] >= 3


def test_profile_interpolation() -> None:
    def at(b: int, fixed: float) -> Profile:
        u = _unit(fixed + b, 2 * (fixed + b), out=10 * b, act=5 * b)
        return Profile((u, u), u, u, microbatch=b)

    two = {2: at(2, 3.0), 8: at(8, 3.0)}
    assert profile_at(two, 4).blocks[0].forward_s == pytest.approx(7.0)  # affine: fixed cost kept
    assert profile_at(two, 16).blocks[0].output_bytes == 160  # extrapolated
    assert profile_at(at(2, 0.0), 6).blocks[0].forward_s == pytest.approx(6.0)  # proportional
    assert profile_at(two, 8) is two[8]


def test_microbatch_candidates() -> None:
    assert microbatch_candidates(2, 64) == [2, 4, 8]
    assert microbatch_candidates(3, 64) == [4, 8, 16]
    assert microbatch_candidates(4, 2) == [1, 2]  # none in [S, 6S]: every divisor


# ---------------------------------------------------------------------------------------------
# Measured profiles and micro-batch choice (tiny real models)

TINY = {
    "vit": ModelSpec(image_size=4, patch_size=2, dim=16, depth=2, heads=2, num_classes=3),
    "bert": ModelSpec(family="bert", vocab_size=50, seq_len=6, dim=16, depth=2, heads=2),
}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("family", sorted(TINY))
def test_measure_profile_and_cache_round_trip(family: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path))
    spec = TINY[family]
    prof = measure_profile(spec, 3, device="cpu", repeats=2, warmup=1)
    assert prof.num_blocks == spec.depth and prof.microbatch == 3
    for u in (prof.embed, *prof.blocks, prof.head):
        assert u.forward_s > 0 and u.backward_s > 0 and u.param_bytes > 0
    tokens = 5 if family == "vit" else 7
    assert prof.blocks[0].output_bytes == 3 * tokens * 16 * 4
    assert prof.head.output_bytes == 3 * spec.num_classes * 4
    assert prof.blocks[0].activation_bytes > prof.blocks[0].output_bytes
    assert prof.blocks[0] == prof.blocks[1]  # identical blocks: pooled times
    block_params = sum(p.numel() for p in init_unit(spec, 0, "blocks.0").parameters())
    assert prof.blocks[0].param_bytes == 4 * block_params
    files = list((tmp_path / "profiles").glob("*.json"))
    assert profile_cache_dir() == tmp_path / "profiles" and len(files) == 1

    def no_measuring(*args, **kwargs):
        raise AssertionError("the cached profile should have been used")

    monkeypatch.setattr(profile_mod, "_measure", no_measuring)
    assert measure_profile(spec, 3, device="cpu") == prof
    files[0].write_text("{torn")  # a corrupt entry is measured again, not trusted
    with pytest.raises(AssertionError, match="cached profile"):
        measure_profile(spec, 3, device="cpu")


def test_choose_microbatches_from_measurement(tmp_path) -> None:
    spec = TINY["vit"]
    S, batch = 2, 24
    sizes = {batch // m for m in (2, 3, 4, 6, 8, 12)}
    profiles = measure_profiles(spec, sizes, "cpu", repeats=2, warmup=1, profile_dir=tmp_path)
    m = choose_microbatches(spec, S, batch, profiles=profiles, device="cpu", profile_dir=tmp_path)
    assert batch % m == 0 and S <= m <= 6 * S


def test_choose_microbatches_trades_bubble_against_per_microbatch_overhead() -> None:
    spec = ModelSpec(depth=2)

    def measured(fixed: float) -> dict[int, Profile]:
        out = {}
        for b in (1, 2, 4, 8):
            u = _unit(fixed + 0.01 * b, fixed + 0.02 * b)
            out[b] = Profile((u, u), _unit(0, 0), _unit(0, 0), microbatch=b)
        return out

    # no fixed cost: finer micro-batches only shrink the bubble -> the most micro-batches
    assert choose_microbatches(spec, 2, 8, profiles=measured(0.0)) == 8
    # a large fixed cost per micro-batch: fewer, larger micro-batches win
    assert choose_microbatches(spec, 2, 8, profiles=measured(1.0)) == 2


def test_measured_plan_end_to_end(tmp_path) -> None:
    spec = TINY["bert"]
    p = measured_plan(
        spec, devices=2, global_batch=8, device="cpu", profile_dir=tmp_path, repeats=2
    )
    assert p.devices <= 2 and 8 % (p.replicas * p.microbatches) == 0
    layout = p.to_layout()
    assert layout.num_blocks == spec.depth and layout.world_size == p.devices
    # every micro-batch size the search can reach was measured once and cached
    assert len(list(tmp_path.glob("*.json"))) == 4
