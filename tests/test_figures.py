"""Dashboard figure builders and the job timeline: pure functions, asserted on the figure data
(traces, shapes, annotations, axis settings)."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go
import pytest
from plotly.subplots import make_subplots

from pipetransformer.core.protocol import Metrics
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout, StageLayout
from pipetransformer.dashboard.figures import (
    EMPTY_TEXT,
    FROZEN_COLOR,
    accuracy_figure,
    compare_figure,
    freeze_figure,
    grad_norm_figure,
    has_values,
    layout_figure,
    layout_history_figure,
    loss_figure,
    lr_figure,
    mfu_figure,
    peak_memory_figure,
    perplexity_figure,
    smooth,
    stage_color,
    throughput_figure,
)
from pipetransformer.dashboard.timeline import (
    BAND_FILLS,
    GENERATION_COLOR,
    LABEL_LINE_PX,
    RECOVERY_COLOR,
    Band,
    Timeline,
    decorate,
    step_at,
    timeline,
    unix,
)
from pipetransformer.store import Store
from pipetransformer.store.rows import EvaluationRow, GenerationRow, MetricRow, RecordedLayout
from tests.fixtures_store import packed_layout, two_stage_layout

T0 = 1_700_000_000.0


def at(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def mrow(step: int, time: float, **fields: Any) -> MetricRow:
    """A metric row with what a test does not care about left plain."""
    return MetricRow(
        **({"step": step, "epoch": 0, "loss": None, "samples_per_s": None, "lr": 0.0} | fields),
        time=time,
    )


def changed(row: MetricRow, **fields: Any) -> MetricRow:
    """`row` with some fields changed (validated like a stored row)."""
    return MetricRow.model_validate(row.model_dump() | fields)


def cells(trace: go.Bar) -> set[tuple[int, str]]:
    return set(zip(trace.base, trace.y, strict=True))


def by_name(fig: go.Figure) -> dict[str, go.BaseTraceType]:
    return {t.name: t for t in fig.data}


def notes(fig: go.Figure) -> list[str]:
    return [a.text for a in fig.layout.annotations]


# ---- a realistic history ---------------------------------------------------------------------
# Generation 1 (2 ranks) trains 2 stages x 1 replica, freezes 2 blocks at step 8 (v2), and is
# aborted after step 15 when rank 1 dies. Generation 2 recovers on 2 ranks and re-plans to
# 1 stage x 2 replicas (v3); the user stops it after step 30; generation 3 resumes it.


def step_time(step: int) -> float:
    """Steps 1-15 at T0+6..T0+20 (generation 1), 16-30 at T0+36..T0+50, 31-35 at T0+61..65."""
    return T0 + step + (5 if step <= 15 else 20 if step <= 30 else 30)


def norms(step: int) -> list[float | None]:
    # Frozen blocks report 0; block 5 overflows once.
    boundary = 0 if step < 8 else 2
    out: list[float | None] = [0.0 if b < boundary else 10.0 ** -(b + 1) for b in range(6)]
    if step == 20:
        out[5] = None
    return out


def peaks(step: int) -> list[float | None] | None:
    # MiB per rank, at control points only (every 5th step), as a GPU worker reports them
    return [1024.0 * step, 2048.0 * step] if step % 5 == 0 else None


METRICS = [
    MetricRow(
        step=s,
        epoch=(s - 1) // 10,
        loss=2.0 / s,
        samples_per_s=100.0 * s,
        lr=1e-3,
        time=step_time(s),
        grad_norms=norms(s),
        mfu=0.3 + 0.01 * (s % 5),
        peak_memory_mib=peaks(s),
    )
    for s in range(1, 36)
]
EVALS = [
    EvaluationRow(
        epoch=e,
        step=10 * (e + 1),
        accuracy=0.5 + 0.1 * e,
        loss=1.0 - 0.2 * e,
        time=step_time(10 * (e + 1)),
    )
    for e in range(3)
]
LAYOUTS = [
    RecordedLayout(layout=two_stage_layout(1, 0), reason="initial", created_at=at(T0 + 1)),
    RecordedLayout(
        layout=two_stage_layout(2, 2),
        reason="autofreeze: blocks 0-1 converged",
        created_at=at(T0 + 12.5),
    ),
    RecordedLayout(
        layout=packed_layout(3, 2), reason="re-planned for 2 ranks", created_at=at(T0 + 31)
    ),
]
GENERATIONS = [
    GenerationRow(
        number=1,
        world_size=2,
        state="aborted",
        started_at=at(T0),
        ended_at=at(T0 + 21),
        reason="rank 1 died (SIGKILL)",
    ),
    GenerationRow(
        number=2,
        world_size=2,
        state="interrupted",
        started_at=at(T0 + 30),
        ended_at=at(T0 + 51),
        reason=None,
    ),
    GenerationRow(
        number=3,
        world_size=2,
        state="running",
        started_at=at(T0 + 60),
        ended_at=None,
        reason=None,
    ),
]
TIMELINE = timeline(LAYOUTS, GENERATIONS, METRICS)


# ---- smooth ----------------------------------------------------------------------------------


def test_smooth_debiased_constant_stays_constant() -> None:
    assert smooth([1, 1, 1], 0.9) == [1, 1, 1]
    assert smooth([5.0] * 50, 0.99) == pytest.approx([5.0] * 50)


def test_smooth_zero_weight_is_raw() -> None:
    assert smooth([3.0, None, -1.0, 2.5], 0.0) == [3.0, None, -1.0, 2.5]


def test_smooth_numbers_match_tensorboard() -> None:
    # TensorBoard: last = last * w + (1 - w) * v from 0, shown as last / (1 - w ** n).
    values, w = [1.0, 2.0, 4.0, 0.5], 0.6
    last, expected = 0.0, []
    for n, v in enumerate(values, start=1):
        last = last * w + (1 - w) * v
        expected.append(last / (1 - w**n))
    assert smooth(values, w) == pytest.approx(expected)
    assert smooth([1.0, 2.0], 0.5) == pytest.approx([1.0, 5 / 3])


def test_smooth_skips_none_and_non_finite() -> None:
    # None stays None; the average carries over it (no reset, no poisoning).
    assert smooth([1.0, None, 2.0], 0.5) == pytest.approx([1.0, None, 5 / 3])
    assert smooth([None, None, 3.0, 3.0], 0.9) == pytest.approx([None, None, 3.0, 3.0])
    assert smooth([1.0, math.nan, math.inf, 2.0], 0.5) == pytest.approx([1.0, None, None, 5 / 3])
    assert smooth([], 0.5) == []


@pytest.mark.parametrize("weight", [1.0, -0.1, 1.5, math.nan])
def test_smooth_refuses_weights_outside_0_1(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        smooth([1.0], weight)


# ---- step_at ---------------------------------------------------------------------------------


def test_step_at() -> None:
    rows = [mrow(s, T0 + 10 * s) for s in (3, 4, 5)]
    assert step_at([], T0) == 0  # no rows
    assert step_at(rows, T0) == 3  # before the first row: the first step
    assert step_at(rows, T0 + 30) == 3  # at a row's time: that row's step
    assert step_at(rows, T0 + 30.1) == 4  # between rows: the step then being trained
    assert step_at(rows, T0 + 50) == 5
    assert step_at(rows, T0 + 99) == 5  # after the last row: the last step


def test_step_at_rows_out_of_time_order() -> None:
    # A clock stepping back: still the first row, in step order, at or after t.
    rows = [mrow(1, T0 + 10), mrow(2, T0 + 5), mrow(3, T0 + 20)]
    assert step_at(rows, T0 + 7) == 1
    assert step_at(rows, T0 + 15) == 3
    assert step_at(rows, T0 + 25) == 3


# ---- timeline --------------------------------------------------------------------------------


def test_timeline_bands_one_per_layout_version() -> None:
    assert TIMELINE.bands == [
        Band(1, "v1 · 2x1 · F=0", 1, 8, T0 + 1, T0 + 12.5, 0, "initial"),
        Band(2, "v2 · 2x1 · F=2", 8, 16, T0 + 12.5, T0 + 31, 2, "autofreeze: blocks 0-1 converged"),
        Band(3, "v3 · 1x2 · F=2", 16, None, T0 + 31, None, 2, "re-planned for 2 ranks"),
    ]


def test_timeline_marks_generation_starts_and_recovery() -> None:
    recovery, resume = TIMELINE.marks
    assert (recovery.kind, recovery.label, recovery.step, recovery.time) == (
        "recovery",
        "recovery: generation 2",
        16,  # steps 16-30 follow the abort
        T0 + 30,
    )
    assert "generation 1 aborted: rank 1 died (SIGKILL)" in recovery.detail
    assert (resume.kind, resume.label, resume.step) == ("generation", "generation 3", 31)
    assert "generation 2 interrupted" in resume.detail


def test_timeline_of_nothing() -> None:
    assert timeline([], [], []) == Timeline(bands=[], marks=[])
    # One generation, no metrics yet: no marks, and the one band sits at step 0.
    tl = timeline(LAYOUTS[:1], GENERATIONS[:1], [])
    assert tl.marks == [] and (tl.bands[0].start_step, tl.bands[0].end_step) == (0, None)


# ---- decorate --------------------------------------------------------------------------------


def rects(fig: go.Figure) -> list:
    return [s for s in fig.layout.shapes if s.type == "rect"]


def lines(fig: go.Figure) -> list:
    """Vertical lines at data x (generation marks), not lines across the plot (a target)."""
    return [s for s in fig.layout.shapes if s.type == "line" and s.xref == "x"]


def test_decorate_on_the_step_axis() -> None:
    fig = decorate(go.Figure(go.Scatter(x=[1, 35], y=[0, 1])), TIMELINE)
    bands = rects(fig)
    assert [(b.x0, b.x1) for b in bands] == [(1, 8), (8, 16), (16, 35)]  # open band to last x
    assert all(b.layer == "below" and b.yref == "paper" and (b.y0, b.y1) == (0, 1) for b in bands)
    assert [b.fillcolor for b in bands] == [BAND_FILLS[0], BAND_FILLS[1], BAND_FILLS[0]]
    recovery, resume = lines(fig)
    assert (recovery.x0, recovery.x1, recovery.line.color, recovery.line.dash) == (
        16,
        16,
        RECOVERY_COLOR,
        "dash",
    )
    assert (resume.x0, resume.line.color, resume.line.dash) == (31, GENERATION_COLOR, "dot")
    labels = {a.text: a for a in fig.layout.annotations}
    assert {"v1 · 2x1 · F=0", "v2 · 2x1 · F=2", "v3 · 1x2 · F=2"} <= set(labels)
    assert labels["v3 · 1x2 · F=2"].x == 16 and labels["v3 · 1x2 · F=2"].yanchor == "top"
    assert "re-planned" in labels["v3 · 1x2 · F=2"].hovertext
    assert labels["recovery: generation 2"].x == 16
    assert "rank 1 died" in labels["recovery: generation 2"].hovertext
    assert labels["generation 3"].x == 31


def test_decorate_on_the_time_axis() -> None:
    fig = decorate(go.Figure(go.Scatter(x=[at(T0 + 6), at(T0 + 65)], y=[0, 1])), TIMELINE, "time")
    assert [(b.x0, b.x1) for b in rects(fig)] == [
        (at(T0 + 1), at(T0 + 12.5)),
        (at(T0 + 12.5), at(T0 + 31)),
        (at(T0 + 31), at(T0 + 65)),
    ]
    assert [s.x0 for s in lines(fig)] == [at(T0 + 30), at(T0 + 60)]


def test_decorate_skips_zero_width_bands_and_shortens_narrow_labels() -> None:
    tl = Timeline(
        bands=[
            Band(1, "v1 · 2x1 · F=0", 1, 1, T0, T0 + 1, 0),  # came and went before step 1
            Band(2, "v2 · 2x1 · F=0", 1, 96, T0 + 1, T0 + 96, 0),
            Band(3, "v3 · 2x1 · F=2", 96, 100, T0 + 96, T0 + 100, 2),  # 4% of the range
            Band(4, "v4 · 2x1 · F=3", 100, None, T0 + 100, None, 3),  # open, ends at last x
        ],
        marks=[],
    )
    fig = decorate(go.Figure(go.Scatter(x=[1, 100], y=[0, 1])), tl)
    assert [(b.x0, b.x1) for b in rects(fig)] == [(1, 96), (96, 100)]
    assert [b.fillcolor for b in rects(fig)] == [BAND_FILLS[0], BAND_FILLS[1]]  # still alternate
    assert notes(fig) == ["v2 · 2x1 · F=0", "v3"]


def test_a_label_after_a_short_bands_goes_one_line_down() -> None:
    """v3 lasts 5 % of the run, v4 the rest: "v3" and v4's label would read as one
    ("v3 v4 · 1x2 · F=5"); v4's is drawn a line lower, the others on the top line."""
    tl = Timeline(
        bands=[
            Band(2, "v2 · 2x1 · F=0", 1, 60, T0 + 1, T0 + 60, 0),
            Band(3, "v3 · 2x1 · F=2", 60, 65, T0 + 60, T0 + 65, 2),
            Band(4, "v4 · 1x2 · F=5", 65, None, T0 + 65, None, 5),
        ],
        marks=[],
    )
    fig = decorate(go.Figure(go.Scatter(x=[1, 100], y=[0, 1])), tl)
    shifts = {a.text: a.yshift or 0 for a in fig.layout.annotations}
    assert shifts == {"v2 · 2x1 · F=0": 0, "v3": 0, "v4 · 1x2 · F=5": -LABEL_LINE_PX}


