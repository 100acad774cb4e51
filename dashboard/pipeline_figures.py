"""Plotly figures of where a pipeline's time goes: pure functions of measured stage timings (no
I/O, no Streamlit).

Inputs are what the store and the core give: `StageTimesRow`s as `Store.stage_times` returns
them (one per rank and reporting interval), `RankTimes` as `core.stage_times.per_rank` sums
them for one layout version, the `Layout` they were measured under, the `RecordedLayout`
history of `Store.layouts`, and one traced step's `StepTraceRow`s (`Store.step_traces`). Phases are stacked in `core.stage_times.PHASES` order, named by
`PHASE_LABELS` and always drawn in the same colour (`PHASE_COLORS`), so a bar reads the same
in every layout version. Sized like `dashboard.figures`: about 800 px wide, legends below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import plotly.graph_objects as go

from pipetransformer.core.stage_times import (
    PHASE_LABELS,
    PHASES,
    RankTimes,
    measured_bubble,
    theoretical_bubble,
)
from pipetransformer.core.state import Layout
from pipetransformer.dashboard.figures import HEIGHT, LEGEND, base_figure, empty_figure, stage_color
from pipetransformer.dashboard.timeline import Band, Timeline, band_label, decorate
from pipetransformer.store.rows import RecordedLayout, StageTimesRow, StepTraceRow

# One colour per phase, the same in every chart: the stage's own work in blues, waiting on a
# neighbour in red, the rest of the step in its own colours, what no phase measured in grey.
PHASE_COLORS: dict[str, str] = {
    "forward": "#4c78a8",
    "backward": "#72b7b2",
    "pipeline_wait": "#e45756",
    "grad_sync": "#f58518",
    "optimizer": "#b279a2",
    "frozen_prefix": "#9d755d",
    "data_wait": "#eeca3b",
    "checkpoint": "#54a24b",
    "evaluation": "#ff9da6",
    "other": "#bab0ac",
}
BUBBLE_COLOR = PHASE_COLORS["pipeline_wait"]
BUSY_COLOR = PHASE_COLORS["forward"]
THEORY_COLOR = "#555555"
NO_TIMINGS_TEXT = "no stage timings reported yet"
NO_TRACE_TEXT = "no traced step yet: capture one (a running job) to see its schedule"
THEORY_NAME = "schedule's bubble (theory)"


# ---- common pieces


def _base(title: str, x_title: str, y_title: str, height: int = HEIGHT) -> go.Figure:
    # bars, not lines over a shared x: each hover names its own bar
    return base_figure(title, x_title, y_title, height, hovermode="closest")


def _explain(fig: go.Figure, text: str) -> go.Figure:
    """An empty figure that says why it is empty."""
    return empty_figure(fig, text)


def stages_text(stages: Sequence[int]) -> str:
    """A rank's stages: "stage 1", or "stages 0+2" for several (virtual) stages."""
    if len(stages) == 1:
        return f"stage {stages[0]}"
    return "stages " + "+".join(map(str, stages))


def rank_name(r: RankTimes) -> str:
    """A rank as the Pipeline view names it: "stage 1 · replica 0 (rank 1)"."""
    return f"{stages_text(r.stages)} · replica {r.replica} (rank {r.rank})"


def shape_text(layout: Layout) -> str:
    """A layout in short: version, pipeline ranks x replicas, micro-batches and schedule, e.g.
    "v2 · 2x1 · m=4 gpipe"."""
    virtual = f" ({layout.virtual_stages} stages per rank)" if layout.virtual_stages > 1 else ""
    return (
        f"v{layout.version} · {layout.pipeline_ranks}x{layout.replicas} · "
        f"m={layout.microbatches} {layout.schedule}{virtual}"
    )


def layout_theory(layout: Layout) -> float | None:
    """The bubble `layout`'s schedule implies (`core.stage_times.theoretical_bubble`)."""
    return theoretical_bubble(
        layout.schedule, layout.pipeline_ranks, layout.microbatches, layout.virtual_stages
    )


def _fraction(value: float, whole: float) -> float:
    return value / whole if whole > 0 else 0.0


# ---- one layout version


