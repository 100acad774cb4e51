"""The Freezing view's distance to the freeze threshold: the figure builder and its caption
(dashboard/freeze_figures.py) over hand-built `FreezeSignalRow`s, then the view in-process
(AppTest) over a store holding them."""

from __future__ import annotations

import json
import math
from typing import Any

import plotly.graph_objects as go
import pytest

from pipetransformer.core.protocol import FreezeSignal
from pipetransformer.core.spec import JobSpec
from pipetransformer.dashboard.figures import FROZEN_COLOR
from pipetransformer.dashboard.freeze_figures import (
    MAX_DECADES,
    NO_SIGNALS_TEXT,
    SIGNAL_TITLE,
    no_signals_text,
    signal_caption,
    signal_figure,
    threshold_ratio,
)
from pipetransformer.store import FreezeSignalRow, Store
from tests.fixtures_store import StoreRun
from tests.test_dashboard import chart_titles, page_text, run_app, show

T0 = 1_800_000_000.0


def row(
    step: int, signal: list[float | None], limits: list[float | None], **fields: Any
) -> FreezeSignalRow:
    return FreezeSignalRow(
        **{
            "step": step,
            "generation": 1,
            "time": T0 + step,
            "decision": step // 10,
            "boundary": 0,
            "bound": 2,
            "policy": "output",
            "statistic": "output_rate",
            "signal": tuple(signal),
            "limits": tuple(limits),
            "probe_s": 0.25,
        }
        | fields
    )


# three decision points over 4 blocks: block 0 settles first and is frozen at step 20
ROWS = [
    row(10, [0.2, 0.8, 1.0, 3.0], [0.4, 0.4, 0.4, 0.4], boundary=0, bound=1),
    row(20, [0.1, 0.2, None, 2.0], [0.4, 0.4, 0.4, None], boundary=1, bound=2),
    row(30, [None, 0.1, 0.4, 40.0], [0.4, 0.4, 0.4, 0.4], boundary=1, bound=3),
]


def by_name(fig: go.Figure) -> dict[str, Any]:
    return {t.name: t for t in fig.data}


def test_threshold_ratio_is_signal_over_limit() -> None:
    assert threshold_ratio(0.2, 0.4) == 0.5
    assert threshold_ratio(0.4, 0.4) == 1.0  # at the threshold: settled
    assert threshold_ratio(None, 0.4) is None and threshold_ratio(0.2, None) is None
    assert threshold_ratio(float("nan"), 0.4) is None
    assert threshold_ratio(0.0, 0.0) == 1.0  # a limit of 0 is met by 0 only
    assert threshold_ratio(0.1, 0.0) == math.inf


def test_signal_figure_colours_each_block_by_its_distance_to_the_threshold() -> None:
    fig = signal_figure(ROWS)
    assert fig.layout.title.text == SIGNAL_TITLE
    traces = by_name(fig)
    assert list(traces) == ["frozen", "signal / limit", "freeze boundary", "automatic cap"]
    heat = traces["signal / limit"]
    assert list(heat.x) == [10, 20, 30] and list(heat.y) == [0, 1, 2, 3]
    assert len(heat.z) == 4 and all(len(col) == 3 for col in heat.z)  # block x decision point
    # log10 of signal / limit, centred at 1 (0) on a diverging scale
    assert heat.z[0][0] == pytest.approx(math.log10(0.5))
    assert heat.z[1][0] == pytest.approx(math.log10(2.0))
    assert heat.z[2][2] == pytest.approx(0.0)
    assert heat.zmid == 0 and heat.zmin == -heat.zmax
    assert heat.z[3][2] == MAX_DECADES  # 100x and beyond saturate the scale
    assert heat.zmax == MAX_DECADES
    assert heat.z[2][1] is None and heat.z[3][1] is None  # unknown signal or limit: a gap
    assert "×1" in heat.colorbar.ticktext and "signal / limit" in heat.colorbar.title.text
    # block 0 was frozen at step 20: grey from the next decision point on, not in the scale
    frozen = traces["frozen"]
    assert frozen.colorscale[0][1] == FROZEN_COLOR
    assert [frozen.z[0][i] for i in range(3)] == [None, None, 1]
    assert heat.z[0][1] is not None and heat.z[0][2] is None
    assert all(v is None for col in frozen.z[1:] for v in col)
    # the boundary after each decision point and the cap, between blocks
    assert list(traces["freeze boundary"].y) == [-0.5, 0.5, 0.5]
    assert list(traces["automatic cap"].y) == [0.5, 1.5, 2.5]
    assert traces["automatic cap"].line.dash == "dash"
    # hover: the signal, the limit, the ratio, the statistic and what reading it took
    hover = heat.text[1][0]
    assert "block 1 · step 10 (decision point 1)" in hover
    assert "output rate on the probe batch: 0.8" in hover and "settles at or below: 0.4" in hover
    assert "2 × the threshold (not settled)" in hover and "250 ms" in hover
    assert "0.5 × the threshold (settled)" in heat.text[0][0]
    assert "unknown" in heat.text[3][1]
    assert fig.layout.xaxis.title.text == "decision step" and fig.layout.height <= 600


