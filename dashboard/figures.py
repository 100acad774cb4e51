"""Plotly figure builders: pure functions of store data (no I/O, no Streamlit).

Inputs are what `store.Store` returns: a `Layout`, the `RecordedLayout` history of
`Store.layouts`, and the `MetricRow`s / `EvaluationRow`s of `Store.metrics` /
`Store.evaluations` (`time` in unix seconds; `frozen` the boundary a step trained under; `mfu`
a fraction; `peak_memory_mib` per rank in MiB, or None). Every series
chart takes `x` ("step" or "time", see `dashboard.timeline`) and an optional `Timeline` to draw
layout versions and generation starts behind its curves. Figures are sized for a page about
800 px wide: short titles, legends horizontal below, small margins.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import plotly.graph_objects as go
from plotly.colors import qualitative

from pipetransformer.core.readings import perplexity
from pipetransformer.core.state import Layout
from pipetransformer.dashboard.timeline import (
    LayoutHistory,
    Rows,
    Timeline,
    XAxis,
    axis_title,
    axis_values,
    check_axis,
    decorate,
    layout_starts,
    unix,
    utc,
)
from pipetransformer.store.rows import EvaluationRow, MetricRow

FROZEN_COLOR = "#c7c7c7"


def frozen_layer(
    xs: Sequence[Any],
    ys: Sequence[int],
    frozen: Sequence[Sequence[int | None]],
    hovertemplate: str,
    text: Sequence[Sequence[str]] | None = None,
) -> go.Heatmap:
    """A per-block heat map's frozen cells (1; None elsewhere) in one grey, as a legend entry
    of their own: drawn under the readings, which leave those cells empty."""
    return go.Heatmap(
        name="frozen",
        x=xs,
        y=ys,
        z=frozen,
        text=text,
        colorscale=[[0, FROZEN_COLOR], [1, FROZEN_COLOR]],
        showscale=False,
        showlegend=True,
        hoverongaps=False,
        hovertemplate=hovertemplate,
    )


STAGE_COLORS = qualitative.Plotly
EMPTY_TEXT = "no data yet"
RAW_OPACITY = 0.25  # the raw curve under a smoothed one: there, but faint
HEIGHT = 320
# Horizontal, at the bottom of the figure: below the x axis title and ticks whatever room they
# take (a paper-relative y overlaps them on short figures); the bottom margin grows to fit.
LEGEND = {
    "orientation": "h",
    "x": 0,
    "xanchor": "left",
    "yref": "container",
    "y": 0,
    "yanchor": "bottom",
}
# y axis label and tick format for the keys `compare_figure` knows; others use the key itself.
SERIES: dict[str, tuple[str, str | None]] = {
    "loss": ("loss", None),
    "samples_per_s": ("samples/s", None),
    "accuracy": ("accuracy", ".0%"),
    "lr": ("learning rate", ".1e"),
    "mfu": ("MFU", ".0%"),
}
MIB_PER_GIB = 1024


def stage_color(index: int) -> str:
    return STAGE_COLORS[index % len(STAGE_COLORS)]


def rank_label(rank: int) -> str:
    return f"rank {rank}"


def _when(created: datetime) -> str:
    return utc(unix(created)).strftime("%Y-%m-%d %H:%M:%S UTC")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


# ---- smoothing


def smooth(values: Sequence[float | None], weight: float) -> list[float | None]:
    """TensorBoard-style exponential moving average with debiasing.

    `weight` in [0, 1): 0 returns the values unchanged, closer to 1 smooths more. Each output
    is the mean of the finite values so far, weighted `weight**age`: the same as an EMA started
    at 0 and divided by `1 - weight**n` (the debiasing), so the first values are not pulled
    towards 0. None and non-finite entries give None and are skipped: they neither reset nor
    poison the average.
    """
    if not 0.0 <= weight < 1.0:  # also refuses NaN
        raise ValueError(f"weight must be in [0, 1), got {weight!r}")
    out: list[float | None] = []
    total = norm = 0.0
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(None)
            continue
        # Numerator and denominator kept apart: a constant series comes out exactly constant.
        total = total * weight + v
        norm = norm * weight + 1.0
        out.append(total / norm)
    return out


# ---- common pieces


def empty_figure(fig: go.Figure, text: str = EMPTY_TEXT) -> go.Figure:
    """`fig` saying why it is empty."""
    fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


def base_figure(
    title: str, x_title: str, y_title: str, height: int = HEIGHT, hovermode: str = "x unified"
) -> go.Figure:
    """An empty figure in the dashboard's style: title, axes, size, margins, legend below."""
    fig = go.Figure()
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        xaxis={"title": {"text": x_title}, "automargin": True},
        yaxis={"title": {"text": y_title}, "automargin": True},
        height=height,
        margin={"l": 10, "r": 10, "t": 40, "b": 10},
        hovermode=hovermode,
        legend=LEGEND,
    )
    return fig