def test_decorate_a_figure_with_two_y_axes() -> None:
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=[1, 35], y=[1, 2]), secondary_y=False)
    fig.add_trace(go.Scatter(x=[1, 35], y=[100, 200]), secondary_y=True)
    decorate(fig, TIMELINE)
    assert len(rects(fig)) == 3 and len(lines(fig)) == 2
    assert all(s.xref == "x" and s.yref == "paper" for s in fig.layout.shapes)


# ---- series figures --------------------------------------------------------------------------

SMALL = [
    MetricRow(step=s, epoch=s // 3, loss=2.0 / s, samples_per_s=100.0 * s, lr=1e-3, time=T0 + s)
    for s in range(1, 7)
]
SMALL_EVALS = [
    EvaluationRow(epoch=0, step=3, accuracy=0.5, loss=1.0, time=T0 + 3),
    EvaluationRow(epoch=1, step=6, accuracy=0.8, loss=None, time=T0 + 6),
]


def test_loss_figure() -> None:
    fig = loss_figure(SMALL)
    assert len(fig.data) == 1
    assert list(fig.data[0].x) == [1, 2, 3, 4, 5, 6]
    assert list(fig.data[0].y) == pytest.approx([2.0 / s for s in range(1, 7)])
    assert (fig.layout.xaxis.title.text, fig.layout.yaxis.title.text) == ("step", "loss")
    assert fig.layout.title.text == "Training loss"
    assert fig.layout.legend.orientation == "h"


def test_loss_figure_keeps_gaps_for_missing_loss() -> None:
    rows = [SMALL[0], changed(SMALL[1], loss=None)]
    assert list(loss_figure(rows).data[0].y) == [2.0, None]


def test_loss_figure_smoothed_with_eval_loss() -> None:
    fig = loss_figure(SMALL, SMALL_EVALS, smoothing=0.5)
    traces = by_name(fig)
    assert list(traces) == ["loss (raw)", "loss (smoothed)", "eval loss"]
    raw, smoothed, evals = fig.data
    assert raw.opacity < 1 and smoothed.opacity is None
    assert list(smoothed.y) == pytest.approx(smooth([r.loss for r in SMALL], 0.5))
    # Only evaluations with a loss, as markers at their steps.
    assert (list(evals.x), list(evals.y), evals.mode) == ([3], [1.0], "markers")


def test_loss_figure_of_evaluations_only() -> None:
    fig = loss_figure([], SMALL_EVALS)
    assert [t.name for t in fig.data] == ["eval loss"] and EMPTY_TEXT not in notes(fig)


def test_throughput_figure() -> None:
    fig = throughput_figure(SMALL)
    assert len(fig.data) == 1
    assert list(fig.data[0].y) == [100.0 * s for s in range(1, 7)]
    assert fig.layout.yaxis.title.text == "samples/s"
    assert fig.layout.yaxis.rangemode == "tozero"
    assert fig.layout.xaxis.title.text == "step"


def test_throughput_figure_smoothed() -> None:
    rows = [
        changed(r, samples_per_s=v) for r, v in zip(SMALL, [0, 4000, 0, 4000, None, 0], strict=True)
    ]
    raw, smoothed = throughput_figure(rows, smoothing=0.9).data
    assert list(raw.y) == [0, 4000, 0, 4000, None, 0]
    assert smoothed.y[4] is None and smoothed.connectgaps
    assert all(0 < v < 4000 for v in smoothed.y[1:4])


# ---- device use: MFU and peak GPU memory (GPU runs only) ----------------------------------------


def test_has_values_tells_a_gpu_run_from_a_cpu_run() -> None:
    assert has_values(METRICS, "mfu") and has_values(METRICS, "peak_memory_mib")
    assert not has_values(SMALL, "mfu") and not has_values(SMALL, "peak_memory_mib")
    assert not has_values([changed(SMALL[0], mfu=None)], "mfu") and not has_values([], "mfu")


def test_mfu_figure_in_percent() -> None:
    rows = [
        changed(r, mfu=v) for r, v in zip(SMALL, [0.4, 0.42, None, 0.41, 0.4, 0.43], strict=True)
    ]
    fig = mfu_figure(rows)
    assert len(fig.data) == 1
    assert list(fig.data[0].x) == [1, 2, 3, 4, 5, 6]
    assert list(fig.data[0].y) == [0.4, 0.42, None, 0.41, 0.4, 0.43]  # fractions, a gap
    assert fig.layout.yaxis.tickformat == ".0%" and fig.layout.yaxis.rangemode == "tozero"
    assert (fig.layout.title.text, fig.layout.yaxis.title.text) == (
        "Model FLOPs utilisation",
        "MFU",
    )
    assert "%{y:.1%}" in fig.data[0].hovertemplate
    raw, smoothed = mfu_figure(rows, smoothing=0.5).data
    assert raw.opacity < 1 and smoothed.connectgaps
    assert smoothed.y[2] is None and 0.4 <= smoothed.y[3] <= 0.42


def test_mfu_figure_of_a_cpu_run_is_empty() -> None:
    fig = mfu_figure(SMALL)  # rows without mfu: nothing measured
    assert len(fig.data) == 0 and notes(fig) == [EMPTY_TEXT]


def test_peak_memory_figure_one_line_per_rank_in_gib() -> None:
    fig = peak_memory_figure(METRICS)
    assert [t.name for t in fig.data] == ["rank 0", "rank 1"]
    r0, r1 = fig.data
    # only the steps that carried peaks (control points), MiB -> GiB
    assert list(r0.x) == list(r1.x) == [5, 10, 15, 20, 25, 30, 35]
    assert list(r0.y) == [float(s) for s in (5, 10, 15, 20, 25, 30, 35)]
    assert list(r1.y) == [2.0 * s for s in (5, 10, 15, 20, 25, 30, 35)]
    assert r0.line.color != r1.line.color
    assert fig.layout.yaxis.title.text == "GiB" and fig.layout.yaxis.rangemode == "tozero"
    assert "GiB" in r0.hovertemplate and r0.customdata[0] == [5, 0]


def test_peak_memory_figure_keeps_gaps_for_ranks_that_did_not_say() -> None:
    rows = [
        changed(SMALL[0], peak_memory_mib=[1024.0, None, 3072.0]),
        changed(SMALL[1], peak_memory_mib=None),  # between control points: skipped
        changed(SMALL[2], peak_memory_mib=[2048.0]),  # a smaller world
        changed(SMALL[3], peak_memory_mib=[None, None, float("nan")]),
    ]
    fig = peak_memory_figure(rows)
    assert [t.name for t in fig.data] == ["rank 0", "rank 2"]  # rank 1 never said
    assert [list(t.x) for t in fig.data] == [[1, 3, 4], [1, 3, 4]]
    assert [list(t.y) for t in fig.data] == [[1.0, 2.0, None], [3.0, None, None]]
    assert notes(peak_memory_figure([changed(SMALL[0], peak_memory_mib=[None])])) == [EMPTY_TEXT]


def test_question_answering_draws_exact_match_and_f1() -> None:
    rows = [
        EvaluationRow(epoch=0, step=3, accuracy=0.5, loss=1.0, time=T0 + 3, f1=0.6),
        EvaluationRow(epoch=1, step=6, accuracy=0.8, loss=None, time=T0 + 6, f1=0.9),
    ]
    fig = accuracy_figure(rows)
    assert [(t.name, list(t.y)) for t in fig.data] == [
        ("exact match", [0.5, 0.8]),
        ("F1", [0.6, 0.9]),
    ]
    assert "exact match and F1" in fig.layout.title.text
    assert [t.name for t in accuracy_figure(SMALL_EVALS).data] == ["accuracy"]


def test_accuracy_figure_with_target() -> None:
    fig = accuracy_figure(SMALL_EVALS, target=0.9)
    assert len(fig.data) == 1
    assert list(fig.data[0].x) == [3, 6] and list(fig.data[0].y) == [0.5, 0.8]
    assert fig.layout.yaxis.title.text == "accuracy" and fig.layout.yaxis.tickformat == ".0%"
    assert len(fig.layout.shapes) == 1 and fig.layout.shapes[0].y0 == 0.9
    assert len(accuracy_figure(SMALL_EVALS).layout.shapes) == 0


def test_perplexity_figure_is_exp_of_the_token_loss_on_a_log_axis() -> None:
    rows = [
        EvaluationRow(epoch=0, step=3, accuracy=0.2, loss=3.0, time=T0 + 3),
        EvaluationRow(epoch=1, step=6, accuracy=0.3, loss=None, time=T0 + 6),  # no loss: skipped
        EvaluationRow(epoch=2, step=9, accuracy=0.4, loss=2.0, time=T0 + 9),
    ]
    fig = perplexity_figure(rows, target=8.0)
    (trace,) = fig.data
    assert list(trace.x) == [3, 9] and list(trace.y) == pytest.approx([math.exp(3), math.exp(2)])
    assert fig.layout.yaxis.type == "log" and fig.layout.shapes[0].y0 == 8.0
    assert notes(perplexity_figure([])) == [EMPTY_TEXT]


def test_lr_figure() -> None:
    fig = lr_figure(METRICS)
    assert list(fig.data[0].x) == list(range(1, 36)) and set(fig.data[0].y) == {1e-3}
    assert (fig.layout.title.text, fig.layout.yaxis.title.text) == (
        "Learning rate",
        "learning rate",
    )


def time_builders() -> list:
    return [
        lambda x, tl: loss_figure(METRICS, EVALS, x=x, smoothing=0.6, timeline=tl),
        lambda x, tl: throughput_figure(METRICS, x=x, smoothing=0.6, timeline=tl),
        lambda x, tl: accuracy_figure(EVALS, 0.9, x=x, timeline=tl),
        lambda x, tl: lr_figure(METRICS, x=x, timeline=tl),
        lambda x, tl: freeze_figure(LAYOUTS, METRICS, x=x, timeline=tl),
        lambda x, tl: mfu_figure(METRICS, x=x, smoothing=0.6, timeline=tl),
        lambda x, tl: peak_memory_figure(METRICS, x=x, timeline=tl),
        lambda x, tl: grad_norm_figure(METRICS, LAYOUTS, x=x),  # no timeline: the last
    ]


@pytest.mark.parametrize("build", time_builders())
def test_time_axis_plots_utc_datetimes(build) -> None:
    fig = build("time", None)
    assert fig.layout.xaxis.title.text == "time (UTC)"
    xs = [v for t in fig.data for v in t.x]
    assert xs and all(isinstance(v, datetime) and v.utcoffset().total_seconds() == 0 for v in xs)
    assert min(xs) >= at(T0) and max(xs) <= at(T0 + 65)


def every_figure() -> list[go.Figure]:
    return [build(x, TIMELINE) for build in time_builders() for x in ("step", "time")] + [
        layout_figure(two_stage_layout(2, 2)),
        layout_history_figure(LAYOUTS),
        compare_figure({"a": METRICS, "b": METRICS}, "loss", x="time", title="Loss"),
    ]


def test_every_figure_fits_800_px() -> None:
    for fig in every_figure():
        assert len(fig.layout.title.text) <= 60, fig.layout.title.text
        legend = fig.layout.legend
        assert (legend.orientation, legend.yref, legend.y, legend.yanchor) == (
            "h",
            "container",
            0,
            "bottom",
        )
        assert fig.layout.margin.l <= 20 and fig.layout.margin.r <= 20
        assert fig.layout.height <= 600


@pytest.mark.parametrize("build", time_builders()[:-1])
def test_series_figures_draw_the_timeline(build) -> None:
    step = build("step", TIMELINE)
    assert len(rects(step)) == 3 and len(lines(step)) == 2
    assert [s.x0 for s in lines(step)] == [16, 31]
    time = build("time", TIMELINE)
    assert [s.x0 for s in lines(time)] == [at(T0 + 30), at(T0 + 60)]


def test_loss_figure_on_the_time_axis() -> None:
    fig = loss_figure(METRICS, EVALS, x="time")
    loss, evals = fig.data
    assert loss.x[0] == at(step_time(1)) and loss.x[-1] == at(step_time(35))
    assert list(evals.x) == [at(step_time(s)) for s in (10, 20, 30)]
    assert loss.customdata[0] == [1, 0]  # step and epoch stay in the hover


@pytest.mark.parametrize(
    "build",
    [loss_figure, lr_figure, freeze_figure, grad_norm_figure, mfu_figure, peak_memory_figure],
)
def test_unknown_axis_is_refused(build) -> None:
    with pytest.raises(ValueError, match="x must be"):
        build(METRICS if build is not freeze_figure else LAYOUTS, x="epoch")


# ---- freeze_figure ---------------------------------------------------------------------------


def test_freeze_figure_over_steps() -> None:
    fig = freeze_figure(LAYOUTS, METRICS)
    (line,) = fig.data
    # One point per version where it took over, then on to the last step.
    assert list(line.x) == [1, 8, 16, 35] and list(line.y) == [0, 2, 2, 2]
    assert line.line.shape == "hv"
    assert line.customdata[1][:2] == [2, "autofreeze: blocks 0-1 converged"]
    assert "UTC" in line.customdata[1][2]
    assert (fig.layout.xaxis.title.text, fig.layout.yaxis.title.text) == ("step", "frozen blocks")
    assert tuple(fig.layout.yaxis.range) == (-0.2, 6.2)


def test_freeze_figure_over_time() -> None:
    (line,) = freeze_figure(LAYOUTS, METRICS, x="time").data
    assert list(line.x) == [at(T0 + 1), at(T0 + 12.5), at(T0 + 31), at(step_time(35))]


def test_freeze_figure_nothing_frozen_says_so() -> None:
    fig = freeze_figure(LAYOUTS[:1], METRICS[:3])
    assert list(fig.data[0].y) == [0, 0] and notes(fig) == ["no blocks frozen yet"]


# ---- grad_norm_figure ------------------------------------------------------------------------


def test_grad_norm_heatmap() -> None:
    fig = grad_norm_figure(METRICS, LAYOUTS)
    traces = by_name(fig)
    assert list(traces) == ["frozen", "grad norm", "freeze boundary"]
    heat = traces["grad norm"]
    assert list(heat.y) == list(range(6)) and list(heat.x) == list(range(1, 36))
    assert len(heat.z) == 6 and all(len(row) == 35 for row in heat.z)  # block x column
    # z is log10 of the norm (block b's norm is 10^-(b+1)); the colorbar says so.
    assert heat.z[3][0] == pytest.approx(-4.0) and heat.customdata[3][0] == pytest.approx(1e-4)
    assert "log10" in heat.colorbar.title.text
    assert heat.z[5][19] is None  # step 20: a non-finite norm is a gap
    # Blocks 0-1 from step 8: frozen, so not in the colour scale but grey.
    frozen = traces["frozen"]
    for b in (0, 1):
        assert heat.z[b][6] is not None and frozen.z[b][6] is None  # step 7: still trained
        assert all(v is None for v in heat.z[b][7:])
        assert all(v == 1 for v in frozen.z[b][7:])
    assert all(v is None for row in frozen.z[2:] for v in row)
    assert frozen.colorscale[0][1] == FROZEN_COLOR and frozen.showscale is False
    # The boundary line sits between the last frozen block and the first trained one.
    line = traces["freeze boundary"]
    assert line.line.shape == "hvh" and line.y[0] == -0.5 and line.y[-1] == 1.5
    assert fig.layout.xaxis.title.text == "step" and fig.layout.yaxis.title.text == "block"


def test_grad_norm_zero_norm_is_frozen_without_layouts() -> None:
    fig = grad_norm_figure(METRICS)
    assert [t.name for t in fig.data] == ["frozen", "grad norm"]  # no boundary line to draw
    heat = by_name(fig)["grad norm"]
    assert heat.z[0][6] is not None and heat.z[0][7] is None


def test_grad_norm_prefers_the_rows_own_boundary() -> None:
    # Rows that carry the boundary they trained under (`frozen`) need no layouts to draw it.
    rows = [changed(r, frozen=0 if r.step < 8 else 2) for r in METRICS]
    fig = grad_norm_figure(rows)
    line = by_name(fig)["freeze boundary"]
    assert list(line.customdata) == [0] * 7 + [2] * 28


def test_grad_norm_skips_rows_without_norms() -> None:
    rows = [
        changed(METRICS[0], grad_norms=None),
        changed(METRICS[1], grad_norms=None),  # not reported
    ]
    rows += [changed(METRICS[2], grad_norms=[1.0, None, 2.0])]  # shorter than the model
    fig = grad_norm_figure(rows, LAYOUTS[:1])
    heat = by_name(fig)["grad norm"]
    assert list(heat.x) == [3]
    assert [row[0] for row in heat.z] == pytest.approx(
        [0.0, None, math.log10(2.0), None, None, None]
    )


def test_grad_norm_without_any_norms_is_empty() -> None:
    rows = [changed(r, grad_norms=None) for r in METRICS]
    fig = grad_norm_figure(rows, LAYOUTS)
    assert len(fig.data) == 0 and notes(fig) == [EMPTY_TEXT]


# ---- layout figures --------------------------------------------------------------------------


def test_layout_two_stages_unfrozen() -> None:
    fig = layout_figure(two_stage_layout(1, 0))
    assert [t.name for t in fig.data] == ["stage 0", "stage 1"]
    s0, s1 = fig.data
    assert cells(s0) == {(0, "rank 0"), (1, "rank 0"), (2, "rank 0")}
    assert cells(s1) == {(3, "rank 1"), (4, "rank 1"), (5, "rank 1")}
    assert set(s0.x) == {1}  # every cell is one block wide
    assert s0.marker.color == stage_color(0) != s1.marker.color
    assert "block 4" in s1.hovertext[1] and "stage 1" in s1.hovertext[1]
    assert "rank 1" in s1.hovertext[1]
    assert "gpipe, 4 micro-batches" in s1.hovertext[1]  # what the title leaves out
    assert fig.layout.xaxis.title.text == "block"
    assert fig.layout.yaxis.title.text == "rank"
    assert tuple(fig.layout.xaxis.range) == (0, 6)
    assert list(fig.layout.yaxis.categoryarray) == ["rank 1", "rank 0"]


def test_layout_title_is_short() -> None:
    fig = layout_figure(packed_layout(2, 5))
    assert fig.layout.title.text == "Layout v2 · 1 stage x 2 replicas · 5/6 frozen · m=4 gpipe"
    assert len(layout_figure(two_stage_layout(7, 2)).layout.title.text) <= 60


def test_layout_frozen_prefix_outside_pipeline_is_grey() -> None:
    fig = layout_figure(two_stage_layout(2, 2))
    assert [t.name for t in fig.data] == ["stage 0", "stage 1", "frozen"]
    stage0, stage1, frozen = fig.data
    assert cells(stage0) == {(2, "rank 0"), (3, "rank 0")}
    assert cells(stage1) == {(4, "rank 1"), (5, "rank 1")}
    assert cells(frozen) == {(0, "rank 0"), (1, "rank 0")}
    assert frozen.marker.color == FROZEN_COLOR
    assert all("frozen" in h for h in frozen.hovertext)
    assert "2/6 frozen" in fig.layout.title.text


def test_layout_replicas_and_frozen_blocks_inside_a_stage() -> None:
    # 2 stages x 2 replicas; boundary 1 lies inside stage 0 (it still owns block 0).
    layout = Layout(
        version=3,
        num_blocks=4,
        freeze_boundary=1,
        stages=[
            StageLayout(index=0, start=0, end=2, ranks=[0, 2]),
            StageLayout(index=1, start=2, end=4, ranks=[1, 3]),
        ],
        replicas=2,
        microbatches=2,
    )
    fig = layout_figure(layout)
    stage0, stage1, frozen = fig.data
    assert cells(frozen) == {(0, "rank 0"), (0, "rank 2")}
    assert cells(stage0) == {(1, "rank 0"), (1, "rank 2")}
    assert len(stage1.base) == 4
    assert "replica 1" in stage1.hovertext[-1]
    assert list(fig.layout.yaxis.categoryarray) == ["rank 3", "rank 2", "rank 1", "rank 0"]
    # One (rank, block) cell per block each rank holds, nothing drawn twice.
    every = [c for t in fig.data for c in zip(t.base, t.y, strict=True)]
    assert len(every) == len(set(every)) == 8
    assert fig.layout.title.text.startswith("Layout v3 · 2 stages x 2 replicas")


def test_layout_history_figure() -> None:
    fig = layout_history_figure(LAYOUTS)
    traces = by_name(fig)
    assert list(traces) == ["stage 0", "stage 1", "frozen"]
    # Oldest first in the category order: the newest version is the top row.
    assert list(fig.layout.yaxis.categoryarray) == ["v1", "v2", "v3"]
    s0, s1, frozen = traces["stage 0"], traces["stage 1"], traces["frozen"]
    # (first block, width, row) of each segment.
    assert list(zip(s0.base, s0.x, s0.y, strict=True)) == [(0, 3, "v1"), (2, 2, "v2"), (2, 4, "v3")]
    assert list(zip(s1.base, s1.x, s1.y, strict=True)) == [(3, 3, "v1"), (4, 2, "v2")]
    assert list(zip(frozen.base, frozen.x, frozen.y, strict=True)) == [(0, 2, "v2"), (0, 2, "v3")]
    assert s0.marker.color == stage_color(0) and frozen.marker.color == FROZEN_COLOR
    assert "ranks 0, 1" in s0.hovertext[2] and "re-planned for 2 ranks" in s0.hovertext[2]
    assert "ranks 1" in s1.hovertext[0]
    assert tuple(fig.layout.xaxis.range) == (0, 6)


# ---- compare_figure --------------------------------------------------------------------------


def test_compare_figure_lines_jobs_up_by_time_since_their_start() -> None:
    early = [mrow(s, T0 + 2 * s, loss=1.0 / s) for s in range(1, 4)]
    late = [mrow(s, T0 + 3600 + 5 * s, loss=2.0 / s) for s in range(1, 3)]
    fig = compare_figure({"a": early, "b": late}, "loss", x="time", title="Loss")
    a, b = fig.data
    assert (a.name, list(a.x)) == ("a", [0.0, 2.0, 4.0])
    assert (b.name, list(b.x)) == ("b", [0.0, 5.0])
    assert "since each job's first row" in fig.layout.xaxis.title.text
    assert (fig.layout.title.text, fig.layout.yaxis.title.text) == ("Loss", "loss")
    steps = compare_figure({"a": early, "b": late}, "loss", title="Loss")
    assert list(steps.data[1].x) == [1, 2] and steps.layout.xaxis.title.text == "step"


def test_compare_figure_smooths_each_job_over_its_faint_raw_curve() -> None:
    """As TensorBoard draws it: each job's smoothed line over its raw curve, faint, in the same
    colour, one legend entry for both (before: the smoothed line alone, the raw values gone)."""
    rows = [
        EvaluationRow(epoch=0, step=s, accuracy=v, loss=None, time=T0 + s)
        for s, v in enumerate([0.2, 0.6, 0.4])
    ]
    other = [EvaluationRow(epoch=0, step=s, accuracy=0.5, loss=None, time=T0) for s in range(2)]
    fig = compare_figure(
        {"a": rows, "b": [], "c": other}, "accuracy", smoothing=0.5, title="Accuracy"
    )
    raw, smoothed, _, c = fig.data  # a job with no rows gets no trace
    assert list(raw.y) == [0.2, 0.6, 0.4] and raw.opacity < 1 and raw.showlegend is False
    assert list(smoothed.y) == pytest.approx(smooth([0.2, 0.6, 0.4], 0.5))
    assert (smoothed.name, smoothed.opacity, smoothed.showlegend) == ("a", None, None)
    assert raw.line.color == smoothed.line.color != c.line.color
    assert raw.legendgroup == smoothed.legendgroup == "a" and c.legendgroup == "c"
    assert fig.layout.yaxis.tickformat == ".0%"
    # 0: the raw values, one line a job
    (a, c) = compare_figure({"a": rows, "c": other}, "accuracy", title="Accuracy").data
    assert list(a.y) == [0.2, 0.6, 0.4] and a.opacity is None and a.name == "a"


# ---- empty inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        loss_figure,
        throughput_figure,
        accuracy_figure,
        lr_figure,
        freeze_figure,
        grad_norm_figure,
        mfu_figure,
        peak_memory_figure,
        layout_history_figure,
        lambda rows: compare_figure({}, "loss", title="Loss"),
        lambda rows: compare_figure({"a": rows}, "loss", x="time", title="Loss"),
        lambda rows: loss_figure(rows, [], x="time", smoothing=0.9, timeline=TIMELINE),
    ],
)
def test_empty_inputs_give_an_empty_figure_with_a_note(build) -> None:
    fig = build([])
    assert len(fig.data) == 0
    assert notes(fig) == [EMPTY_TEXT]
    assert len(fig.layout.shapes) == 0


