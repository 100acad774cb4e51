"""A job's story on one time axis: layout versions as bands, generation starts as marks.

Pure functions of store data (no I/O, no Streamlit). `timeline` turns `Store.layouts`,
`Store.generations` and `Store.metrics` into a `Timeline` placed on both axes a chart can use
(optimizer step and wall time); `decorate` draws it on any figure. The axis helpers here
(`axis_title`, `axis_values`, `utc`) and where each layout version took effect
(`layout_starts`) are shared with `dashboard.figures`.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from typing import Any, Literal

import plotly.graph_objects as go

from pipetransformer.core.state import Layout
from pipetransformer.store.rows import EvaluationRow, GenerationRow, MetricRow, RecordedLayout

XAxis = Literal["step", "time"]  # every series chart can be drawn against optimizer step or time
Rows = Sequence[MetricRow] | Sequence[EvaluationRow]  # rows placed on the x axis by step or time
LayoutHistory = Sequence[RecordedLayout]  # as `Store.layouts` returns it

# Two light fills, alternated so neighbouring layout versions stay apart.
BAND_FILLS = ("#7f7f7f", "#636efa")
BAND_OPACITY = 0.12
LABEL_COLOR = "#555555"
RECOVERY_COLOR = "#d62728"
GENERATION_COLOR = "#7f7f7f"
# A band narrower than this fraction of the x range gets only "vN" as its label, and one
# narrower than the second none at all: labels must not pile up at 800 px.
FULL_LABEL_WIDTH = 0.12
SHORT_LABEL_WIDTH = 0.03
LABEL_LINE_PX = 14  # a band label's line height (font size 10)


# ---- axes


def check_axis(x: str) -> None:
    """Raise ValueError unless `x` is an `XAxis`."""
    if x not in ("step", "time"):
        raise ValueError(f"x must be 'step' or 'time', got {x!r}")


def axis_title(x: XAxis) -> str:
    """The x axis title for `x`."""
    check_axis(x)
    return "step" if x == "step" else "time (UTC)"


def utc(t: float) -> datetime:
    """Unix seconds as a timezone-aware UTC datetime (what a time axis plots)."""
    return datetime.fromtimestamp(t, UTC)


def unix(when: datetime) -> float:
    """A datetime as unix seconds; a naive one is taken to be UTC (the store's convention)."""
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def axis_values(rows: Rows, x: XAxis) -> list[int] | list[datetime]:
    """Each row's position on the x axis: its step, or its `time` as a UTC datetime."""
    check_axis(x)
    if x == "step":
        return [r.step for r in rows]
    return [utc(r.time) for r in rows]


# ---- placing times on the step axis


def stepper(metrics: Sequence[MetricRow]) -> Callable[[float], int]:
    """`step_at` as a function of `t`, for many times over the same rows (indexes them once)."""
    if not metrics:
        return lambda t: 0
    times = [r.time for r in metrics]
    steps = [r.step for r in metrics]
    last = steps[-1]
    if all(a <= b for a, b in pairwise(times)):  # the store's rows: times grow with steps

        def sorted_at(t: float) -> int:
            i = bisect.bisect_left(times, t)
            return steps[i] if i < len(steps) else last

        return sorted_at

    def scan_at(t: float) -> int:
        return next((s for s, when in zip(steps, times, strict=True) if when >= t), last)

    return scan_at


def step_at(metrics: Sequence[MetricRow], t: float) -> int:
    """The optimizer step in force at unix time `t`.

    A metric row is written when its step ends, so the step being trained at `t` is that of the
    first row (in step order) whose `time` is at or after `t`. Before the first row that is the
    first row's step; after the last row, the last row's step; with no rows at all, 0.
    """
    return stepper(metrics)(t)


def layout_starts(layouts: LayoutHistory, metrics: Sequence[MetricRow]) -> list[tuple[int, float]]:
    """Where each layout version took effect: (step, unix time) on the step and time axes.

    A version is recorded when the controller drains the workers' report of it, a few steps
    after they began training under it, so its recorded time placed on the step axis
    (`step_at`) is late. A version that moved the freeze boundary is placed exactly where the
    metric rows say which boundary each step trained under (`MetricRow.frozen`, stored since
    revision 0007): at the first row with the new boundary between the previous version's start
    and its own recorded time, on both axes (that row's step and time). Every other version,
    and any whose rows lack `frozen` (stored before 0007), stays at its recorded time.
    """
    at = stepper(metrics)
    known = sorted((r for r in metrics if r.frozen is not None), key=lambda r: r.step)
    known_steps = [r.step for r in known]
    starts: list[tuple[int, float]] = []
    previous: tuple[int, int] | None = None  # the previous version's boundary and start step
    for recorded in layouts:
        t = unix(recorded.created_at)
        start = (at(t), t)
        boundary = recorded.layout.freeze_boundary
        if previous is not None and boundary != previous[0]:
            # from the previous version's start up to the recorded time (no later than that)
            i = bisect.bisect_left(known_steps, previous[1])
            j = bisect.bisect_right(known_steps, start[0])
            first = next((r for r in known[i:j] if r.frozen == boundary), None)
            if first is not None:
                start = (first.step, first.time)
        starts.append(start)
        previous = (boundary, start[0])
    return starts


# ---- the timeline


@dataclass(frozen=True)
class Band:
    """One layout version's span: from where it took effect to where the next version did
    (`layout_starts`; `end_*` None for the version still in force), on the step axis
    (`start_step`/`end_step`) and the time axis (`start_time`/`end_time`, unix seconds)."""

    version: int
    label: str
    start_step: int
    end_step: int | None
    start_time: float
    end_time: float | None
    boundary: int  # frozen blocks under this version
    reason: str = ""  # why the version was recorded, for hover text


@dataclass(frozen=True)
class Mark:
    """A generation start after the first; "recovery" when it follows an aborted generation."""

    kind: Literal["generation", "recovery"]
    label: str
    step: int
    time: float
    detail: str = ""  # how the previous generation ended, world size: for hover text


@dataclass(frozen=True)
class Timeline:
    bands: list[Band]
    marks: list[Mark]


def band_label(layout: Layout) -> str:
    """Short band label: version, pipeline ranks x replicas, frozen blocks, e.g. "v2 · 1x2 · F=5"."""
    return (
        f"v{layout.version} · {layout.pipeline_ranks}x{layout.replicas} · "
        f"F={layout.freeze_boundary}"
    )


def timeline(
    layouts: LayoutHistory, generations: Sequence[GenerationRow], metrics: Sequence[MetricRow]
) -> Timeline:
    """Bands for every layout version, from where it took effect (`layout_starts`) to where
    the next one did, and marks for every generation start after the first.

    `layouts` as from `Store.layouts` (by version), `generations` as from `Store.generations`
    (by number), `metrics` as from `Store.metrics` (to place times on the step axis, and the
    boundary each step trained under).
    """
    at = stepper(metrics)
    starts = layout_starts(layouts, metrics)
    bands = []
    for i, recorded in enumerate(layouts):
        layout = recorded.layout
        start_step, start_time = starts[i]
        end = starts[i + 1] if i + 1 < len(starts) else None
        bands.append(
            Band(
                version=layout.version,
                label=band_label(layout),
                start_step=start_step,
                end_step=None if end is None else end[0],
                start_time=start_time,
                end_time=None if end is None else end[1],
                boundary=layout.freeze_boundary,
                reason=recorded.reason,
            )
        )
    marks = []
    for prev, gen in pairwise(generations):
        t = unix(gen.started_at)
        number = gen.number
        why = f": {prev.reason}" if prev.reason else ""
        ended = f"generation {prev.number} {prev.state}{why}"
        detail = f"{ended}<br>world size {gen.world_size}"
        if prev.state == "aborted":
            marks.append(Mark("recovery", f"recovery: generation {number}", at(t), t, detail))
        else:
            marks.append(Mark("generation", f"generation {number}", at(t), t, detail))
    return Timeline(bands=bands, marks=marks)


# ---- drawing it


def _x_range(fig: go.Figure, x: XAxis) -> tuple[Any, Any] | None:
    """Lowest and highest x of the figure's traces, on the `x` axis's kind of value."""
    kind = numbers.Real if x == "step" else datetime
    found = [
        v
        for trace in fig.data
        if getattr(trace, "x", None) is not None
        for v in trace.x
        if isinstance(v, kind) and not isinstance(v, bool)
    ]
    return (min(found), max(found)) if found else None


def _width(x0: Any, x1: Any) -> float:
    d = x1 - x0
    return d.total_seconds() if isinstance(d, timedelta) else float(d)


def decorate(fig: go.Figure, tl: Timeline, x: XAxis = "step") -> go.Figure:
    """Draw `tl` on `fig` (in place; returned too): layout versions as alternating light bands
    below the traces, labelled at the top; generation starts as labelled vertical lines, red and
    dashed for a recovery, grey and dotted otherwise. Shapes span the plot area's full height
    (paper coordinates), so figures with one or two y axes work alike.

    The open last band runs to the figure's highest x (or last mark). A band of zero width on this axis (a
    version that came and went between two metric rows) is not drawn.
    """
    check_axis(x)
    span = _x_range(fig, x)
    marks = [m.step if x == "step" else utc(m.time) for m in tl.marks]
    if span is not None and marks:  # the open band runs on to a mark past the data too
        span = (span[0], max(span[1], *marks))
    full = _width(*span) if span and span[1] != span[0] else None
    drawn = 0
    lowered = False  # the previous label went one line down (it followed a short band's)
    previous_short = False  # the previous label was a short band's "vN"
    for band in tl.bands:
        if x == "step":
            x0, x1 = band.start_step, band.end_step
        else:
            x0 = utc(band.start_time)
            x1 = None if band.end_time is None else utc(band.end_time)
        if x1 is None:
            x1 = span[1] if span is not None and span[1] > x0 else x0
        if not x1 > x0:
            continue
        fig.add_shape(
            type="rect",
            xref="x",
            yref="paper",
            x0=x0,
            x1=x1,
            y0=0,
            y1=1,
            fillcolor=BAND_FILLS[drawn % 2],
            opacity=BAND_OPACITY,
            line_width=0,
            layer="below",
            name=f"layout v{band.version}",
        )
        drawn += 1
        share = _width(x0, x1) / full if full else 1.0
        if share < SHORT_LABEL_WIDTH:
            previous_short = False
            continue
        # a label right after a short band's would run on from it ("v2 v3 · 1x2 · F=5"):
        # it goes one line down instead, and the next back up
        lowered = previous_short and not lowered
        previous_short = share < FULL_LABEL_WIDTH
        fig.add_annotation(
            x=x0,
            xref="x",
            y=1,
            yref="paper",
            yshift=-LABEL_LINE_PX if lowered else 0,
            xanchor="left",
            yanchor="top",
            text=band.label if share >= FULL_LABEL_WIDTH else f"v{band.version}",
            hovertext=f"layout {band.label}" + (f"<br>{band.reason}" if band.reason else ""),
            showarrow=False,
            font={"size": 10, "color": LABEL_COLOR},
        )
    for mark, at in zip(tl.marks, marks, strict=True):
        recovery = mark.kind == "recovery"
        color = RECOVERY_COLOR if recovery else GENERATION_COLOR
        fig.add_shape(
            type="line",
            xref="x",
            yref="paper",
            x0=at,
            x1=at,
            y0=0,
            y1=1,
            line={"color": color, "dash": "dash" if recovery else "dot", "width": 1.5},
            layer="above",
            name=mark.label,
        )
        # Rotated along the line, at the bottom: band labels hold the top.
        fig.add_annotation(
            x=at,
            xref="x",
            y=0,
            yref="paper",
            xanchor="right",
            yanchor="bottom",
            textangle=-90,
            text=mark.label,
            hovertext=mark.detail or mark.label,
            showarrow=False,
            font={"size": 10, "color": color},
        )
    return fig