def breakdown_figure(ranks: Sequence[RankTimes], layout: Layout) -> go.Figure:
    """Where each rank's time went under `layout`: one stacked horizontal bar per rank (rank 0
    on top), one trace per phase in `PHASES` order, each segment the phase's share of the
    rank's wall time. The phases add up to the wall time (`other` is what none measured; where
    the measured phases overran the wall clock their sum is the whole), so every bar ends at
    100%. Phases no rank spent time in are left out of the legend. Hover: seconds and share."""
    fig = _base(
        f"Time per phase · layout {shape_text(layout)}",
        "share of wall time",
        "",
        height=max(HEIGHT, 150 + 34 * len(ranks)),
    )
    fig.update_xaxes(tickformat=".0%", range=[0, 1])
    if not ranks:
        return _explain(fig, f"{NO_TIMINGS_TEXT} under layout v{layout.version}")
    names = [rank_name(r) for r in ranks]
    wholes = [r.seconds.total() for r in ranks]
    for phase in PHASES:
        seconds = [getattr(r.seconds, phase) for r in ranks]
        if not any(s > 0 for s in seconds):
            continue
        label = PHASE_LABELS[phase]
        fig.add_trace(
            go.Bar(
                name=label,
                x=[_fraction(s, w) for s, w in zip(seconds, wholes, strict=True)],
                y=names,
                orientation="h",
                marker={"color": PHASE_COLORS[phase]},
                texttemplate="%{x:.0%}",
                textposition="inside",
                insidetextanchor="middle",
                customdata=[
                    [s, s / max(r.intervals, 1), r.intervals]
                    for s, r in zip(seconds, ranks, strict=True)
                ],
                hovertemplate=f"%{{y}}<br>{label}: %{{customdata[0]:.2f}} s (%{{x:.1%}})"
                "<br>%{customdata[1]:.3f} s per interval over %{customdata[2]} interval(s)"
                "<extra></extra>",
            )
        )
    fig.update_layout(
        barmode="stack",
        hovermode="closest",
        # the legend in phase order (plotly reverses it for stacked bars), shares that do not
        # fit their segment left out rather than shrunk
        legend={**LEGEND, "traceorder": "normal"},
        uniformtext={"minsize": 9, "mode": "hide"},
        # rank 0 on top, like a process list
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(names))},
    )
    return fig


@dataclass(frozen=True)
class StageBubble:
    """The measured bubble of one pipeline position (the stages a rank runs): the mean over its
    replicas, and each replica's own (rank, bubble)."""

    stages: tuple[int, ...]
    mean: float
    replicas: tuple[tuple[int, float], ...]


def stage_bubbles(ranks: Sequence[RankTimes]) -> list[StageBubble]:
    """The measured bubble per pipeline stage (mean over its replicas), in pipeline order;
    ranks whose schedule did not run (no forward, backward or wait) are left out."""
    by_stages: dict[tuple[int, ...], list[tuple[int, float]]] = {}
    for r in ranks:
        if (b := r.bubble) is not None:
            by_stages.setdefault(r.stages, []).append((r.rank, b))
    return [
        StageBubble(stages, sum(b for _, b in found) / len(found), tuple(found))
        for stages, found in sorted(by_stages.items())
    ]


def bubble_figure(ranks: Sequence[RankTimes], layout: Layout) -> go.Figure:
    """The measured bubble (waiting for a neighbour stage over the schedule's time) of each
    pipeline stage under `layout`, the mean over its replicas as a bar, beside the bubble the
    schedule implies for this shape as a dashed line (`theoretical_bubble`; said in words for
    the zero-bubble schedules, which have no closed form). Hover lists every replica."""
    fig = _base(f"Pipeline bubble · layout {shape_text(layout)}", "", "bubble")
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    measured = stage_bubbles(ranks)
    theory = layout_theory(layout)
    if theory is not None:
        fig.add_hline(
            y=theory,
            line={"dash": "dash", "color": THEORY_COLOR, "width": 2},
            name=THEORY_NAME,
            annotation_text=f"schedule {theory:.0%}",
            annotation_position="top right",
        )
    else:
        fig.add_annotation(
            text=f"{layout.schedule} fills its bubble: no closed form to compare with",
            showarrow=False,
            xref="paper",
            yref="paper",
            x=1,
            y=1,
            xanchor="right",
            yanchor="bottom",
            font={"size": 10, "color": THEORY_COLOR},
        )
    if not measured:
        text = (
            f"{NO_TIMINGS_TEXT} under layout v{layout.version}"
            if not ranks
            else "no rank ran the pipeline schedule in these intervals"
        )
        return _explain(fig, text)
    fig.add_trace(
        go.Bar(
            name="measured (mean over replicas)",
            x=[stages_text(m.stages) for m in measured],
            y=[m.mean for m in measured],
            marker={"color": [stage_color(m.stages[0]) for m in measured]},
            text=[f"{m.mean:.0%}" for m in measured],
            textposition="outside",
            cliponaxis=False,
            customdata=[
                "<br>".join(f"rank {rank}: {b:.1%}" for rank, b in m.replicas) for m in measured
            ],
            hovertemplate="%{x}: %{y:.1%} measured<br>%{customdata}<extra></extra>",
        )
    )
    top = max([m.mean for m in measured] + ([theory] if theory is not None else []))
    fig.update_yaxes(range=[0, max(0.05, top * 1.25)])
    fig.update_layout(hovermode="closest", showlegend=False)
    return fig


