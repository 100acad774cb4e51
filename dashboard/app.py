"""The pipetransformer dashboard (Streamlit).

    streamlit run dashboard/app.py -- --db sqlite:////path/to/store.db
    PIPETRANSFORMER_DB=postgresql+psycopg://... streamlit run dashboard/app.py

(`dashboard.launch.streamlit_command` builds the first form.) A reader only: it never migrates,
writes, or creates the database. Data comes through `orchestrator.store.Store`, figures from
`dashboard.figures`; this file only arranges them. `?job=<id>` selects a job.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import streamlit as st
from sqlalchemy.exc import SQLAlchemyError

from dashboard import figures
from dashboard.launch import ENV_DB, db_url_from, script_args
from orchestrator.state import Layout
from orchestrator.store import JobInfo, Store, sqlite_path

STATE_ICONS = {
    "pending": "⏳",
    "running": "▶️",
    "completed": "✅",
    "failed": "❌",
    "interrupted": "⏸️",
}


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


def job_label(job: JobInfo) -> str:
    acc = "—" if job.accuracy is None else f"{job.accuracy:.1%}"
    return f"{STATE_ICONS.get(job.state, '')} {job.id} · {job.state} · {acc}"


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


def fmt_time(t: float | datetime | None) -> str:
    if t is None:
        return ""
    dt = t if isinstance(t, datetime) else datetime.fromtimestamp(t, UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def header(store: Store, job: JobInfo) -> None:
    st.title(job.id)
    init = job.spec.init
    # provenance of a fine-tuning job: which checkpoint its weights started from
    source = f" · fine-tuned from `{init.checkpoint}`" if init.checkpoint else ""
    st.caption(f"{job.name} · workdir `{job.workdir}` · created {fmt_time(job.created_at)}{source}")
    epochs = job.spec.training.epochs
    c = st.columns([1.6, 1, 1, 1, 1])  # state names are the longest values
    c[0].metric("State", job.state)
    # job.epoch counts finished epochs (a resume point), so a done job reads epochs/epochs
    c[1].metric("Epochs done", f"{job.epoch}/{epochs}")
    c[2].metric("Step", job.step)
    c[3].metric("Accuracy", "—" if job.accuracy is None else f"{job.accuracy:.1%}")
    c[4].metric("Frozen blocks", f"{job.freeze_boundary}/{job.spec.model.depth}")
    if job.message:
        (st.error if job.state == "failed" else st.info)(job.message)


def layout_section(store: Store, job: JobInfo) -> Layout | None:
    st.subheader("Pipeline layout")
    layout = store.current_layout(job.id)
    if layout is None:
        st.info("No layout recorded yet.")
        return None
    st.plotly_chart(figures.layout_figure(layout), key="layout")
    st.caption(f"`{layout.describe()}`")
    return layout


def freeze_section(store: Store, job: JobInfo, layout: Layout | None) -> None:
    st.subheader("Freezing")
    history = store.layouts(job.id)
    st.plotly_chart(figures.freeze_figure(history), key="freeze")
    freeze_override_control(store, job, layout)


def freeze_override_control(store: Store, job: JobInfo, layout: Layout | None) -> None:
    """Manual freeze override: the control lands here in a later change.

    It will file an override request for the controller (forward-only, within the model,
    validated before anything is stored) and show pending/applied requests. Until then this
    page stays read-only and shows no control.
    """


def training_section(store: Store, job: JobInfo) -> None:
    st.subheader("Training")
    metrics = store.metrics(job.id)
    left, right = st.columns(2)
    with left:
        st.plotly_chart(figures.loss_figure(metrics), key="loss")
    with right:
        st.plotly_chart(figures.throughput_figure(metrics), key="throughput")
    evaluations = store.evaluations(job.id)
    target = job.spec.training.target_accuracy
    st.plotly_chart(figures.accuracy_figure(evaluations, target=target), key="accuracy")


def checkpoints_section(store: Store, job: JobInfo) -> None:
    st.subheader("Checkpoints")
    rows = [
        {
            "step": c.step,
            "epoch": c.epoch,
            "state": c.state,
            "layout": c.layout_version,
            "size (MB)": round(c.size_bytes / 1e6, 2),
            "checksum": c.checksum,
            "path": c.path,
            "created": fmt_time(c.created_at),
        }
        for c in store.checkpoints(job.id, state=None)
    ]
    if rows:
        st.dataframe(rows, hide_index=True, key="checkpoints")
    else:
        st.info("No checkpoints yet.")


def events_section(store: Store, job: JobInfo, limit: int = 100) -> None:
    st.subheader("Recent events")
    rows: list[dict[str, Any]] = [
        {
            "time": fmt_time(e["time"]),
            "kind": e["kind"],
            "rank": e["rank"],
            "message": e["message"],
            "data": "" if e["data"] is None else json.dumps(e["data"]),
        }
        for e in store.events(job.id, limit=limit)
    ]
    if rows:
        st.dataframe(rows, hide_index=True, key="events")
    else:
        st.info("No events yet.")
    generations = store.generations(job.id)
    if generations:
        with st.expander(f"Generations ({len(generations)})"):
            st.dataframe(
                [
                    {
                        **g,
                        "started_at": fmt_time(g["started_at"]),
                        "ended_at": fmt_time(g["ended_at"]),
                    }
                    for g in generations
                ],
                hide_index=True,
                key="generations",
            )


def main() -> None:
    st.set_page_config(page_title="pipetransformer", page_icon="🧱", layout="wide")
    st.sidebar.title("pipetransformer")
    store = connect(db_url_from(script_args()))
    if store is None:
        return
    st.sidebar.button("Refresh")  # any widget interaction reruns the script: re-reads the DB
    jobs = store.list_jobs()
    if not jobs:
        st.info("No jobs in this store yet. Submit one with `pipetransformer run <spec>`.")
        return
    job = select_job(jobs)
    header(store, job)
    layout = layout_section(store, job)
    freeze_section(store, job, layout)
    training_section(store, job)
    checkpoints_section(store, job)
    events_section(store, job)


main()