def _finish(fig: go.Figure, tl: Timeline | None, x: XAxis) -> go.Figure:
    return fig if tl is None else decorate(fig, tl, x)


def _hover_rows(rows: Rows) -> list[list[Any]]:
    """customdata for hover text: step and epoch of each row (the x axis may be time)."""
    return [[r.step, r.epoch] for r in rows]


def _series(
    fig: go.Figure,
    rows: Rows,
    key: str,
    *,
    name: str,
    color: str,
    x: XAxis,
    smoothing: float,
    y_format: str,
) -> None:
    """One metric as a line: raw (faint when smoothed) and, with smoothing > 0, smoothed."""
    xs = axis_values(rows, x)
    raw = [getattr(r, key) for r in rows]
    hover = "step %{customdata[0]} · epoch %{customdata[1]}<br>" + name + " %{y:" + y_format + "}"
    fig.add_trace(
        go.Scatter(
            name=f"{name} (raw)" if smoothing > 0 else name,
            x=xs,
            y=raw,
            mode="lines",
            line={"color": color, "width": 1},
            opacity=RAW_OPACITY if smoothing > 0 else 1.0,
            customdata=_hover_rows(rows),
            hovertemplate=hover + "<extra></extra>",
        )
    )
    if smoothing > 0:
        fig.add_trace(
            go.Scatter(
                name=f"{name} (smoothed)",
                x=xs,
                y=smooth(raw, smoothing),
                mode="lines",
                line={"color": color, "width": 2},
                # The average skips gaps, so its line may too.
                connectgaps=True,
                customdata=_hover_rows(rows),
                hovertemplate=hover + " smoothed<extra></extra>",
            )
        )


# ---- series over step or time


def loss_figure(
    metrics: Sequence[MetricRow],
    evaluations: Sequence[EvaluationRow] = (),
    *,
    x: XAxis = "step",
    smoothing: float = 0.0,
    timeline: Timeline | None = None,
) -> go.Figure:
    """Training loss per step (raw, faint under a smoothed line when `smoothing` > 0) and the
    held-out loss of each evaluation as markers."""
    fig = base_figure("Training loss", axis_title(x), "loss")
    evals = [r for r in evaluations if r.loss is not None]
    if not metrics and not evals:
        return empty_figure(fig)
    if metrics:
        _series(
            fig,
            metrics,
            "loss",
            name="loss",
            color=STAGE_COLORS[0],
            x=x,
            smoothing=smoothing,
            y_format=".4f",
        )
    if evals:
        fig.add_trace(
            go.Scatter(
                name="eval loss",
                x=axis_values(evals, x),
                y=[r.loss for r in evals],
                mode="markers",
                marker={"color": STAGE_COLORS[1], "size": 8, "symbol": "diamond"},
                customdata=_hover_rows(evals),
                hovertemplate="eval at step %{customdata[0]} (epoch %{customdata[1]})"
                "<br>loss %{y:.4f}<extra></extra>",
            )
        )
    return _finish(fig, timeline, x)


def throughput_figure(
    metrics: Sequence[MetricRow],
    *,
    x: XAxis = "step",
    smoothing: float = 0.0,
    timeline: Timeline | None = None,
) -> go.Figure:
    """Training throughput (samples/s, all replicas together) per step; the raw per-step curve
    is jumpy, so a smoothed line over a faint raw one reads better. y from zero."""
    fig = base_figure("Throughput", axis_title(x), "samples/s")
    if not metrics:
        return empty_figure(fig)
    _series(
        fig,
        metrics,
        "samples_per_s",
        name="samples/s",
        color=STAGE_COLORS[2],
        x=x,
        smoothing=smoothing,
        y_format=".1f",
    )
    fig.update_yaxes(rangemode="tozero")
    return _finish(fig, timeline, x)