# ---- over steps, across layout versions


@dataclass(frozen=True)
class IntervalReading:
    """The ranks' mean measured bubble and busy fraction over the interval ending at `step`."""

    step: int
    layout_version: int
    bubble: float | None  # None: no rank ran the schedule (nothing to wait for)
    busy: float | None  # None: no wall time
    ranks: int


def interval_readings(rows: Sequence[StageTimesRow]) -> list[IntervalReading]:
    """One reading per interval end (`to_step`), in step order: the mean over ranks of the
    measured bubble and of forward + backward over wall time. A step measured by two
    generations (a restart from an earlier checkpoint) takes each rank's newest generation."""
    by_step: dict[int, dict[int, StageTimesRow]] = {}
    for r in rows:
        ranks = by_step.setdefault(r.to_step, {})
        prev = ranks.get(r.rank)
        if prev is None or r.generation >= prev.generation:
            ranks[r.rank] = r
    out = []
    for step in sorted(by_step):
        found = list(by_step[step].values())
        bubbles = [b for b in (measured_bubble(r.seconds) for r in found) if b is not None]
        busy = [r.seconds.compute() / r.wall_s for r in found if r.wall_s > 0]
        out.append(
            IntervalReading(
                step=step,
                layout_version=max(r.layout_version for r in found),
                bubble=sum(bubbles) / len(bubbles) if bubbles else None,
                busy=sum(busy) / len(busy) if busy else None,
                ranks=len(found),
            )
        )
    return out


@dataclass(frozen=True)
class VersionSpan:
    """The steps a layout version was measured over: from the step its first interval began
    after (`from_step`, where it took effect) to the next version's start, or to its last
    measured interval's end when no later version was measured."""

    version: int
    start: int
    end: int


def version_spans(rows: Sequence[StageTimesRow]) -> list[VersionSpan]:
    """Each measured layout version's span on the step axis, in the order they took effect."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for r in rows:
        v = r.layout_version
        first[v] = min(first.get(v, r.from_step), r.from_step)
        last[v] = max(last.get(v, r.to_step), r.to_step)
    order = sorted(first, key=lambda v: (first[v], v))
    spans = []
    for i, v in enumerate(order):
        end = first[order[i + 1]] if i + 1 < len(order) else last[v]
        spans.append(VersionSpan(v, first[v], max(end, first[v] + 1)))
    return spans


def bubble_over_time_figure(
    rows: Sequence[StageTimesRow], layouts: Sequence[RecordedLayout]
) -> go.Figure:
    """The ranks' mean measured bubble and busy fraction (forward + backward over wall time)
    per interval, at the interval's last step, with each layout version's span as a labelled
    band (`dashboard.timeline.decorate`) and, within it, the bubble its schedule implies as a
    dashed line: a re-layout's effect on the pipeline is seen at a glance."""
    fig = _base("Bubble and busy share over steps", "step", "share of time")
    fig.update_yaxes(tickformat=".0%", range=[0, 1.02])
    readings = interval_readings(rows)
    if not readings:
        return _explain(fig, NO_TIMINGS_TEXT)
    steps = [r.step for r in readings]
    info = [[r.layout_version, r.ranks] for r in readings]
    for name, values, color in (
        ("bubble (measured)", [r.bubble for r in readings], BUBBLE_COLOR),
        ("busy: forward + backward", [r.busy for r in readings], BUSY_COLOR),
    ):
        fig.add_trace(
            go.Scatter(
                name=name,
                x=steps,
                y=values,
                mode="lines+markers",
                marker={"size": 4},
                line={"color": color, "width": 2},
                customdata=info,
                hovertemplate=f"{name} %{{y:.1%}}"
                "<br>layout v%{customdata[0]} · %{customdata[1]} rank(s)<extra></extra>",
            )
        )
    by_version = {rec.layout.version: rec for rec in layouts}
    spans = version_spans(rows)
    xs: list[int | None] = []
    ys: list[float | None] = []
    for span in spans:
        rec = by_version.get(span.version)
        theory = None if rec is None else layout_theory(rec.layout)
        if theory is not None:
            xs += [span.start, span.end, None]
            ys += [theory, theory, None]
    if xs:
        fig.add_trace(
            go.Scatter(
                name=THEORY_NAME,
                x=xs,
                y=ys,
                mode="lines",
                line={"color": THEORY_COLOR, "dash": "dash", "width": 1.5},
                hovertemplate="schedule's bubble %{y:.1%}<extra></extra>",
            )
        )
    t0 = min(r.time for r in rows)
    bands = []
    for span in spans:
        rec = by_version.get(span.version)
        bands.append(
            Band(
                version=span.version,
                label=f"v{span.version}" if rec is None else band_label(rec.layout),
                start_step=span.start,
                end_step=span.end,
                start_time=t0,
                end_time=None,
                boundary=0 if rec is None else rec.layout.freeze_boundary,
                reason="" if rec is None else rec.reason,
            )
        )
    fig.update_layout(hovermode="x unified")
    return decorate(fig, Timeline(bands=bands, marks=[]), "step")


