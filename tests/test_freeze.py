"""AutoFreeze (core/freeze.py): the alpha-bound, the gradient-norm criterion, the output rule, the
schedule and off policies, manual overrides, spec validation and state serialisation."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetransformer.core.freeze import (
    AUTO_POLICY,
    FreezeDecision,
    FreezeOverrideError,
    FreezeState,
    GradNormMeter,
    alpha_bound,
    apply_override,
    automatic_cap,
    converged_prefix,
    decide,
    has_decayed,
    is_decision_point,
    output_rate,
    policy_in_force,
    settle_criterion,
    settled_prefix,
    update_peaks,
)
from pipetransformer.core.spec import FreezeSpec, SpecError, parse_spec

NAN = math.nan


def _spec(**kw) -> FreezeSpec:
    return FreezeSpec(**{"policy": "gradient", **kw})


def _run(spec: FreezeSpec, rounds: list[list[float]], num_blocks: int) -> list[FreezeDecision]:
    state, boundary, out = FreezeState(), 0, []
    for norms in rounds:
        d = decide(spec, state, norms, num_blocks, boundary=boundary)
        out.append(d)
        state, boundary = d.state, d.boundary
    return out


# ---------------------------------------------------------------- the alpha-bound


def test_alpha_bound_hand_values() -> None:
    assert [alpha_bound(0.5, 4, t) for t in range(5)] == [0, 2, 3, 4, 4]
    # 10 * (1 - 0.7) is 3.0000000000000004 in floating point: the bound is 3, not 4.
    assert alpha_bound(0.3, 10, 1) == 3
    assert [alpha_bound(0.25, 8, t) for t in range(5)] == [0, 2, 4, 5, 6]
    assert alpha_bound(0.01, 12, 1) == 1  # the ceiling lets any alpha > 0 freeze one block at T=1
    assert alpha_bound(0.9, 6, 10_000) == 6
    with pytest.raises(ValueError, match="alpha"):
        alpha_bound(1.0, 6, 1)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 99).map(lambda k: k / 100),
    st.integers(0, 64),
    st.integers(0, 30),
)
def test_alpha_bound_is_the_exact_ceiling(alpha: float, blocks: int, t: int) -> None:
    exact = blocks * (1 - (1 - Fraction(str(alpha))) ** t)
    got = alpha_bound(alpha, blocks, t)
    frac = exact - math.floor(exact)
    if frac == 0 or frac > Fraction(1, 10**8):  # outside the documented float guard
        assert got == math.ceil(exact)
    assert 0 <= got <= blocks
    assert alpha_bound(alpha, blocks, t + 1) >= got  # monotone in T


# ---------------------------------------------------------------- the gradient criterion


def test_decay_test_and_peaks_edges() -> None:
    assert has_decayed(2.0, 0.2, 0.1) and not has_decayed(2.0, 0.21, 0.1)
    assert has_decayed(0.0, 0.0, 0.1)  # no gradient, ever: nothing left to learn
    assert not has_decayed(NAN, 0.0, 0.1)  # unknown peak
    assert not has_decayed(1.0, NAN, 0.1) and not has_decayed(1.0, math.inf, 0.1)
    assert has_decayed(1.0, 1.0, 1.0)  # threshold 1: every block counts as converged
    peaks = update_peaks(None, [1.0, NAN, 2.0])
    assert peaks[0] == 1.0 and math.isnan(peaks[1]) and peaks[2] == 2.0
    assert update_peaks(peaks, [0.5, 3.0, math.inf]) == (1.0, 3.0, 2.0)


def test_gradient_freezes_exactly_the_converged_prefix() -> None:
    # alpha 0.99 makes the alpha-bound loose (T=2: ceil(6 * 0.9999) = 6); the cap is 5.
    spec = _spec(alpha=0.99, threshold=0.1, keep_trainable=1)
    rounds = [
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # T=1: every norm is its own peak: nothing has decayed
        [0.1, 2.0, 1.0, 1.0, 1.0, 1.0],  # T=2: block 0 at 0.1 x its peak; block 1 peaks at 2
        [9.0, 0.2, 0.09, 1.0, 0.05, 0.0],  # T=3: 1 (0.1 x 2) and 2 decayed, 3 not; 0 is frozen
        [9.0, 9.0, 9.0, 0.1, 0.1, 0.1],  # T=4: everything decayed; the cap keeps block 5
    ]
    got = _run(spec, rounds, 6)
    assert [d.boundary for d in got] == [0, 1, 3, 5]
    assert [d.source for d in got] == ["none", "auto", "auto", "auto"]
    assert [d.proposed for d in got] == [0, 1, 3, 6]
    assert "clipped to 5" in got[3].reason and got[3].state.decisions == 4
    assert "0.1 x its peak" in got[1].reason
    # the state carries the peaks, frozen blocks included
    assert got[3].state.peak_norms == (9.0, 9.0, 9.0, 1.0, 1.0, 1.0)


def test_decay_is_measured_against_the_peak() -> None:
    # block 0 grows before it shrinks (as the digits ViT's first block does), then halves at
    # every decision point: converged once at 0.25 x its peak of 4 (T=4)
    # decision point; against its first norm (1) it would not have converged even at T=5, and a
    # relative change of 50 % per decision point never passes the old change test
    spec = _spec(alpha=0.99, threshold=0.25)
    got = _run(spec, [[1.0, 1.0], [4.0, 1.0], [2.0, 0.1], [1.0, 0.1], [0.5, 0.1]], 2)
    assert [d.boundary for d in got] == [0, 0, 0, 1, 1]


def test_converged_block_after_an_unconverged_one_is_not_frozen() -> None:
    spec = _spec(alpha=0.99, threshold=0.1)
    got = _run(spec, [[1.0, 1.0, 1.0, 1.0], [1.0, 0.01, 0.01, 0.01], [0.01, 0.5, 0.01, 0.01]], 4)
    assert [d.boundary for d in got] == [0, 0, 1]
    assert converged_prefix([1, 1, 1], [1, 0.05, 0.05], 0.1) == 0
    assert converged_prefix([1, 1, 1], [0.05, 0.5, 0.05], 0.1) == 1
    assert converged_prefix([1, 1, 1], [1, 1, 0.05], 0.1, boundary=2) == 3
    assert converged_prefix([1, 1, 1], [NAN, 0.05, 0.05], 0.1) == 0


def test_steady_norms_never_freeze() -> None:
    # the old relative-change test froze a block whose norm merely stopped changing; a block
    # whose gradient has not decayed from its peak still has something to learn
    got = _run(_spec(alpha=0.99), [[1.0] * 6] * 10, 6)
    assert all(d.boundary == 0 for d in got)


def test_gradient_is_clipped_by_the_alpha_bound() -> None:
    spec = _spec(alpha=0.25, keep_trainable=1, threshold=0.1)
    decaying = [[100.0**-t] * 8 for t in range(5)]  # every block decayed from T=2 on
    got = _run(spec, decaying, 8)
    # alpha-bounds 2, 4, 5, 6, 7 from T=1; T=1 is every block's peak, so nothing freezes there.
    assert [d.boundary for d in got] == [0, 4, 5, 6, 7]
    assert [d.bound for d in got] == [2, 4, 5, 6, 7]
    for t, d in enumerate(got, start=1):
        assert d.boundary <= alpha_bound(0.25, 8, t)


def test_warmup_decisions_delay_freezing_and_the_bound_restarts_after_them() -> None:
    spec = _spec(alpha=0.25, warmup_decisions=2, threshold=0.1)
    got = _run(spec, [[1.0] * 8] + [[0.01] * 8] * 4, 8)
    # alpha-bounds 2, 4, 5 at T' = 1, 2, 3 after warm-up: gradual, not 5 at once
    assert [d.boundary for d in got] == [0, 0, 2, 4, 5]
    assert "warm-up" in got[1].reason
    sched = _run(FreezeSpec(policy="schedule", alpha=0.25, warmup_decisions=2), [[1.0] * 8] * 5, 8)
    assert [d.boundary for d in sched] == [0, 0, 2, 4, 5]


def test_peaks_survive_warm_up_schedule_and_overrides() -> None:
    # peaks are recorded at every decision point that has norms, whatever the policy decides
    spec = _spec(alpha=0.99, warmup_decisions=2, threshold=0.1)
    d = decide(spec, FreezeState(), [5.0, 5.0, 5.0], 3, boundary=0)  # warm-up
    d = decide(spec, d.state, [1.0, 1.0, 1.0], 3, boundary=d.boundary, override=1)  # manual
    state, boundary = d.state, d.boundary
    assert state.peak_norms == (5.0, 5.0, 5.0)
    # block 1 has not decayed to 0.1 x its peak 5
    d = decide(spec, state, [0.5, 0.6, 0.5], 3, boundary=boundary)
    assert d.boundary == 1 and d.proposed == 1
    sched = decide(FreezeSpec(policy="schedule"), state, None, 3, boundary=boundary).state
    assert sched.peak_norms == state.peak_norms  # no norms: peaks unchanged


def test_a_state_without_peaks_uses_its_last_norms() -> None:
    # a state saved before peaks were kept (or rebuilt from the last norms only): the last norms
    # stand in for the peaks; that can only delay freezing
    old = FreezeState.from_dict({"boundary": 0, "decisions": 3, "last_norms": [4.0, 4.0]})
    assert old.peak_norms is None
    spec = _spec(alpha=0.99, threshold=0.2)
    d = decide(spec, old, [0.5, 0.3], 2, boundary=0)
    assert d.state.peak_norms == (4.0, 4.0) and d.boundary == 1
    d = decide(spec, FreezeState(3), [0.5, 0.3], 2, boundary=0)
    assert d.boundary == 0 and d.state.peak_norms == (0.5, 0.3)


def test_decide_input_errors() -> None:
    spec = _spec()
    with pytest.raises(ValueError, match="one per block"):
        decide(spec, FreezeState(), [1.0, 1.0], 3, boundary=0)
    with pytest.raises(ValueError, match="needs block_grad_norms"):
        decide(spec, FreezeState(), None, 3, boundary=0)
    with pytest.raises(ValueError, match=r"block_grad_norms\[1\].*negative"):
        decide(spec, FreezeState(), [1.0, -1.0, 1.0], 3, boundary=0)
    with pytest.raises(ValueError, match="outside a model of 3 blocks"):
        decide(spec, FreezeState(), [1.0] * 3, 3, boundary=4)
    # non-finite norms are not errors: they count as not converged
    d = decide(spec, FreezeState(1, (1.0, 1.0, 1.0)), [0.0, NAN, 1.0], 3, boundary=1)
    assert d.boundary == 1 and d.source == "none"


# ---------------------------------------------------------------- properties over sequences

_NORM = st.sampled_from([0.0, 1.0, 1.02, 1.5, 2.0, NAN])


@st.composite
def _scenario(draw):
    blocks = draw(st.integers(2, 12))
    spec = FreezeSpec(
        policy=draw(st.sampled_from(["gradient", "schedule", "off"])),
        alpha=draw(st.floats(0.01, 0.99)),
        keep_trainable=draw(st.integers(1, blocks - 1)),
        threshold=draw(st.sampled_from([0.01, 0.05, 0.1, 0.5])),
        warmup_decisions=draw(st.integers(0, 3)),
    )
    steps = draw(
        st.lists(
            st.tuples(
                st.lists(_NORM, min_size=blocks, max_size=blocks),
                st.none() | st.integers(-2, blocks + 2),
            ),
            max_size=12,
        )
    )
    return blocks, spec, steps


@settings(max_examples=250, deadline=None)
@given(_scenario())
def test_boundary_never_decreases_and_automatic_respects_the_bounds(scenario) -> None:
    blocks, spec, steps = scenario
    state, boundary = FreezeState(), 0
    manual_seen = False
    seen: list[list[float]] = [[] for _ in range(blocks)]  # finite norms so far, per block
    for norms, override in steps:
        for i, n in enumerate(norms):
            if math.isfinite(n):
                seen[i].append(n)
        before = state.to_dict()
        d = decide(spec, state, norms, blocks, boundary=boundary, override=override)
        assert state.to_dict() == before  # decide is pure
        if override is not None:
            auto = decide(spec, state, norms, blocks, boundary=boundary)
            valid = 0 <= override <= blocks - spec.keep_trainable
            # never less than the automatic decision; more only by an applied request
            assert d.boundary == (max(auto.boundary, override) if valid else auto.boundary)
            want = (
                "rejected" if not valid else "applied" if override > auto.boundary else "superseded"
            )
            assert d.override == want, (d.override, d.override_reason)
            if want == "applied":
                assert d.source == "manual" and d.boundary == override
                assert d.state == auto.state  # the request changes the boundary, not the policy
                manual_seen = True
            else:
                assert (d.boundary, d.source, d.state) == (auto.boundary, auto.source, auto.state)
        else:
            assert d.override is None
        t = state.decisions + 1
        cap = automatic_cap(spec, blocks, t)
        assert d.state.decisions == t and d.previous == boundary
        assert d.boundary >= boundary  # never decreases
        assert d.boundary <= blocks - spec.keep_trainable
        if d.source == "auto":
            assert boundary < d.boundary <= cap
            if spec.policy == "gradient":  # every newly frozen block has decayed from its peak
                for i in range(boundary, d.boundary):
                    assert seen[i] and math.isfinite(norms[i])
                    assert norms[i] <= spec.threshold * max(seen[i])
        peaks = d.state.peak_norms
        assert peaks is not None and len(peaks) == blocks
        for i in range(blocks):  # the peak is the largest finite norm seen (NaN while none)
            assert peaks[i] == max(seen[i]) if seen[i] else math.isnan(peaks[i])
        if d.source == "none":
            assert d.boundary == boundary
        if not manual_seen:  # purely automatic history: within the alpha-bound at every T
            assert d.boundary <= alpha_bound(spec.alpha, blocks, t)
            if spec.policy == "off":
                assert d.boundary == 0
            assert d.boundary <= alpha_bound(spec.alpha, blocks, max(0, t - spec.warmup_decisions))
            if spec.policy == "schedule":
                assert d.boundary == (cap if t > spec.warmup_decisions else 0)
        assert decide(spec, state, norms, blocks, boundary=boundary).state.decisions == t
        state, boundary = d.state, d.boundary
        text = json.dumps(state.to_dict(), allow_nan=False)
        assert FreezeState.from_dict(json.loads(text)).to_dict() == state.to_dict()


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 40),
    st.floats(0.01, 0.99),
    st.integers(1, 5),
    st.integers(0, 3),
    st.integers(1, 25),
)
def test_schedule_follows_the_bound_exactly(blocks, alpha, keep, warmup, rounds) -> None:
    spec = FreezeSpec(policy="schedule", alpha=alpha, keep_trainable=keep, warmup_decisions=warmup)
    state, boundary = FreezeState(), 0
    for t in range(1, rounds + 1):
        d = decide(spec, state, None, blocks, boundary=boundary)
        state, boundary = d.state, d.boundary
        want = (
            min(alpha_bound(alpha, blocks, t - warmup), max(0, blocks - keep)) if t > warmup else 0
        )
        assert boundary == want


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.lists(st.lists(_NORM, min_size=20, max_size=20), max_size=10))
def test_off_never_freezes(blocks, rounds) -> None:
    spec = FreezeSpec(policy="off", alpha=0.99)
    state, boundary = FreezeState(), 0
    for norms in rounds:
        d = decide(spec, state, norms[:blocks], blocks, boundary=boundary)
        assert d.boundary == 0 and d.source == "none" and "policy 'off'" in d.reason
        state, boundary = d.state, d.boundary


# ---------------------------------------------------------------- manual override


def test_override_error_messages() -> None:
    with pytest.raises(FreezeOverrideError, match="only move forward") as info:
        apply_override(3, 2, 6, 1)
    assert "layers=2" in str(info.value) and "allowed: 3..5" in str(info.value)
    with pytest.raises(FreezeOverrideError) as info:
        apply_override(3, 6, 6, 1)
    msg = str(info.value)
    assert "layers=6" in msg and "freeze.keep_trainable" in msg and "allowed: 3..5" in msg
    with pytest.raises(FreezeOverrideError, match=">= 0"):
        apply_override(0, -1, 6, 1)
    with pytest.raises(FreezeOverrideError, match="integer"):
        apply_override(0, 2.0, 6, 1)  # type: ignore[arg-type]
    with pytest.raises(FreezeOverrideError, match=r"allowed: 5\.\.5"):
        apply_override(5, 6, 6, 1)
    with pytest.raises(FreezeOverrideError, match="no further freezing"):
        apply_override(5, 6, 6, 2)  # a checkpoint frozen past a since-raised keep_trainable
    assert isinstance(FreezeOverrideError("x"), ValueError)
    assert apply_override(3, 3, 6, 1) == 3 and apply_override(0, 5, 6, 1) == 5


def test_override_moves_past_the_automatic_decision_and_is_not_alpha_bounded() -> None:
    spec = _spec(alpha=0.1, keep_trainable=2)
    state = FreezeState(1, (1.0,) * 12)
    assert automatic_cap(spec, 12, 2) == 3
    # far beyond the alpha-bound of 3
    d = decide(spec, state, [1.0] * 12, 12, boundary=1, override=9)
    assert (d.boundary, d.source, d.state.decisions, d.override) == (9, "manual", 2, "applied")
    assert "manual override" in d.reason and "automatic decision: 1" in d.reason
    # later automatic decisions keep it (never decrease) and the cap still holds
    d2 = decide(spec, d.state, [1.0] * 12, 12, boundary=d.boundary)
    assert d2.boundary == 9 and d2.source == "none" and d2.override is None
    d3 = decide(spec, d2.state, [1.0] * 12, 12, boundary=d2.boundary, override=10)
    assert (d3.boundary, d3.override) == (10, "applied")
    d4 = decide(spec, d3.state, [1.0] * 12, 12, boundary=d3.boundary, override=11)
    assert (d4.boundary, d4.override) == (10, "rejected") and "keep_trainable" in d4.override_reason


def test_an_override_never_takes_the_place_of_the_automatic_decision() -> None:
    # filed at F=3 for 4 blocks; read at the decision point where the schedule moves to 4
    spec = FreezeSpec(policy="schedule", alpha=0.5)
    state = FreezeState(1)
    assert decide(spec, state, None, 6, boundary=3).boundary == 5  # the schedule alone: 5
    d = decide(spec, state, None, 6, boundary=3, override=4)
    assert (d.boundary, d.source, d.override) == (5, "auto", "superseded")
    assert "automatic decision reached 5" in d.override_reason
    # read one decision point later, when the boundary had already passed it
    later = decide(spec, d.state, None, 6, boundary=d.boundary, override=4)
    assert (later.boundary, later.override) == (5, "superseded")
    assert "already 5" in later.override_reason and later.state.decisions == 3
    # equal to the current boundary: superseded, and the automatic step still happens
    grad = _spec(alpha=0.99, threshold=0.5)
    peaked = FreezeState(1, (4.0,) * 6, (4.0,) * 6)
    d = decide(grad, peaked, [1.0, 1.0, 1.0, 4.0, 4.0, 4.0], 6, boundary=1, override=1)
    assert (d.boundary, d.source, d.override) == (3, "auto", "superseded")


def test_override_applies_under_policy_off() -> None:
    d = decide(FreezeSpec(policy="off"), FreezeState(), None, 6, boundary=0, override=4)
    assert (d.boundary, d.source, d.override) == (4, "manual", "applied")


def test_rejected_override_keeps_the_automatic_decision() -> None:
    spec = _spec()
    state = FreezeState(4, (1.0, 2.0, NAN, 4.0, 5.0, 6.0))
    snapshot = state.to_dict()
    auto = decide(spec, state, [1.0] * 6, 6, boundary=3)
    for bad in (6, -1, 2.5, True, "4"):
        d = decide(spec, state, [1.0] * 6, 6, boundary=3, override=bad)
        assert d.override == "rejected", bad
        assert (d.boundary, d.state) == (auto.boundary, auto.state)
    behind = decide(spec, state, [1.0] * 6, 6, boundary=3, override=2)  # behind F=3
    assert behind.override == "superseded"
    assert state.to_dict() == snapshot


# ---------------------------------------------------------------- spec validation


def _problems(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec({"name": "x", **data})
    return dict(info.value.problems)


def test_spec_defaults_leave_jobs_unchanged() -> None:
    spec = parse_spec({"name": "x"})
    assert spec.freeze == FreezeSpec()
    assert (spec.freeze.policy, spec.freeze.every, spec.freeze.keep_trainable) == (
        "off",
        "epoch",
        1,
    )
    assert parse_spec({"name": "x", "freeze": {"every": 50}}).freeze.every == 50
    # with freezing off, keep_trainable does not constrain the model
    assert parse_spec({"name": "x", "freeze": {"keep_trainable": 9}}).freeze.keep_trainable == 9


@pytest.mark.parametrize(
    ("freeze", "field", "phrase"),
    [
        ({"policy": "sometimes"}, "freeze.policy", "'gradient', 'schedule' or 'off'"),
        ({"alpha": 0}, "freeze.alpha", "greater than 0"),
        ({"alpha": 1}, "freeze.alpha", "less than 1"),
        ({"every": 0}, "freeze.every", "'epoch' or a positive whole number"),
        ({"every": "weekly"}, "freeze.every", "'epoch' or a positive whole number"),
        ({"keep_trainable": 0}, "freeze.keep_trainable", "greater than 0"),
        ({"threshold": 0}, "freeze.threshold", "greater than 0"),
        ({"criterion": "level"}, "freeze.criterion", "'auto', 'decay' or 'noise'"),
        ({"noise_ratio": 0}, "freeze.noise_ratio", "greater than 0"),
        ({"warmup_decisions": -1}, "freeze.warmup_decisions", "greater than or equal to 0"),
        ({"alhpa": 0.3}, "freeze.alhpa", "unknown field"),
    ],
)
def test_spec_errors_name_the_field(freeze: dict, field: str, phrase: str) -> None:
    problems = _problems({"freeze": freeze})
    assert phrase in problems[field]


def test_keep_trainable_must_leave_a_freezable_block() -> None:
    msg = _problems({"model": {"depth": 4}, "freeze": {"policy": "gradient", "keep_trainable": 4}})[
        "freeze.keep_trainable"
    ]
    assert "freeze.keep_trainable (4)" in msg and "model.depth (4)" in msg
    ok = parse_spec(
        {"name": "x", "model": {"depth": 4}, "freeze": {"policy": "schedule", "keep_trainable": 3}}
    )
    assert ok.freeze.keep_trainable == 3


# ---------------------------------------------------------------- serialisation and helpers


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 1000),
    st.none() | st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=20),
    st.none() | st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=20),
)
def test_state_round_trips_through_json(decisions, norms, peaks) -> None:
    state = FreezeState(
        decisions,
        None if norms is None else tuple(norms),
        None if peaks is None else tuple(peaks),
    )
    text = json.dumps(state.to_dict(), allow_nan=False)  # strict JSON for etcd and checkpoints
    back = FreezeState.from_dict(json.loads(text))
    assert back.decisions == decisions
    for sent, got in ((norms, back.last_norms), (peaks, back.peak_norms)):
        if sent is None:
            assert got is None
        else:
            want = [n if math.isfinite(n) else None for n in sent]
            assert [n if math.isfinite(n) else None for n in got] == want


def test_state_from_dict_rejects_malformed_input() -> None:
    with pytest.raises(ValueError, match="boundary"):
        FreezeState.from_dict({"boundary": -1})
    with pytest.raises(ValueError, match="decisions"):
        FreezeState.from_dict({"decisions": "3"})
    with pytest.raises(ValueError, match=r"last_norms\[1\]"):
        FreezeState.from_dict({"last_norms": [1.0, "x"]})
    with pytest.raises(ValueError, match=r"peak_norms must be a list"):
        FreezeState.from_dict({"peak_norms": "1.0"})
    with pytest.raises(ValueError, match="unknown"):
        FreezeState.from_dict({"boundry": 1})
    assert FreezeState.from_dict({}) == FreezeState()


def test_state_loads_a_legacy_boundary_and_drops_it() -> None:
    # states written before the boundary moved to the layout carry "boundary": accepted, ignored
    legacy = {"boundary": 3, "decisions": 4, "last_norms": [1.0, None], "peak_norms": [2.0, None]}
    state = FreezeState.from_dict(legacy)
    assert state.decisions == 4 and state.last_norms is not None and state.peak_norms is not None
    assert state.last_norms[0] == 1.0 and math.isnan(state.last_norms[1])
    assert state.peak_norms[0] == 2.0 and math.isnan(state.peak_norms[1])
    assert state == FreezeState.from_dict({k: v for k, v in legacy.items() if k != "boundary"})
    assert not hasattr(state, "boundary")
    assert "boundary" not in state.to_dict()
    assert state.to_dict() == {k: v for k, v in legacy.items() if k != "boundary"}
    assert FreezeState.from_dict({"boundary": 7}) == FreezeState()
    # the boundary decide works from is the caller's (its layout's), whatever the legacy key said
    d = decide(FreezeSpec(policy="off"), state, None, 2, boundary=1)
    assert (d.previous, d.boundary) == (1, 1)


def test_decide_rejects_a_boundary_outside_the_model() -> None:
    spec, state = FreezeSpec(policy="schedule"), FreezeState()
    for bad in (-1, 7):
        with pytest.raises(ValueError, match=f"freeze boundary {bad} is outside a model of 6"):
            decide(spec, state, None, 6, boundary=bad)
    for bad in (2.0, True, None, "2"):
        with pytest.raises(ValueError, match="freeze boundary must be an integer"):
            decide(spec, state, None, 6, boundary=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        decide(spec, state, None, 6)  # type: ignore[call-arg]  # the boundary is required
    assert decide(spec, state, None, 6, boundary=6).boundary == 6  # the whole model: in range


def test_decision_points() -> None:
    epochly, every3 = FreezeSpec(), FreezeSpec(every=3)
    assert is_decision_point(epochly, 7, end_of_epoch=True)
    assert not is_decision_point(epochly, 7, end_of_epoch=False)
    assert [s for s in range(10) if is_decision_point(every3, s, False)] == [3, 6, 9]


def test_grad_norm_meter_means_and_round_trip() -> None:
    meter = GradNormMeter(3)
    assert all(math.isnan(n) for n in meter.means())
    meter.add([1.0, 0.0, 2.0])
    meter.add([3.0, 0.0, NAN])
    assert meter.means()[:2] == (2.0, 0.0) and math.isnan(meter.means()[2])
    back = GradNormMeter.from_dict(json.loads(json.dumps(meter.to_dict(), allow_nan=False)))
    assert back.steps == 2 and back.means()[:2] == (2.0, 0.0) and math.isnan(back.means()[2])
    with pytest.raises(ValueError, match="expected 3"):
        meter.add([1.0])
    meter.reset()
    assert meter.steps == 0


# ---------------------------------------------------------------- criterion 'noise'


def test_auto_criterion_follows_where_the_weights_come_from() -> None:
    assert settle_criterion(_spec(), from_trained=True) == "noise"
    assert settle_criterion(_spec(), from_trained=False) == "decay"
    assert settle_criterion(_spec(criterion="decay"), from_trained=True) == "decay"
    assert settle_criterion(_spec(criterion="noise"), from_trained=False) == "noise"


def test_settled_prefix_stops_at_the_first_block_still_drifting() -> None:
    assert settled_prefix([0.9, 1.2, 3.0, 0.5], 1.5) == 2
    assert settled_prefix([0.9, NAN, 0.5], 1.5) == 1  # unknown counts as not settled
    assert settled_prefix([9.0, 9.0, 1.0, 9.0], 1.5, boundary=2) == 3  # frozen count as settled
    assert settled_prefix([1.5], 1.5) == 1  # at the ratio: settled


def test_rising_norms_freeze_under_noise_but_never_under_decay() -> None:
    """Fine-tuning's shape (core/freeze.py, "Why two criteria"): step norms rise every interval
    while the gradients are noise, so `decay` never fires and `noise` freezes at the alpha pace."""
    rounds = [[0.05 * t] * 8 for t in range(1, 6)]
    drift = [1.1, 0.9, 1.0, 1.2, 0.8, 1.3, 0.9, 6.0]  # the top block still has a direction
    decay = _run(_spec(criterion="decay"), rounds, 8)
    assert [d.boundary for d in decay] == [0] * 5
    spec, state, boundary, got = _spec(criterion="noise", alpha=0.25), FreezeState(), 0, []
    for norms in rounds:
        d = decide(spec, state, norms, 8, boundary=boundary, drift=drift)
        state, boundary = d.state, d.boundary
        got.append(d)
    assert [d.boundary for d in got] == [2, 4, 5, 6, 7]  # the alpha-bound: ceil(8 (1 - 0.75^T))
    assert [d.proposed for d in got] == [7] * 5  # block 7 is not settled, so never proposed
    assert "settled prefix 7" in got[0].reason and "1.5 x its noise" in got[0].reason
    # 'auto' is 'noise' only for a job that starts from trained weights
    d = decide(_spec(), FreezeState(), rounds[0], 8, boundary=0, drift=drift, from_trained=True)
    assert d.boundary == 2
    assert decide(_spec(), FreezeState(), rounds[0], 8, boundary=0, drift=drift).boundary == 0


def test_noise_needs_one_ratio_per_block() -> None:
    with pytest.raises(ValueError, match="one drift ratio per block"):
        decide(_spec(criterion="noise"), FreezeState(), [1.0] * 4, 4, boundary=0, drift=[1.0])
    with pytest.raises(ValueError, match="one drift ratio per block"):
        decide(_spec(criterion="noise"), FreezeState(), [1.0] * 4, 4, boundary=0)


# -- policy 'output': what the blocks compute ------------------------------------------------------


def _output(rounds: list[list[float]], **kw) -> list[FreezeDecision]:
    spec = FreezeSpec(**{"policy": "output", "alpha": 0.5, "keep_trainable": 1, **kw})
    state, boundary, out = FreezeState(), 0, []
    for rates in rounds:
        d = decide(spec, state, None, len(rates), boundary=boundary, output_rates=rates)
        state, boundary = d.state, d.boundary
        out.append(d)
    return out


def test_output_rate_is_the_relative_change_per_unit_of_learning_rate() -> None:
    assert output_rate(2.0, 10.0, 0.5) == pytest.approx(0.4)
    # half the learning rate and half the movement: the same rate (a decay is not convergence)
    assert output_rate(1.0, 10.0, 0.25) == pytest.approx(output_rate(2.0, 10.0, 0.5))
    for change, ref, lr in ((1.0, 10.0, 0.0), (1.0, 0.0, 1.0), (NAN, 1.0, 1.0), (1.0, 1.0, NAN)):
        assert math.isnan(output_rate(change, ref, lr))


def test_output_freezes_the_prefix_that_slowed_below_its_ratio_of_its_fastest() -> None:
    ds = _output([[9, 9, 9, 9], [2, 2, 8, 9], [2, 2, 2, 2]], output_ratio=0.3, alpha=0.9)
    # the first decision point is its own peak: nothing has slowed yet
    assert [d.boundary for d in ds] == [0, 2, 3]  # the cap keeps the last block trainable
    assert ds[0].signal == (9, 9, 9, 9) and ds[0].limits == pytest.approx((2.7,) * 4)
    assert ds[1].state.output_peaks == (9, 9, 9, 9)
    assert "output moving <= 0.3" in ds[1].reason


def test_output_keeps_what_still_moves_and_unknown_rates() -> None:
    # a settled block above one still moving is not frozen; NaN (no probe before) never settles
    ds = _output([[9, 9, 9], [9, 1, 1], [NAN, 1, 1]], output_ratio=0.3)
    assert [d.boundary for d in ds] == [0, 0, 0]
    assert ds[2].state.output_peaks == (9, 9, 9)  # an unknown rate leaves the peak as it was


def test_output_is_bounded_by_alpha_and_warm_up() -> None:
    ds = _output([[5, 5, 5, 5, 5, 5, 5, 5], [1] * 8, [1] * 8], alpha=0.25, warmup_decisions=1)
    # warm-up at decision 1; then one alpha step (2 of 8) and the next (ceil(8 * 7/16) = 4)
    assert [d.boundary for d in ds] == [0, 2, 4]


def test_output_needs_rates_and_rejects_bad_ones() -> None:
    spec = FreezeSpec(policy="output", keep_trainable=1)
    with pytest.raises(ValueError, match="needs output_rates"):
        decide(spec, FreezeState(), None, 3, boundary=0)
    with pytest.raises(ValueError, match="one per block"):
        decide(spec, FreezeState(), None, 3, boundary=0, output_rates=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"output_rates\[1\].*negative"):
        decide(spec, FreezeState(), None, 3, boundary=0, output_rates=[1.0, -1.0, 1.0])


def test_auto_runs_the_output_policy() -> None:
    assert policy_in_force(FreezeSpec(policy="auto")) == AUTO_POLICY == "output"
    assert policy_in_force(FreezeSpec(policy="gradient")) == "gradient"
    d = decide(
        FreezeSpec(policy="auto", keep_trainable=1),
        FreezeState(),
        None,
        2,
        boundary=0,
        output_rates=[1.0, 1.0],
    )
    assert d.signal == (1.0, 1.0)


def test_every_reading_policy_says_what_it_read_and_where_its_threshold_is() -> None:
    decay = decide(
        FreezeSpec(policy="gradient", criterion="decay", threshold=0.5),
        FreezeState(),
        [4.0, 2.0],
        2,
        boundary=0,
    )
    assert decay.signal == (4.0, 2.0) and decay.limits == (2.0, 1.0)
    noise = decide(
        FreezeSpec(policy="gradient", criterion="noise", noise_ratio=1.5),
        FreezeState(),
        [4.0, 2.0],
        2,
        boundary=0,
        drift=[1.0, 3.0],
    )
    assert noise.signal == (1.0, 3.0) and noise.limits == (1.5, 1.5)
    schedule = decide(FreezeSpec(policy="schedule"), FreezeState(), None, 2, boundary=0)
    assert schedule.signal is None and schedule.limits is None


def test_a_state_with_output_peaks_round_trips_and_others_keep_their_form() -> None:
    state = FreezeState(3, None, None, (1.0, NAN))
    again = FreezeState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again.decisions == 3 and again.output_peaks[0] == 1.0
    assert math.isnan(again.output_peaks[1])
    assert "output_peaks" not in FreezeState(2).to_dict()
    with pytest.raises(ValueError, match=r"output_peaks\[0\]"):
        FreezeState.from_dict({"output_peaks": ["x"]})


def test_output_ratio_is_validated() -> None:
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError, match="output_ratio"):
            FreezeSpec(policy="output", output_ratio=bad)