def has_values(rows: Rows, key: str) -> bool:
    """Whether any row has `key` (a job whose workers measured MFU or peak memory; never on the
    CPU): the dashboard draws those charts only then."""
    return any(getattr(r, key) is not None for r in rows)


def mfu_figure(
    metrics: Sequence[MetricRow],
    *,
    x: XAxis = "step",
    smoothing: float = 0.0,
    timeline: Timeline | None = None,
) -> go.Figure:
    """Model FLOPs utilisation per step, in percent (the rows hold fractions): the model's
    FLOPs per second over the devices' dense peak. Jumpy like throughput, so smoothed over a
    faint raw line. y from zero; steps without a value (the CPU, older workers) are gaps."""
    fig = base_figure("Model FLOPs utilisation", axis_title(x), "MFU")
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    if not has_values(metrics, "mfu"):
        return empty_figure(fig)
    _series(
        fig,
        metrics,
        "mfu",
        name="MFU",
        color=STAGE_COLORS[4],
        x=x,
        smoothing=smoothing,
        y_format=".1%",
    )
    return _finish(fig, timeline, x)


def peak_memory_figure(
    metrics: Sequence[MetricRow], *, x: XAxis = "step", timeline: Timeline | None = None
) -> go.Figure:
    """Peak GPU memory allocated per rank (GiB), one line per rank, at the steps that carry it
    (control points). A rank missing from a row (a smaller world, a rank that did not say) is
    a gap in its line. y from zero."""
    check_axis(x)
    fig = base_figure("Peak GPU memory", axis_title(x), "GiB")
    fig.update_yaxes(rangemode="tozero")
    rows = [r for r in metrics if r.peak_memory_mib]
    if not rows:
        return empty_figure(fig)
    xs = axis_values(rows, x)
    ranks = max(len(r.peak_memory_mib or ()) for r in rows)
    for rank in range(ranks):
        ys: list[float | None] = []
        for r in rows:
            peaks = r.peak_memory_mib or ()
            mib = peaks[rank] if rank < len(peaks) else None
            ok = mib is not None and math.isfinite(mib)
            ys.append(mib / MIB_PER_GIB if ok else None)
        if all(y is None for y in ys):
            continue
        fig.add_trace(
            go.Scatter(
                name=rank_label(rank),
                x=xs,
                y=ys,
                mode="lines+markers",
                marker={"size": 4},
                line={"color": stage_color(rank), "width": 1.5},
                customdata=_hover_rows(rows),
                hovertemplate="step %{customdata[0]} · epoch %{customdata[1]}<br>"
                + rank_label(rank)
                + " %{y:.2f} GiB<extra></extra>",
            )
        )
    if not fig.data:
        return empty_figure(fig)
    return _finish(fig, timeline, x)


def _target_line(fig: go.Figure, y: float, text: str) -> None:
    """A job's held-out target as a dashed grey line."""
    fig.add_hline(
        y=y,
        line_dash="dash",
        line_color="grey",
        annotation_text=text,
        annotation_position="bottom right",
    )


def accuracy_figure(
    evaluations: Sequence[EvaluationRow],
    target: float | None = None,
    *,
    x: XAxis = "step",
    timeline: Timeline | None = None,
) -> go.Figure:
    """Held-out accuracy (fraction, shown as %) at each evaluation; an optional target accuracy
    as a dashed line. Question answering (evaluations with an F1): exact match and F1."""
    qa = any(r.f1 is not None for r in evaluations)
    title = "Held-out exact match and F1" if qa else "Held-out accuracy"
    fig = base_figure(title, axis_title(x), "score" if qa else "accuracy")
    fig.update_yaxes(range=[0, 1.02], tickformat=".0%")
    if target is not None:
        _target_line(fig, target, f"target {target:.0%}")
    if not evaluations:
        return empty_figure(fig)
    traces = [("exact match", [r.accuracy for r in evaluations])] if qa else []
    if qa:
        traces.append(("F1", [r.f1 for r in evaluations]))
    else:
        traces.append(("accuracy", [r.accuracy for r in evaluations]))
    for name, values in traces:
        fig.add_trace(
            go.Scatter(
                name=name,
                x=axis_values(evaluations, x),
                y=values,
                mode="lines+markers",
                customdata=_hover_rows(evaluations),
                hovertemplate="step %{customdata[0]} (epoch %{customdata[1]})"
                f"<br>{name} %{{y:.1%}}<extra></extra>",
            )
        )
    return _finish(fig, timeline, x)