# ---- predicted against measured


def stage_compute_per_step(ranks: Sequence[RankTimes]) -> dict[int, float]:
    """Per pipeline stage, the measured forward + backward seconds per step (the mean over the
    ranks that run it; a rank running several stages counts for its first)."""
    by_stage: dict[int, list[float]] = {}
    for r in ranks:
        by_stage.setdefault(r.stages[0], []).append(r.per_step_compute_s)
    return {s: sum(v) / len(v) for s, v in sorted(by_stage.items())}


def unplanned_text(layout: Layout, reason: str | None) -> str:
    """What a layout without AutoPipe's prediction was planned from: the spec's split for the
    job's first layout, else its recorded reason (a re-plan at a freeze, a recovery)."""
    if layout.version == 1 and (reason is None or reason == "initial"):
        return "not planned from measurement (the spec's split)"
    why = f": {reason}" if reason else ""
    return f"no AutoPipe prediction recorded for v{layout.version}{why}"


def predicted_figure(
    ranks: Sequence[RankTimes],
    layout: Layout,
    predicted: Sequence[float] | None,
    reason: str | None = None,
) -> go.Figure:
    """AutoPipe's predicted forward + backward seconds per step of each stage beside the
    measured ones, under `layout` (`predicted`: `LayoutPlanned.predicted_stage_s`, None where
    the layout was not planned from measurement; `reason`: why the layout was recorded, which
    says where it came from instead)."""
    fig = _base(
        f"Stage compute per step, planned and measured · v{layout.version}", "", "ms per step"
    )
    measured = stage_compute_per_step(ranks)
    if not measured:
        return _explain(fig, NO_TIMINGS_TEXT)
    names = [f"stage {s}" for s in measured]
    fig.add_bar(
        x=names,
        y=[v * 1e3 for v in measured.values()],
        name="measured",
        marker_color=BUSY_COLOR,
        hovertemplate="%{x}: %{y:.2f} ms measured<extra></extra>",
    )
    if predicted:
        fig.add_bar(
            x=names,
            y=[predicted[s] * 1e3 if s < len(predicted) else None for s in measured],
            name="planned (AutoPipe)",
            marker_color=THEORY_COLOR,
            hovertemplate="%{x}: %{y:.2f} ms planned<extra></extra>",
        )
    else:
        fig.add_annotation(
            text=unplanned_text(layout, reason),
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0.5,
            y=1.0,
            yanchor="bottom",
        )
    fig.update_layout(barmode="group")
    return fig


# ---- one traced step


# a compute span's text: "F3" / "B3" for micro-batch 3's forward / backward
SPAN_LETTERS = {"forward": "F", "backward": "B"}
LANE_HEIGHT = 34  # px per lane of the Gantt chart


def lane_name(rank: int, stage: int | None, generation: int | None = None) -> str:
    """A Gantt lane: "rank 1 · stage 1"; "rank 0 · step" for what a rank of several stages did
    outside any one of them; " · gen 2" added where the trace spans several generations."""
    where = "step" if stage is None else f"stage {stage}"
    gen = "" if generation is None else f" · gen {generation}"
    return f"rank {rank} · {where}{gen}"


def _span_stage(row: StepTraceRow, stage: int | None) -> int | None:
    # a span outside the stages (waiting, gradient sync, optimizer, data) belongs to the rank's
    # one stage when it holds one; a rank of several stages keeps a lane for them ("step")
    if stage is None and len(row.stages) == 1:
        return row.stages[0]
    return stage