# ---- the boundary each step trained under, as the store keeps it --------------------------------


def test_a_stored_boundary_change_is_drawn_at_its_step_not_at_the_layouts_time(
    store: Store,
) -> None:
    # The workers froze blocks 0-1 after step 10 and trained step 11 on under layout v2; the
    # controller drained their report (and recorded v2) only while step 14 was running. Every
    # step's report says which boundary it trained under (`Metrics.frozen`); the store keeps it.
    store.create_job("j", JobSpec(name="j"), "/w")
    store.record_layout("j", two_stage_layout(1, 0), "initial")
    time.sleep(0.05)  # v2 recorded well after v1: room for 20 steps between their stamps
    store.record_layout("j", two_stage_layout(2, 2), "autofreeze: blocks 0-1 converged")
    v1, v2 = (unix(rec.created_at) for rec in store.layouts("j"))
    dt = (v2 - v1) / 13.5  # step s ends at v1 + s * dt: v2 is stamped during step 14

    def boundary(step: int) -> int:
        return 0 if step < 11 else 2

    store.add_metrics(
        "j",
        [
            Metrics(
                rank=0,
                step=s,
                epoch=0,
                samples_consumed=0,
                loss=1.0 / s,
                lr=1e-3,
                samples_per_s=100.0,
                time=v1 + s * dt,
                frozen=boundary(s),
                grad_norms=[0.0 if b < boundary(s) else 0.5 for b in range(6)],
            )
            for s in range(1, 21)
        ],
    )
    metrics, layouts = store.metrics("j"), store.layouts("j")
    assert [m.frozen for m in metrics] == [0] * 10 + [2] * 10
    assert step_at(metrics, v2) == 14  # where v2's timestamp alone would put the change
    step11 = metrics[10].time

    # the layout bands: v2 from step 11, on both axes
    tl = timeline(layouts, store.generations("j"), metrics)
    assert [(b.version, b.start_step, b.end_step) for b in tl.bands] == [(1, 1, 11), (2, 11, None)]
    assert [(b.start_time, b.end_time) for b in tl.bands] == [(v1, step11), (step11, None)]
    fig = decorate(go.Figure(go.Scatter(x=[1, 20], y=[0, 1])), tl)
    assert [(b.x0, b.x1) for b in rects(fig)] == [(1, 11), (11, 20)]

    # the frozen-blocks line rises at step 11
    (line,) = freeze_figure(layouts, metrics).data
    assert list(line.x) == [1, 11, 20] and list(line.y) == [0, 2, 2]
    (line,) = freeze_figure(layouts, metrics, x="time").data
    assert list(line.x) == [at(v1), at(step11), at(metrics[-1].time)]

    # the heat map's boundary line and frozen cells change at step 11
    traces = by_name(grad_norm_figure(metrics, layouts))
    assert list(traces["freeze boundary"].customdata) == [0] * 10 + [2] * 10
    assert [traces["frozen"].z[1][i] for i in (9, 10)] == [None, 1]  # block 1, steps 10 and 11