def perplexity_figure(
    evaluations: Sequence[EvaluationRow],
    target: float | None = None,
    *,
    x: XAxis = "step",
    timeline: Timeline | None = None,
) -> go.Figure:
    """A language model's held-out perplexity (exp of its loss per token) at each evaluation,
    on a log axis; an optional target perplexity as a dashed line."""
    fig = base_figure("Held-out perplexity", axis_title(x), "perplexity")
    fig.update_yaxes(type="log")
    if target is not None:
        _target_line(fig, target, f"target {target:g}")
    rows = [r for r in evaluations if r.loss is not None]
    if not rows:
        return empty_figure(fig)
    fig.add_trace(
        go.Scatter(
            name="perplexity",
            x=axis_values(rows, x),
            y=[perplexity(r.loss) for r in rows],
            mode="lines+markers",
            customdata=_hover_rows(rows),
            hovertemplate="step %{customdata[0]} (epoch %{customdata[1]})"
            "<br>perplexity %{y:.2f}<extra></extra>",
        )
    )
    return _finish(fig, timeline, x)


def lr_figure(
    metrics: Sequence[MetricRow], *, x: XAxis = "step", timeline: Timeline | None = None
) -> go.Figure:
    """Learning rate per step, as the schedule set it."""
    fig = base_figure("Learning rate", axis_title(x), "learning rate")
    if not metrics:
        return empty_figure(fig)
    fig.add_trace(
        go.Scatter(
            name="lr",
            x=axis_values(metrics, x),
            y=[r.lr for r in metrics],
            mode="lines",
            line={"color": STAGE_COLORS[3]},
            customdata=_hover_rows(metrics),
            hovertemplate="step %{customdata[0]} · epoch %{customdata[1]}"
            "<br>lr %{y:.3e}<extra></extra>",
        )
    )
    fig.update_yaxes(exponentformat="e", rangemode="tozero")
    return _finish(fig, timeline, x)


def freeze_figure(
    layouts: LayoutHistory,
    metrics: Sequence[MetricRow] = (),
    *,
    x: XAxis = "step",
    timeline: Timeline | None = None,
) -> go.Figure:
    """Frozen blocks over step or time: a step line that rises where each layout version took
    effect (`layout_starts`: at the first step the metric rows say trained under a new
    boundary, else at the version's recorded time placed by `step_at` over `metrics`, so
    without metrics every version sits at step 0) and runs on to the last metric row. Hover
    shows version, reason and recorded time."""
    fig = base_figure("Frozen blocks", axis_title(x), "frozen blocks")
    if not layouts:
        return empty_figure(fig)
    starts = layout_starts(layouts, metrics)
    xs: list[Any] = [step if x == "step" else utc(t) for step, t in starts]
    ys = [rec.layout.freeze_boundary for rec in layouts]
    info = [[rec.layout.version, rec.reason, _when(rec.created_at)] for rec in layouts]
    if metrics:
        # Carry the last level on to the last row, so the line spans the run.
        last = axis_values(metrics[-1:], x)[0]
        if last > xs[-1]:
            xs.append(last)
            ys.append(ys[-1])
            info.append(info[-1])
    fig.add_trace(
        go.Scatter(
            name="frozen blocks",
            x=xs,
            y=ys,
            mode="lines+markers",
            line_shape="hv",
            customdata=info,
            hovertemplate="v%{customdata[0]}: %{y} frozen<br>%{customdata[1]}"
            "<br>%{customdata[2]}<extra></extra>",
        )
    )
    num_blocks = layouts[-1].layout.num_blocks
    if all(y == 0 for y in ys):
        fig.add_annotation(
            text="no blocks frozen yet", xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False
        )
    fig.update_yaxes(range=[-0.2, num_blocks + 0.2])
    fig.update_layout(hovermode="closest")
    return _finish(fig, timeline, x)


# ---- gradient norms