def trace_lanes(rows: Sequence[StepTraceRow]) -> list[str]:
    """The Gantt chart's lanes, top to bottom: each rank's stages (rank 0 first), then, for a
    rank of several stages with spans outside them, its "step" lane."""
    several = len({r.generation for r in rows}) > 1
    lanes: list[str] = []
    for r in sorted(rows, key=lambda r: (r.rank, r.generation)):
        spans = {_span_stage(r, s.stage) for s in r.spans}
        stages: list[int | None] = [*r.stages, *sorted(s for s in spans - {None} - set(r.stages))]
        if None in spans:
            stages.append(None)
        for stage in stages:
            name = lane_name(r.rank, stage, r.generation if several else None)
            if name not in lanes:
                lanes.append(name)
    return lanes


def _steps_text(rows: Sequence[StepTraceRow]) -> str:
    steps = sorted({r.step for r in rows})
    return f"Step {steps[0]}" if len(steps) == 1 else f"Steps {steps[0]}-{steps[-1]}"


def trace_figure(rows: Sequence[StepTraceRow]) -> go.Figure:
    """One traced step (the rows of one trace request, `Store.step_traces`) as a Gantt chart:
    one lane per rank and stage ("rank 1 · stage 1", rank 0 on top), one bar per span on the
    milliseconds since the earliest rank's start of the step (each rank's spans shifted by its
    own `started`, so the ranks line up as their clocks say), coloured by phase as in the
    breakdown (`PHASE_COLORS`, one legend entry per phase in `PHASES` order). A forward or
    backward bar reads "F3" / "B3" for micro-batch 3; hover: lane, phase, micro-batch, start
    and duration. Spans outside a stage (waiting, gradient sync, optimizer, data) sit on the
    rank's lane when it holds one stage, else on its "step" lane."""
    lanes = trace_lanes(rows)
    fig = _base(
        "One step's schedule",
        "ms from the first rank's start of the step",
        "",
        height=max(HEIGHT, 150 + LANE_HEIGHT * len(lanes)),
    )
    if not rows:
        return _explain(fig, NO_TRACE_TEXT)
    several = len({r.generation for r in rows}) > 1
    t0 = min(r.started for r in rows)
    bars: dict[str, dict[str, list[object]]] = {}
    end = 0.0
    for r in sorted(rows, key=lambda r: (r.rank, r.generation)):
        offset = (r.started - t0) * 1e3
        gen = r.generation if several else None
        for s in r.spans:
            start, duration = offset + s.start_s * 1e3, (s.end_s - s.start_s) * 1e3
            end = max(end, start + duration)
            bar = bars.setdefault(
                s.phase, {"base": [], "x": [], "y": [], "text": [], "customdata": []}
            )
            bar["base"].append(start)
            bar["x"].append(duration)
            bar["y"].append(lane_name(r.rank, _span_stage(r, s.stage), gen))
            letter = SPAN_LETTERS.get(s.phase)
            bar["text"].append(
                f"{letter}{'' if s.microbatch is None else s.microbatch}" if letter else ""
            )
            mb = "" if s.microbatch is None else f" · micro-batch {s.microbatch}"
            bar["customdata"].append([mb, start, duration])
    for phase in PHASES:
        if (bar := bars.get(phase)) is None:
            continue
        label = PHASE_LABELS[phase]
        fig.add_trace(
            go.Bar(
                name=label,
                orientation="h",
                marker={"color": PHASE_COLORS[phase], "line": {"width": 0.5, "color": "white"}},
                textposition="inside",
                insidetextanchor="middle",
                hovertemplate=f"%{{y}}<br>{label}%{{customdata[0]}}"
                "<br>start %{customdata[1]:.2f} ms · %{customdata[2]:.2f} ms<extra></extra>",
                **bar,
            )
        )
    clocks = sorted({r.clock for r in rows})
    versions = sorted({r.layout_version for r in rows})
    fig.update_layout(
        title={
            "text": f"One step's schedule · {_steps_text(rows)} on {len(rows)} rank(s) · "
            f"layout {', '.join(f'v{v}' for v in versions)} · "
            f"{' and '.join('CUDA events' if c == 'cuda' else 'host clock' for c in clocks)}"
        },
        barmode="overlay",
        bargap=0.25,
        hovermode="closest",
        legend={**LEGEND, "traceorder": "normal"},
        # a micro-batch's name where it fits its bar, nothing where it does not
        uniformtext={"minsize": 8, "mode": "hide"},
        yaxis={"categoryorder": "array", "categoryarray": list(reversed(lanes))},
    )
    fig.update_xaxes(range=[0, max(end, 1e-3) * 1.02])
    return fig
