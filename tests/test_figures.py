"""Dashboard figure builders: pure functions, asserted on the figure data."""

from __future__ import annotations

from datetime import UTC, datetime

import plotly.graph_objects as go
import pytest

from dashboard.figures import (
    EMPTY_TEXT,
    FROZEN_COLOR,
    accuracy_figure,
    freeze_figure,
    layout_figure,
    loss_figure,
    stage_color,
    throughput_figure,
)
from orchestrator.state import Layout, StageLayout
from tests.fixtures_store import two_stage_layout


def cells(trace: go.Bar) -> set[tuple[int, str]]:
    return set(zip(trace.base, trace.y, strict=True))


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
    assert fig.layout.xaxis.title.text == "block"
    assert fig.layout.yaxis.title.text == "rank"
    assert tuple(fig.layout.xaxis.range) == (0, 6)
    assert list(fig.layout.yaxis.categoryarray) == ["rank 1", "rank 0"]


def test_layout_frozen_prefix_outside_pipeline_is_grey() -> None:
    fig = layout_figure(two_stage_layout(2, 2))
    assert [t.name for t in fig.data] == ["stage 0", "stage 1", "frozen"]
    stage0, stage1, frozen = fig.data
    assert cells(stage0) == {(2, "rank 0"), (3, "rank 0")}
    assert cells(stage1) == {(4, "rank 1"), (5, "rank 1")}
    assert cells(frozen) == {(0, "rank 0"), (1, "rank 0")}
    assert frozen.marker.color == FROZEN_COLOR
    assert all("frozen" in h for h in frozen.hovertext)
    assert "2/6 blocks frozen" in fig.layout.title.text


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


METRICS = [
    {"step": s, "epoch": s // 3, "loss": 2.0 / s, "samples_per_s": 100.0 * s, "lr": 1e-3, "time": s}
    for s in range(1, 7)
]
EVALS = [
    {"epoch": 0, "step": 3, "accuracy": 0.5, "loss": 1.0, "time": 3.0},
    {"epoch": 1, "step": 6, "accuracy": 0.8, "loss": 0.5, "time": 6.0},
]


def test_loss_figure() -> None:
    fig = loss_figure(METRICS)
    assert len(fig.data) == 1
    assert list(fig.data[0].x) == [1, 2, 3, 4, 5, 6]
    assert list(fig.data[0].y) == pytest.approx([2.0 / s for s in range(1, 7)])
    assert (fig.layout.xaxis.title.text, fig.layout.yaxis.title.text) == ("step", "loss")


def test_loss_figure_keeps_gaps_for_missing_loss() -> None:
    rows = [dict(METRICS[0]), dict(METRICS[1], loss=None)]
    assert list(loss_figure(rows).data[0].y) == [2.0, None]


def test_throughput_figure() -> None:
    fig = throughput_figure(METRICS)
    assert len(fig.data) == 1
    assert list(fig.data[0].y) == [100.0 * s for s in range(1, 7)]
    assert fig.layout.yaxis.title.text == "samples/s"
    assert fig.layout.xaxis.title.text == "step"


def test_accuracy_figure_with_target() -> None:
    fig = accuracy_figure(EVALS, target=0.9)
    assert len(fig.data) == 1
    assert list(fig.data[0].x) == [3, 6] and list(fig.data[0].y) == [0.5, 0.8]
    assert fig.layout.yaxis.title.text == "accuracy" and fig.layout.yaxis.tickformat == ".0%"
    assert len(fig.layout.shapes) == 1 and fig.layout.shapes[0].y0 == 0.9
    assert len(accuracy_figure(EVALS).layout.shapes) == 0


@pytest.mark.parametrize("build", [loss_figure, throughput_figure, accuracy_figure])
def test_empty_inputs_give_an_empty_figure_with_a_note(build) -> None:
    fig = build([])
    assert len(fig.data) == 0
    assert [a.text for a in fig.layout.annotations] == [EMPTY_TEXT]


def test_freeze_figure() -> None:
    when = datetime(2025, 1, 1, tzinfo=UTC)
    history = [(two_stage_layout(1, 0), "initial", when), (two_stage_layout(2, 2), "auto", when)]
    fig = freeze_figure(history)
    assert list(fig.data[0].x) == [1, 2] and list(fig.data[0].y) == [0, 2]
    assert fig.data[0].customdata[1][0] == "auto"
    assert fig.layout.yaxis.title.text == "frozen blocks"
    assert len(freeze_figure([]).data) == 0