def _boundaries(layouts: LayoutHistory, rows: Sequence[MetricRow]) -> list[int]:
    """The freeze boundary each row trained under: its own `frozen` where the row has one (the
    worker reported it; stored since revision 0007), else, for an older row, that of the last
    layout recorded at or before the row's time (the first layout's before any; versions are
    recorded in time order), else 0."""
    starts = [unix(rec.created_at) for rec in layouts]
    out = []
    for r in rows:
        if r.frozen is not None:
            out.append(r.frozen)
        elif layouts:
            i = bisect.bisect_right(starts, r.time)
            out.append(layouts[max(i - 1, 0)].layout.freeze_boundary)
        else:
            out.append(0)
    return out


def grad_norm_figure(
    metrics: Sequence[MetricRow], layouts: LayoutHistory = (), *, x: XAxis = "step"
) -> go.Figure:
    """Gradient norm per transformer block over step or time, as a heat map.

    Blocks on y (block 0 at the bottom), one column per metric row that has `grad_norms`,
    colour = log10 of the norm (the colorbar says so). Non-finite norms are gaps. Frozen cells,
    below the boundary in force (a row's `frozen`, else from `layouts`) or with a norm of
    exactly 0 (what workers report for frozen blocks), are drawn grey by a separate trace: their
    0 is "no gradient", not a small one. The freeze boundary is drawn on top as a step line
    between blocks.
    """
    check_axis(x)
    fig = base_figure("Gradient norm per block", axis_title(x), "block")
    rows = [r for r in metrics if r.grad_norms]
    if not rows:
        return empty_figure(fig)
    blocks = max(
        [len(r.grad_norms or ()) for r in rows] + [rec.layout.num_blocks for rec in layouts]
    )
    xs = axis_values(rows, x)
    bounds = _boundaries(layouts, rows)
    z: list[list[float | None]] = [[] for _ in range(blocks)]
    norms: list[list[float | None]] = [[] for _ in range(blocks)]
    frozen: list[list[int | None]] = [[] for _ in range(blocks)]
    for row, boundary in zip(rows, bounds, strict=True):
        g = row.grad_norms or ()
        for b in range(blocks):
            v = g[b] if b < len(g) else None
            is_frozen = b < boundary or v == 0
            ok = v is not None and math.isfinite(v) and v > 0 and not is_frozen
            z[b].append(math.log10(v) if ok else None)
            norms[b].append(v if ok else None)
            frozen[b].append(1 if is_frozen else None)
    ys = list(range(blocks))
    if any(c is not None for col in frozen for c in col):
        fig.add_trace(frozen_layer(xs, ys, frozen, "block %{y}: frozen<extra></extra>"))
    fig.add_trace(
        go.Heatmap(
            name="grad norm",
            x=xs,
            y=ys,
            z=z,
            customdata=norms,
            colorscale="Viridis",
            colorbar={"title": {"text": "log10 norm", "side": "right"}, "thickness": 12},
            hoverongaps=False,
            hovertemplate="block %{y}<br>%{x}<br>norm %{customdata:.3g}<extra></extra>",
        )
    )
    if layouts or any(r.frozen is not None for r in rows):
        fig.add_trace(
            go.Scatter(
                name="freeze boundary",
                x=xs,
                # Between the last frozen block and the first trained one.
                y=[b - 0.5 for b in bounds],
                customdata=bounds,
                mode="lines",
                # hvh: steps halfway between columns, where the heat map's cells meet.
                line_shape="hvh",
                line={"color": "black", "width": 2},
                showlegend=True,
                hovertemplate="F=%{customdata}<extra></extra>",
            )
        )
    fig.update_yaxes(range=[-0.5, blocks - 0.5], dtick=1 if blocks <= 16 else None)
    fig.update_layout(hovermode="closest", height=max(HEIGHT, min(600, 160 + 16 * blocks)))
    return fig


# ---- layouts


def _cell_bar(name: str, color: str, cells: dict[str, list[Any]], **extra: Any) -> go.Bar:
    """Horizontal bars one block wide (or `widths`) starting at each `x`, on category rows."""
    return go.Bar(
        name=name,
        x=cells.get("width", [1] * len(cells["x"])),
        base=cells["x"],
        y=cells["y"],
        orientation="h",
        text=cells["text"],
        textposition="inside",
        insidetextanchor="middle",
        hovertext=cells["hover"],
        hoverinfo="text",
        marker={"color": color, "line": {"color": "white", "width": 2}},
        customdata=cells["x"],
        **extra,
    )


