"""The pipetransformer dashboard (Streamlit): the job's control room.

    pipetransformer dashboard --workdir ./runs            # what most people run
    streamlit run dashboard/app.py -- --db sqlite:////path/to/store.db [--etcd HOST:PORT]
    PIPETRANSFORMER_DB=postgresql+psycopg://... streamlit run dashboard/app.py

(`dashboard.launch.streamlit_command` builds the second form.) It never migrates, writes, or
creates the database: the controller is the store's only writer. Its one action, a manual freeze
request, goes to the running job's etcd for a signed-in user (`dashboard.control`), and the
controller audits it. A running job's page re-reads the store every few seconds by itself.

This file decides which job, which view and how often; `dashboard.job_view` draws the job.
`?job=<id>` selects a job.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import streamlit as st
from sqlalchemy.exc import SQLAlchemyError

from pipetransformer.dashboard import job_view, jobs_view, widgets
from pipetransformer.dashboard.control import freeze_override_control, sign_in_panel, trace_control
from pipetransformer.dashboard.job_view import VIEWS, ChartOptions, job_label
from pipetransformer.dashboard.launch import ENV_DB, Options, options_from, script_args
from pipetransformer.store import JobInfo, Store, sqlite_path

TERMINAL = {"completed", "failed", "interrupted"}


@st.cache_resource(show_spinner=False)
def open_store(url: str) -> Store:
    # One engine per URL for the whole server. Read-only: the controller owns schema and data.
    return Store(url, read_only=True)


def connect(url: str | None) -> Store | None:
    """The store for `url`, or None after explaining on the page why there is none."""
    if not url:
        st.info(
            "No database given. Start the dashboard with `-- --db URL` "
            f"(e.g. `sqlite:////path/to/store.db`) or set `{ENV_DB}`."
        )
        return None
    path = sqlite_path(url)
    if path is not None and not path.is_file():
        # Checked before connecting: SQLite would otherwise create an empty file.
        st.error(
            f"Database not found: `{path}`. It is created when the first job is submitted "
            "(`pipetransformer run <spec>`); check the path."
        )
        return None
    store = open_store(url)
    try:
        revision = store.revision()
    except SQLAlchemyError as exc:
        st.error(f"Cannot read the database {store!r}: {exc}")
        return None
    if revision is None:
        st.error(
            f"{store!r} has no pipetransformer schema yet. The controller creates it when the "
            "first job is submitted."
        )
        return None
    return store


def select_job(jobs: list[JobInfo]) -> JobInfo:
    """Sidebar job list; the selection is mirrored in the `?job=` query parameter."""
    by_id = {j.id: j for j in jobs}
    wanted = st.query_params.get("job")
    if wanted and wanted not in by_id:
        st.sidebar.warning(f"Job `{wanted}` (from the URL) is not in this store.")
    ids = list(by_id)
    chosen = st.sidebar.radio(
        "Jobs (newest first)",
        ids,
        index=ids.index(wanted) if wanted in by_id else 0,
        format_func=lambda job_id: job_label(by_id[job_id]),
        key="job",
    )
    job_id = chosen if chosen in by_id else ids[0]
    if st.query_params.get("job") != job_id:
        st.query_params["job"] = job_id
    return by_id[job_id]


def chart_options(view: str) -> ChartOptions:
    x = st.sidebar.radio("Time axis", ["step", "time"], horizontal=True, key="xaxis")
    widgets.keep_smoothing()
    if view != "Compare":  # Compare draws the slider above its curves (`jobs_view`)
        widgets.smoothing_slider(st.sidebar)
    return ChartOptions(x=x, smoothing=st.session_state[widgets.SMOOTHING_KEY])


def live(
    store: Store,
    seen: JobInfo,
    every: float | None,
    draw: Callable[[JobInfo], None],
) -> None:
    """Draw `draw(job)` now and, while the job runs, again every `every` seconds (a fragment:
    the rest of the page, and the reader's choices, stay as they are). When the job stops
    running, or has a new held-out result the sidebar's job list shows, the whole page reruns
    once (which stops the polling of a job that ended; the list is not left behind)."""

    @st.fragment(run_every=timedelta(seconds=every) if every else None)
    def fragment() -> None:
        job = store.get_job(seen.id)
        if every and (job.state, job.accuracy) != (seen.state, seen.accuracy):
            st.rerun(scope="app")
        draw(job)

    fragment()


def first_job(store: Store, every: float) -> None:
    """Look for the store's first job every `every` seconds; rerun the page once there is one."""

    @st.fragment(run_every=timedelta(seconds=every))
    def poll() -> None:
        if store.list_jobs():
            st.rerun(scope="app")

    poll()


def main() -> None:
    st.set_page_config(page_title="pipetransformer", page_icon="🧱", layout="wide")
    st.sidebar.title("pipetransformer")
    options: Options = options_from(script_args())
    store = connect(options.db)
    if store is None:
        return
    jobs = store.list_jobs()
    if not jobs:
        st.info(
            "No jobs in this store yet. Start one where this store lives (the same `--workdir` "
            "or `--db`), e.g. `pipetransformer run examples/vit-digits-elastic.yaml`: this page "
            "shows it as soon as it is recorded."
        )
        first_job(store, options.refresh_s)
        return
    jobs_view.open_ticked_job()  # before the job list and the view picker are drawn
    selected = select_job(jobs)
    # the picker is drawn below the header; its value is known before
    opts = chart_options(st.session_state.get("view", VIEWS[0]))
    actor = sign_in_panel()
    running = selected.state not in TERMINAL
    every = options.refresh_s if running else None
    if running:
        st.sidebar.caption(f"Live: updates every {options.refresh_s:g} s.")
    live(store, selected, every, lambda job: job_view.header(store, job))
    view = st.radio("View", VIEWS, horizontal=True, key="view", label_visibility="collapsed")
    live(
        store,
        selected,
        every,
        lambda job: job_view.render(view, store, job, jobs, options, opts),
    )
    if view == "Freezing":
        # outside the live fragment: a half-typed reason is never redrawn under the reader
        freeze_override_control(store, selected, options, actor)
    elif view == "Pipeline":
        trace_control(selected, options, actor)


main()
