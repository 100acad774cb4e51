"""Plotly figures of what the freeze policy read: pure functions of the store's
`FreezeSignalRow`s (`Store.freeze_signals`, one per decision point, by step), no I/O, no
Streamlit.

The Freezing view's "distance to threshold": per decision point and block, the statistic the
policy read over the value at or below which the block counts as settled (signal / limit; 1 is
the threshold, below it the block has settled). Drawn as a heat map, blocks on y and decision
steps on x, on a diverging colour scale centred at 1 and logarithmic (a block at half its
threshold is as far on one side as one at twice it on the other). Sized like
`dashboard.figures`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go

from pipetransformer.dashboard.figures import (
    HEIGHT,
    base_figure,
    empty_figure,
    frozen_layer,
)
from pipetransformer.store.rows import FreezeSignalRow

SIGNAL_TITLE = "Distance to the freeze threshold"
NO_SIGNALS_TEXT = "no freeze signals reported"
# how each statistic reads to a person
STATISTIC_TEXT = {
    "output_rate": "output rate on the probe batch",
    "gradient_drift": "gradient drift ratio",
    "gradient_norm": "mean gradient norm",
}
# Colours saturate beyond 100x either side of the threshold (log10 ratio of +-2): further is
# "very far" either way, and a wider scale would wash out the blocks near it.
MAX_DECADES = 2.0
MIN_DECADES = 0.5  # the scale spans at least 1/sqrt(10)..sqrt(10): near-1 ratios stay pale
# settled (below 1) in blue, still moving (above 1) in red, the threshold white
SIGNAL_COLORSCALE = "RdBu_r"
BOUNDARY_COLOR = "black"
CAP_COLOR = "#555555"


def threshold_ratio(signal: float | None, limit: float | None) -> float | None:
    """signal / limit: 1 at the threshold, below 1 settled. None where either is unknown (or
    not finite); a limit of 0 gives 1 for a signal of 0 (at the threshold, settled) and inf for
    any other."""
    if signal is None or limit is None or not (math.isfinite(signal) and math.isfinite(limit)):
        return None
    if limit <= 0:
        return 1.0 if signal <= limit else math.inf
    return signal / limit


def _decades(ratio: float) -> float:
    """log10 of the ratio, held within +-MAX_DECADES (0 and inf saturate the scale)."""
    if ratio <= 0:
        return -MAX_DECADES
    if math.isinf(ratio):
        return MAX_DECADES
    return max(-MAX_DECADES, min(MAX_DECADES, math.log10(ratio)))


def _value(v: float | None) -> str:
    return "unknown" if v is None else f"{v:.4g}"


def _ratio_text(ratio: float | None) -> str:
    if ratio is None:
        return "unknown"
    if math.isinf(ratio):
        return "∞ × the threshold (not settled)"
    state = "settled" if ratio <= 1 else "not settled"
    return f"{ratio:.3g} × the threshold ({state})"


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _hover(row: FreezeSignalRow, block: int, ratio: float | None, frozen: bool) -> str:
    signal = row.signal[block] if block < len(row.signal) else None
    limit = row.limits[block] if block < len(row.limits) else None
    head = f"block {block} · step {row.step} (decision point {row.decision})"
    if frozen:
        head += " · frozen before it"
    return (
        f"{head}<br>{STATISTIC_TEXT.get(row.statistic, row.statistic)}: {_value(signal)}"
        f"<br>settles at or below: {_value(limit)}<br>{_ratio_text(ratio)}"
        f"<br>F after it: {row.boundary} · cap: {row.bound}"
        f"<br>reading it took {_seconds(row.probe_s)}"
    )


# colour bar ticks: (log10 of the ratio, how it reads)
_TICKS = (
    (-2.0, "×0.01"),
    (-1.0, "×0.1"),
    (-math.log10(3), "×0.33"),
    (0.0, "×1"),
    (math.log10(3), "×3"),
    (1.0, "×10"),
    (2.0, "×100"),
)


def _ticks(span: float) -> tuple[list[float], list[str]]:
    """The colour bar's ticks within +-span decades."""
    shown = [(v, t) for v, t in _TICKS if abs(v) <= span + 1e-9]
    return [v for v, _ in shown], [t for _, t in shown]