def _block_axis(num_blocks: int) -> dict[str, Any]:
    axis: dict[str, Any] = {"title": {"text": "block"}, "range": [0, num_blocks]}
    if num_blocks <= 32:  # one tick per block, centred on its cell
        axis["tickvals"] = [b + 0.5 for b in range(num_blocks)]
        axis["ticktext"] = [str(b) for b in range(num_blocks)]
    return axis


def layout_title(layout: Layout) -> str:
    """Short title of a layout, e.g. "Layout v2 · 1 stage x 2 replicas · 5/6 frozen · m=4 gpipe"."""
    return (
        f"Layout v{layout.version} · {_plural(layout.num_stages, 'stage')} x "
        f"{_plural(layout.replicas, 'replica')} · "
        f"{layout.freeze_boundary}/{layout.num_blocks} frozen · "
        f"m={layout.microbatches} {layout.schedule}"
    )


def layout_figure(layout: Layout) -> go.Figure:
    """Which rank runs which block: blocks along x, one row per rank, coloured by stage.

    One bar trace per stage (its legend entry), each bar one (rank, block) cell, plus one
    "frozen" trace for blocks below the freeze boundary, drawn grey. Frozen blocks that have
    left the pipeline (not in any stage) are shown on the first stage's ranks, which hold
    their cached outputs. The title is short; the rest is in the hover.
    """
    fig = go.Figure()
    ranks = sorted(r for s in layout.stages for r in s.ranks)
    frozen: dict[str, list[Any]] = {"x": [], "y": [], "text": [], "hover": []}
    setup = f"{layout.schedule}, {layout.microbatches} micro-batches, planner {layout.planner}" + (
        f", {layout.virtual_stages} stages per rank" if layout.virtual_stages > 1 else ""
    )

    def frozen_cell(block: int, rank: int, where: str) -> None:
        frozen["x"].append(block)
        frozen["y"].append(rank_label(rank))
        frozen["text"].append(f"b{block}")
        frozen["hover"].append(f"block {block}<br>{where}<br>rank {rank}<br>frozen")

    for stage in layout.stages:
        cells: dict[str, list[Any]] = {"x": [], "y": [], "text": [], "hover": []}
        for replica, rank in enumerate(stage.ranks):
            for block in range(stage.start, stage.end):
                if block < layout.freeze_boundary:
                    frozen_cell(block, rank, f"stage {stage.index}, replica {replica}")
                    continue
                cells["x"].append(block)
                cells["y"].append(rank_label(rank))
                cells["text"].append(f"b{block}")
                cells["hover"].append(
                    f"block {block}<br>stage {stage.index} (blocks {stage.start}-{stage.end - 1})"
                    f", replica {replica}<br>rank {rank}<br>{setup}"
                )
        fig.add_trace(_cell_bar(f"stage {stage.index}", stage_color(stage.index), cells))

    first = layout.stages[0]
    for block in range(0, min(first.start, layout.freeze_boundary)):
        for rank in first.ranks:
            frozen_cell(block, rank, "outside the pipeline (cached)")
    if frozen["x"]:
        fig.add_trace(_cell_bar("frozen", FROZEN_COLOR, frozen))

    fig.update_layout(
        title={"text": layout_title(layout), "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        barmode="overlay",
        xaxis=_block_axis(layout.num_blocks),
        yaxis={
            "title": {"text": "rank"},
            "categoryorder": "array",
            # Rank 0 on top, like a process list.
            "categoryarray": [rank_label(r) for r in reversed(ranks)],
            "automargin": True,
        },
        height=150 + 32 * max(len(ranks), 1),
        margin={"l": 10, "r": 10, "t": 40, "b": 10},
        legend=LEGEND,
    )
    return fig


def layout_history_figure(layouts: LayoutHistory) -> go.Figure:
    """Every layout version at once: one row per version (newest on top), blocks along x,
    each stage's block range coloured by stage index and frozen blocks grey; hover names the
    stage's ranks, the reason and the time. Shows the whole sequence of re-layouts."""
    # Capped: a long freeze progression makes many versions; rows then get thinner.
    fig = base_figure(
        "Layout history", "block", "version", height=min(600, 140 + 26 * max(len(layouts), 1))
    )
    if not layouts:
        return empty_figure(fig)
    stages: dict[int, dict[str, list[Any]]] = {}
    frozen: dict[str, list[Any]] = {"x": [], "width": [], "y": [], "text": [], "hover": []}
    for rec in layouts:
        lay, why = rec.layout, rec.reason
        row = f"v{lay.version}"
        when = _when(rec.created_at)
        about = f"{lay.pipeline_ranks}x{lay.replicas} · F={lay.freeze_boundary}<br>{why}<br>{when}"
        f = lay.freeze_boundary
        if f > 0:
            frozen["x"].append(0)
            frozen["width"].append(f)
            frozen["y"].append(row)
            frozen["text"].append("frozen")
            frozen["hover"].append(f"{row}: blocks 0-{f - 1} frozen<br>{about}")
        for s in lay.stages:
            start = max(s.start, f)  # frozen blocks inside a stage are drawn grey
            if start >= s.end:
                continue
            cells = stages.setdefault(
                s.index, {"x": [], "width": [], "y": [], "text": [], "hover": []}
            )
            cells["x"].append(start)
            cells["width"].append(s.end - start)
            cells["y"].append(row)
            cells["text"].append(f"S{s.index}")
            ranks = ", ".join(map(str, s.ranks))
            cells["hover"].append(
                f"{row} stage {s.index}: blocks {s.start}-{s.end - 1}<br>ranks {ranks}<br>{about}"
            )
    for index in sorted(stages):
        fig.add_trace(_cell_bar(f"stage {index}", stage_color(index), stages[index]))
    if frozen["x"]:
        fig.add_trace(_cell_bar("frozen", FROZEN_COLOR, frozen))
    fig.update_layout(
        barmode="overlay",
        hovermode="closest",
        xaxis=_block_axis(max(rec.layout.num_blocks for rec in layouts)),
        # Categories run bottom-up: oldest first puts the newest on top.
        yaxis={
            "categoryorder": "array",
            "categoryarray": [f"v{rec.layout.version}" for rec in layouts],
        },
    )
    return fig


# ---- several jobs


def compare_figure(
    series: Mapping[str, Rows],
    key: str,
    *,
    x: XAxis = "step",
    smoothing: float = 0.0,
    title: str,
) -> go.Figure:
    """Several jobs' curves of `key` ("loss", "samples_per_s", "accuracy", ...) overlaid, one
    line per job, from `series`: job id -> metrics or evaluations rows. With `smoothing` > 0
    each job's line is smoothed (`smooth`) over its raw curve, faint and in the same colour (as
    TensorBoard draws them; one legend entry toggles both). With x="time" each job's x is
    seconds since its own first row, so jobs started at different times line up."""
    check_axis(x)
    label, fmt = SERIES.get(key, (key, None))
    x_title = "step" if x == "step" else "seconds since each job's first row"
    fig = base_figure(title, x_title, label)
    if fmt:
        fig.update_yaxes(tickformat=fmt)
    if not any(series.values()):
        return empty_figure(fig)
    for i, (job, rows) in enumerate(series.items()):
        if not rows:
            continue
        if x == "step":
            xs: list[float] = [r.step for r in rows]
        else:
            t0 = rows[0].time
            xs = [r.time - t0 for r in rows]
        ys = [getattr(r, key) for r in rows]
        color = STAGE_COLORS[i % len(STAGE_COLORS)]
        if smoothing > 0:
            fig.add_trace(
                go.Scatter(
                    name=f"{job} (raw)",
                    x=xs,
                    y=ys,
                    mode="lines",
                    line={"color": color, "width": 1},
                    opacity=RAW_OPACITY,
                    legendgroup=job,
                    showlegend=False,
                    hoverinfo="skip",  # the hover lists each job once, smoothed
                )
            )
        fig.add_trace(
            go.Scatter(
                name=job,
                x=xs,
                y=smooth(ys, smoothing) if smoothing > 0 else ys,
                mode="lines",
                line={"color": color},
                legendgroup=job,
                connectgaps=smoothing > 0,
                customdata=[r.step for r in rows],
                hovertemplate=f"{job}<br>step %{{customdata}}<br>{label} %{{y:.4g}}<extra></extra>",
            )
        )
    return fig
