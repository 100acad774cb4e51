"""The views over several jobs: Compare (the page's job beside others: a summary table and their
curves overlaid, smoothed) and Runs (every job in the store with summary columns; ticking a row
opens that job). Rows come from `dashboard.views`, figures from `dashboard.figures`;
`dashboard.app` opens a job ticked here (`open_ticked_job`).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import streamlit as st

from pipetransformer.core.recoveries import ABORTED, STARTED, recoveries
from pipetransformer.dashboard import figures, views, widgets
from pipetransformer.dashboard.timeline import XAxis
from pipetransformer.store import JobInfo, Store

RUNS_KEY = "runs"  # the runs table's selection
OPEN_JOB_KEY = "open_job"  # session state: the job ticked in the runs table, for the next run
JOB_KEY, VIEW_KEY = "job", "view"  # the sidebar's job list and the view picker (`dashboard.app`)
FIRST_VIEW = "Training"  # where a job opened from the runs table opens

_HELD_OUT = (
    "held-out accuracy (question answering: exact match; a language model: next-token accuracy)"
)
_number = st.column_config.NumberColumn
# shared by both tables: how their numbers read, and what each column means
COLUMNS: dict[str, Any] = {
    "final": _number(format="percent", help=f"the newest {_HELD_OUT}"),
    "best": _number(format="percent", help=f"the best {_HELD_OUT}"),
    "final ppl": _number(format="%.2f", help="a language model's newest held-out perplexity"),
    "best ppl": _number(format="%.2f", help="a language model's lowest held-out perplexity"),
    "duration": _number(
        format="%.1f min", help="from the job's creation to its last update (its end, once ended)"
    ),
    "samples/s": _number(format="%.0f", help="samples per second of step time over the run"),
    "speed-up": _number(format="%.2f×", help="samples/s over the first job's"),
    "frozen": st.column_config.Column(
        help="frozen blocks in the job's last layout, of its model's"
    ),
    "recoveries": _number(help="generations that failed and were taken over by a new one"),
    "created": st.column_config.Column(help="UTC"),
}


# ---- Compare


def compare_view(store: Store, job: JobInfo, jobs: list[JobInfo], x: XAxis) -> None:
    """`job` beside the jobs the reader picks: one row each (speed-up against `job`), then the
    curves overlaid with the smoothing slider above them."""
    left, right = st.columns([3, 1])
    with left:
        others = [j.id for j in jobs if j.id != job.id]
        chosen = st.multiselect("Compare with", others, key="compare", placeholder="pick jobs")
    with right:
        # beside the curves it smooths (the sidebar leaves it out on this view: one setting)
        sm = widgets.smoothing_slider(st)
    by_id = {j.id: j for j in jobs} | {job.id: job}
    ids = [job.id, *chosen]
    metrics = {i: store.metrics(i) for i in ids}
    evaluations = {i: store.evaluations(i) for i in ids}
    rows = views.compare_rows([by_id[i] for i in ids], metrics, evaluations)
    widgets.table(rows, "compare_summary", pinned="job", columns=COLUMNS)
    st.caption(
        f"Speed-up: samples/s over {job.id}'s (samples per second of step time over the whole "
        "run); duration: from creation to the last update."
    )
    left, right = st.columns(2)
    with left:
        widgets.chart(
            figures.compare_figure(metrics, "loss", x=x, smoothing=sm, title="Training loss"),
            "compare_loss",
        )
    with right:
        widgets.chart(
            figures.compare_figure(
                metrics, "samples_per_s", x=x, smoothing=sm, title="Throughput (samples/s)"
            ),
            "compare_throughput",
        )
    # one point per evaluation: an average over so few would lag behind what was measured
    widgets.chart(
        figures.compare_figure(
            evaluations, "accuracy", x=x, smoothing=0.0, title="Held-out accuracy"
        ),
        "compare_accuracy",
    )
    if sm > 0:
        st.caption(
            f"Loss and throughput smoothed ({sm:.2f}), each job's raw curve faint beneath; "
            "held-out accuracy as measured."
        )


# ---- Runs


@st.cache_data(show_spinner=False, max_entries=2000, ttl=timedelta(minutes=5))
def _reads(
    _store: Store, _job: JobInfo, url: str, job_id: str, updated: datetime, state: str
) -> tuple[views.HeldOut, int]:
    # What a job's row reads beyond its job row: its held-out results and its recoveries.
    # Keyed by the job's last update and state: a finished job's are read once, a running
    # job's again after each progress the controller records (the time-to-live bounds those of
    # a job that stopped reporting). `url`: stores served by one process share the cache.
    events = _store.events(job_id, limit=100_000, kinds=[ABORTED, STARTED])
    return views.held_out(_job, _store.evaluations(job_id)), len(recoveries(events, ()))


def run_rows(store: Store, jobs: list[JobInfo]) -> list[dict[str, Any]]:
    """The runs table's rows, one per job in `jobs`' order (`views.run_row`), each job's
    evaluations and events read once per change of the job."""
    return views.without_empty(
        [views.run_row(j, *_reads(store, j, store.url, j.id, j.updated_at, j.state)) for j in jobs]
    )


def runs_view(store: Store) -> None:
    """Every job in the store, newest first, with summary columns; ticking a row opens that
    job (on the next run of the page, `open_ticked_job`)."""
    jobs = store.list_jobs()  # this run's: the sidebar's list is as old as the page's last run
    rows = run_rows(store, jobs)
    st.caption(
        f"{len(rows)} job(s) in this store, newest first. Click a column's name to sort by it; "
        "tick a row to open its job."
    )
    event = widgets.table(
        rows,
        RUNS_KEY,
        pinned="job",
        columns=COLUMNS,
        on_select="rerun",
        selection_mode="single-row",
    )
    ticked = event.selection.rows  # positions in `rows`, however the reader sorted them
    if ticked:
        st.session_state[OPEN_JOB_KEY] = rows[ticked[0]]["job"]
        st.rerun(scope="app")  # the sidebar, the header and the view change with the job


def open_ticked_job() -> None:
    """Open the job ticked in the runs table, if one was: the URL names it, the sidebar's list
    starts from it and the view is the job's first. Called before those widgets are drawn (their
    values may not change after)."""
    job_id = st.session_state.pop(OPEN_JOB_KEY, None)
    if job_id is None:
        return
    st.query_params[JOB_KEY] = job_id
    # forgotten, not set: the list then takes the URL's job as its default, and Streamlit
    # warns of a widget given both a default and a value
    st.session_state.pop(JOB_KEY, None)
    st.session_state[VIEW_KEY] = FIRST_VIEW
