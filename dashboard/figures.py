"""Plotly figure builders: pure functions of store data (no I/O, no Streamlit).

Inputs are what `orchestrator.store.Store` returns: a `Layout`, and the row dicts of
`Store.metrics` / `Store.evaluations` (`time` in unix seconds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from orchestrator.state import Layout

FROZEN_COLOR = "#c7c7c7"
STAGE_COLORS = qualitative.Plotly
EMPTY_TEXT = "no data yet"

Rows = Sequence[Mapping[str, Any]]


def stage_color(index: int) -> str:
    return STAGE_COLORS[index % len(STAGE_COLORS)]


def rank_label(rank: int) -> str:
    return f"rank {rank}"


def _empty(fig: go.Figure, text: str = EMPTY_TEXT) -> go.Figure:
    fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


def _base(title: str, x_title: str, y_title: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(
        title=title,
        xaxis_title=x_title,
        yaxis_title=y_title,
        margin={"l": 60, "r": 20, "t": 50, "b": 50},
        hovermode="x unified",
    )
    return fig


def layout_figure(layout: Layout) -> go.Figure:
    """Which rank runs which block: blocks along x, one row per rank, colored by stage.

    One bar trace per stage (its legend entry), each bar one (rank, block) cell, plus one
    "frozen" trace for blocks below the freeze boundary, drawn grey. Frozen blocks that have
    left the pipeline (not in any stage) are shown on the first stage's ranks, which hold
    their cached outputs.
    """
    fig = go.Figure()
    ranks = sorted(r for s in layout.stages for r in s.ranks)
    frozen: dict[str, list[Any]] = {"x": [], "y": [], "text": [], "hover": []}

    def frozen_cell(block: int, rank: int, where: str) -> None:
        frozen["x"].append(block)
        frozen["y"].append(rank_label(rank))
        frozen["text"].append(f"b{block}")
        frozen["hover"].append(f"block {block}<br>{where}<br>rank {rank}<br>frozen")

    for stage in layout.stages:
        xs, ys, text, hover = [], [], [], []
        for replica, rank in enumerate(stage.ranks):
            for block in range(stage.start, stage.end):
                if block < layout.freeze_boundary:
                    frozen_cell(block, rank, f"stage {stage.index}, replica {replica}")
                    continue
                xs.append(block)
                ys.append(rank_label(rank))
                text.append(f"b{block}")
                hover.append(
                    f"block {block}<br>stage {stage.index}, replica {replica}<br>rank {rank}"
                )
        fig.add_trace(
            go.Bar(
                name=f"stage {stage.index}",
                x=[1] * len(xs),
                base=xs,
                y=ys,
                orientation="h",
                text=text,
                textposition="inside",
                insidetextanchor="middle",
                hovertext=hover,
                hoverinfo="text",
                marker={"color": stage_color(stage.index), "line": {"color": "white", "width": 2}},
                customdata=xs,
            )
        )

    first = layout.stages[0] if layout.stages else None
    if first is not None:
        for block in range(0, min(first.start, layout.freeze_boundary)):
            for rank in first.ranks:
                frozen_cell(block, rank, "outside the pipeline (cached)")
    if frozen["x"]:
        fig.add_trace(
            go.Bar(
                name="frozen",
                x=[1] * len(frozen["x"]),
                base=frozen["x"],
                y=frozen["y"],
                orientation="h",
                text=frozen["text"],
                textposition="inside",
                insidetextanchor="middle",
                hovertext=frozen["hover"],
                hoverinfo="text",
                marker={"color": FROZEN_COLOR, "line": {"color": "white", "width": 2}},
                customdata=frozen["x"],
            )
        )

    fig.update_layout(
        title=(
            f"Layout v{layout.version}: {layout.num_stages} stage(s) x {layout.replicas} "
            f"replica(s), {layout.freeze_boundary}/{layout.num_blocks} blocks frozen, "
            f"{layout.microbatches} micro-batches ({layout.schedule})"
        ),
        barmode="overlay",
        xaxis={
            "title": "block",
            "range": [0, layout.num_blocks],
            "tickvals": [b + 0.5 for b in range(layout.num_blocks)],
            "ticktext": [str(b) for b in range(layout.num_blocks)],
        },
        yaxis={
            "title": "rank",
            "categoryorder": "array",
            # Rank 0 on top, like a process list.
            "categoryarray": [rank_label(r) for r in reversed(ranks)],
        },
        height=120 + 40 * max(len(ranks), 1),
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        legend={"orientation": "h", "y": -0.25},
    )
    return fig


def _series(rows: Rows, key: str) -> tuple[list[int], list[float | None]]:
    return [int(r["step"]) for r in rows], [r.get(key) for r in rows]


def loss_figure(metrics: Rows) -> go.Figure:
    """Training loss over optimizer steps."""
    fig = _base("Training loss", "step", "loss")
    if not metrics:
        return _empty(fig)
    steps, loss = _series(metrics, "loss")
    fig.add_trace(
        go.Scatter(
            name="loss",
            x=steps,
            y=loss,
            mode="lines",
            customdata=[r.get("epoch") for r in metrics],
            hovertemplate="step %{x} (epoch %{customdata})<br>loss %{y:.4f}<extra></extra>",
        )
    )
    return fig


def throughput_figure(metrics: Rows) -> go.Figure:
    """Training throughput (samples/s, all replicas together) over steps."""
    fig = _base("Throughput", "step", "samples/s")
    if not metrics:
        return _empty(fig)
    steps, rate = _series(metrics, "samples_per_s")
    fig.add_trace(
        go.Scatter(
            name="samples/s",
            x=steps,
            y=rate,
            mode="lines",
            hovertemplate="step %{x}<br>%{y:.1f} samples/s<extra></extra>",
        )
    )
    fig.update_yaxes(rangemode="tozero")
    return fig


def accuracy_figure(evaluations: Rows, target: float | None = None) -> go.Figure:
    """Held-out accuracy (fraction, shown as %) at each evaluation step; an optional target
    accuracy as a dashed line."""
    fig = _base("Held-out accuracy", "step", "accuracy")
    fig.update_yaxes(range=[0, 1.02], tickformat=".0%")
    if target is not None:
        fig.add_hline(
            y=target,
            line_dash="dash",
            line_color="grey",
            annotation_text=f"target {target:.0%}",
        )
    if not evaluations:
        return _empty(fig)
    steps, acc = _series(evaluations, "accuracy")
    fig.add_trace(
        go.Scatter(
            name="accuracy",
            x=steps,
            y=acc,
            mode="lines+markers",
            customdata=[r.get("epoch") for r in evaluations],
            hovertemplate="step %{x} (epoch %{customdata})<br>accuracy %{y:.1%}<extra></extra>",
        )
    )
    return fig


def freeze_figure(history: Sequence[tuple[Layout, str, datetime]]) -> go.Figure:
    """Freeze boundary per layout version (as from `Store.layouts`), hover shows the reason."""
    fig = _base("Freeze progression", "layout version", "frozen blocks")
    if not history:
        return _empty(fig)
    fig.add_trace(
        go.Scatter(
            name="freeze boundary",
            x=[lay.version for lay, _, _ in history],
            y=[lay.freeze_boundary for lay, _, _ in history],
            mode="lines+markers",
            line_shape="hv",
            customdata=[[why, when.isoformat(timespec="seconds")] for _, why, when in history],
            hovertemplate="v%{x}: %{y} frozen<br>%{customdata[0]}<br>%{customdata[1]}"
            "<extra></extra>",
        )
    )
    num_blocks = history[-1][0].num_blocks
    if all(lay.freeze_boundary == 0 for lay, _, _ in history):
        fig.add_annotation(
            text="no blocks frozen yet", xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False
        )
    fig.update_yaxes(range=[-0.2, num_blocks + 0.2])
    fig.update_xaxes(dtick=1)
    return fig