def test_a_scale_for_readings_near_the_threshold_stays_symmetric() -> None:
    near = [row(10, [0.9, 1.1], [1.0, 1.0])]
    heat = by_name(signal_figure(near))["signal / limit"]
    assert heat.zmin == -heat.zmax and 0 < heat.zmax < MAX_DECADES
    assert "frozen" not in by_name(signal_figure(near))  # nothing frozen: no grey trace


def test_no_signals_say_so() -> None:
    fig = signal_figure([])
    assert not fig.data and fig.layout.annotations[0].text == NO_SIGNALS_TEXT
    assert signal_caption([]) == ""
    assert "Policy 'schedule' reads no per-block signal" in no_signals_text("schedule")
    assert "Policy 'off'" in no_signals_text("off")
    assert "No freeze signals reported yet" in no_signals_text("output")


def test_the_caption_names_the_policy_the_statistic_and_the_cost() -> None:
    text = signal_caption(ROWS)
    assert "output rate on the probe batch (policy 'output')" in text
    assert "1 is the threshold" in text and "3 decision points (steps 10-30)" in text
    assert "250 ms per decision point" in text
    drift = [row(5, [1.0], [1.5], policy="gradient", statistic="gradient_drift", probe_s=0.0)]
    text = signal_caption(drift)
    assert (
        "gradient drift ratio (policy 'gradient')" in text and "1 decision point (step 5)" in text
    )
    assert "took" not in text  # the statistic came with the steps: no probe to cost


# --------------------------------------------------------------------------- the view


def report(step: int, boundary: int, signal: list[float | None]) -> FreezeSignal:
    return FreezeSignal(
        rank=0,
        time=T0 + step,
        step=step,
        decision=step // 10,
        boundary=boundary,
        bound=boundary + 1,
        policy="gradient",
        statistic="gradient_norm",
        signal=signal,
        limits=[0.5] * len(signal),
        probe_s=0.0,
    )


def test_the_freezing_view_draws_the_stored_signals(
    monkeypatch: pytest.MonkeyPatch, populated_store: StoreRun
) -> None:
    store, job = populated_store.store, populated_store.job_id
    at = show(run_app(monkeypatch, populated_store.db_url, job), "Freezing")
    assert not at.exception, [e.value for e in at.exception]
    assert SIGNAL_TITLE not in chart_titles(at)  # a job from before signals were stored
    policy = store.get_job(job).spec.freeze.policy
    assert no_signals_text(policy) in page_text(at)

    store.add_freeze_signal(job, report(10, 0, [0.25, 1.0, 2.0, 4.0, 4.0, 4.0]))
    store.add_freeze_signal(job, report(20, 2, [0.1, 0.4, 1.0, 4.0, 4.0, 4.0]))
    at = show(at.run(), "Freezing")
    assert not at.exception, [e.value for e in at.exception]
    titles = chart_titles(at)
    assert {"Frozen blocks", "Gradient norm per block", SIGNAL_TITLE} <= set(titles)
    (spec,) = [
        json.loads(c.proto.spec)
        for c in at.get("plotly_chart")
        if json.loads(c.proto.spec)["layout"]["title"]["text"] == SIGNAL_TITLE
    ]
    heat = next(d for d in spec["data"] if d["name"] == "signal / limit")
    assert heat["x"] == [10, 20] and len(heat["z"]) == 6
    text = page_text(at)
    assert "mean gradient norm (policy 'gradient')" in text and "2 decision points" in text


def test_a_schedule_job_says_it_has_nothing_to_draw(
    monkeypatch: pytest.MonkeyPatch, store: Store, db_url: str
) -> None:
    spec = JobSpec.model_validate({"name": "sched", "freeze": {"policy": "schedule"}})
    store.create_job("sched-1", spec, "/tmp/nowhere")
    at = show(run_app(monkeypatch, db_url, job="sched-1"), "Freezing")
    assert not at.exception, [e.value for e in at.exception]
    assert "Policy 'schedule' reads no per-block signal" in page_text(at)
    assert SIGNAL_TITLE not in chart_titles(at)
