"""Streamlit pieces every view shares: a chart, a table that fits the page, and the one
smoothing setting. What they show is decided by the pure builders (`dashboard.figures`,
`dashboard.views`); this module only draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import streamlit as st

from pipetransformer.dashboard.views import wrap_height

CHART = {"displaylogo": False}  # plotly's mode bar without its logo link
SMOOTHING_KEY = "smoothing"  # session state: the EMA weight every smoothed curve uses
DEFAULT_SMOOTHING = 0.6


def chart(fig: Any, key: str) -> None:
    st.plotly_chart(fig, key=key, config=CHART, width="stretch")


def table(
    rows: Sequence[Mapping[str, Any]],
    key: str,
    *,
    wide: Mapping[str, int] | None = None,
    pinned: str | None = None,
    columns: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """`rows` as a sortable table as wide as the page. Long text would push the columns after
    it off the right edge: the columns of `wide` get that many pixels each and their text wraps
    (three lines a row where some cell needs more; the whole text on a click). `pinned`, the
    column naming each row, stays in view where a narrow window scrolls the rest. `columns`:
    more Streamlit column settings (labels, number formats); `kwargs` go to `st.dataframe`
    (selection). Returns what `st.dataframe` returns."""
    config: dict[str, dict[str, Any]] = {c: {"width": w} for c, w in (wide or {}).items()}
    if pinned is not None:
        config.setdefault(pinned, {})["pinned"] = True
    for column, setting in (columns or {}).items():
        # a column_config's unset fields are None: they must not undo the width or the pin
        config.setdefault(column, {}).update({k: v for k, v in setting.items() if v is not None})
    return st.dataframe(
        list(rows),
        hide_index=True,
        key=key,
        width="stretch",
        column_config=config,
        row_height=wrap_height(rows, wide or {}),
        placeholder="—",
        **kwargs,
    )


def keep_smoothing() -> None:
    """Keep the smoothing weight across runs that do not draw its slider where they drew it
    last (the sidebar's, or Compare's above its curves): Streamlit forgets a widget's value on a
    run that does not draw it."""
    st.session_state[SMOOTHING_KEY] = st.session_state.get(SMOOTHING_KEY, DEFAULT_SMOOTHING)


def smoothing_slider(where: Any) -> float:
    """The smoothing weight, as TensorBoard's slider sets it (0: the raw values), drawn in
    `where` (`st.sidebar`, or `st` beside the curves it smooths). One setting, whichever slider
    moved it; its value comes from the session state `keep_smoothing` kept."""
    return float(
        where.slider(
            "Smoothing",
            0.0,
            0.99,
            step=0.01,
            key=SMOOTHING_KEY,
            help="exponential moving average of each curve (as TensorBoard's); 0 = raw",
        )
    )