def signal_figure(signals: Sequence[FreezeSignalRow]) -> go.Figure:
    """How far each block is from its freeze threshold at each decision point, as a heat map.

    Blocks on y (block 0 at the bottom), one column per decision point (`signals` by step, x the
    step), colour = signal / limit on a log scale centred at 1 (`threshold_ratio`; blue below:
    settled, red above; unknown ratios are gaps). Blocks frozen before a decision point (below
    the boundary after the previous one) are drawn grey by a separate trace: what the policy
    read of them is not a reason to freeze. On top: the freeze boundary after each decision
    point (solid) and the automatic cap (`bound`, dashed) as step lines between blocks. Hover
    gives the signal, the limit, the ratio, the statistic and what reading it took."""
    fig = base_figure(SIGNAL_TITLE, "decision step", "block", hovermode="closest")
    rows = sorted(signals, key=lambda r: r.step)
    if not rows:
        return empty_figure(fig, NO_SIGNALS_TEXT)
    blocks = max(max(len(r.signal), len(r.limits)) for r in rows)
    if blocks == 0:
        return empty_figure(fig, NO_SIGNALS_TEXT)
    xs = [r.step for r in rows]
    z: list[list[float | None]] = [[] for _ in range(blocks)]
    frozen: list[list[int | None]] = [[] for _ in range(blocks)]
    text: list[list[str]] = [[] for _ in range(blocks)]
    before = 0  # the boundary in force when each decision point read its signal
    known: list[float] = []
    for row in rows:
        for b in range(blocks):
            is_frozen = b < before
            s = row.signal[b] if b < len(row.signal) else None
            limit = row.limits[b] if b < len(row.limits) else None
            ratio = threshold_ratio(s, limit)
            value = None if ratio is None or is_frozen else _decades(ratio)
            if value is not None:
                known.append(value)
            z[b].append(value)
            frozen[b].append(1 if is_frozen else None)
            text[b].append(_hover(row, b, ratio, is_frozen))
        before = row.boundary
    ys = list(range(blocks))
    if any(c is not None for col in frozen for c in col):
        fig.add_trace(frozen_layer(xs, ys, frozen, "%{text}<extra></extra>", text=text))
    # symmetric about 1, so the threshold is the scale's white middle
    span = min(MAX_DECADES, max([MIN_DECADES, *(abs(v) for v in known)]))
    tickvals, ticktext = _ticks(span)
    fig.add_trace(
        go.Heatmap(
            name="signal / limit",
            x=xs,
            y=ys,
            z=z,
            text=text,
            colorscale=SIGNAL_COLORSCALE,
            zmin=-span,
            zmid=0,
            zmax=span,
            colorbar={
                "title": {"text": "signal / limit", "side": "right"},
                "thickness": 12,
                "tickvals": tickvals,
                "ticktext": ticktext,
            },
            hoverongaps=False,
            hovertemplate="%{text}<extra></extra>",
        )
    )
    for name, values, dash, color in (
        ("freeze boundary", [r.boundary for r in rows], "solid", BOUNDARY_COLOR),
        ("automatic cap", [r.bound for r in rows], "dash", CAP_COLOR),
    ):
        fig.add_trace(
            go.Scatter(
                name=name,
                x=xs,
                # between the last frozen (or freezable) block and the next one
                y=[v - 0.5 for v in values],
                customdata=values,
                mode="lines",
                # hvh: steps halfway between columns, where the heat map's cells meet
                line_shape="hvh",
                line={"color": color, "width": 2, "dash": dash},
                showlegend=True,
                hovertemplate=f"{name}: %{{customdata}}<extra></extra>",
            )
        )
    fig.update_yaxes(range=[-0.5, blocks - 0.5], dtick=1 if blocks <= 16 else None)
    fig.update_layout(height=max(HEIGHT, min(600, 160 + 16 * blocks)))
    return fig


def signal_caption(signals: Sequence[FreezeSignalRow]) -> str:
    """One line under the figure: which policy read which statistic, over how many decision
    points, and what reading it cost."""
    if not signals:
        return ""
    in_order = sorted(signals, key=lambda r: r.step)
    reads = list(dict.fromkeys((r.policy, r.statistic) for r in in_order))  # first seen first
    what = "; ".join(f"{STATISTIC_TEXT.get(stat, stat)} (policy '{p}')" for p, stat in reads)
    steps = [r.step for r in signals]
    n = len(signals)
    points = f"{n} decision point{'s' if n != 1 else ''} (steps {min(steps)}-{max(steps)})"
    if n == 1:
        points = f"1 decision point (step {steps[0]})"
    probe = sum(r.probe_s for r in signals) / n
    cost = f"; reading it took {_seconds(probe)} per decision point on average" if probe else ""
    return (
        f"Each block's {what} over the value at or below which it counts as settled: 1 is the "
        f"threshold, below it (blue) the block has settled. {points}{cost}. Grey: frozen before "
        "the decision point; the solid line is the freeze boundary after it, the dashed one the "
        "automatic cap."
    )


def no_signals_text(policy: str) -> str:
    """Why a job has no freeze signals to draw, by its spec's `freeze.policy`."""
    if policy in ("schedule", "off"):
        return (
            f"Policy '{policy}' reads no per-block signal (it freezes by the schedule alone, or "
            "not at all), so there is no distance to a threshold to draw."
        )
    return (
        "No freeze signals reported yet: rank 0 reports what the policy read at every decision "
        "point (jobs run before this was recorded have none)."
    )
