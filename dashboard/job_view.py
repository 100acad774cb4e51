"""One job's page: a live header and the view the user picked (training curves, layout, freezing,
workers, events, spec, comparison). Everything here reads the store (and, for a running job, the
pending request in its etcd); figures come from `dashboard.figures`, table rows from
`dashboard.views`. `dashboard.app` decides which job and which view, and how often to refresh.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import streamlit as st

from core.provenance import DATA_OPENED
from dashboard import figures, views
from dashboard import timeline as tl
from dashboard.control import pending_raw
from dashboard.launch import Options
from store import JobInfo, Store

VIEWS = ["Training", "Layout", "Freezing", "Workers", "Events", "Spec", "Compare"]
STATE_ICONS = {
    "pending": "⏳",
    "running": "▶️",
    "completed": "✅",
    "failed": "❌",
    "interrupted": "⏸️",
}
THROUGHPUT_WINDOW = 20  # steps averaged for the header's samples/s and MFU
CHART = {"displaylogo": False}  # plotly's mode bar without its logo link


@dataclass(frozen=True)
class ChartOptions:
    """The reader's choices that every chart honours (set in the sidebar)."""

    x: tl.XAxis = "step"
    smoothing: float = 0.6


def job_label(job: JobInfo) -> str:
    acc = "—" if job.accuracy is None else f"{job.accuracy:.1%}"
    return f"{STATE_ICONS.get(job.state, '')} {job.id} · {job.state} · {acc}"


def _chart(fig: Any, key: str) -> None:
    st.plotly_chart(fig, key=key, config=CHART, width="stretch")


def _held_out(store: Store, job: JobInfo) -> list[tuple[str, str]]:
    """The latest held-out result: accuracy; question answering's exact match and F1."""
    acc = "—" if job.accuracy is None else f"{job.accuracy:.1%}"
    if job.spec.model.task != "question-answering":
        return [("Accuracy", acc)]
    evaluations = store.evaluations(job.id)
    f1 = evaluations[-1].f1 if evaluations else None
    return [("Exact match", acc), ("F1", "—" if f1 is None else f"{f1:.1%}")]


def header(store: Store, job: JobInfo) -> None:
    """Title, provenance and the numbers a person checks first. Metrics sit in a wrapping row,
    each as wide as its value, so nothing is cut off on a narrow screen."""
    st.title(job.id)
    init = job.spec.init
    source = f" · fine-tuned from `{init.checkpoint}`" if init.checkpoint else ""
    st.caption(
        f"{job.name} · workdir `{job.workdir}` · created {views.fmt_time(job.created_at)} · "
        f"updated {views.fmt_time(job.updated_at)}{source}"
    )
    # where the model and the data came from: the spec, and the workers' report of the rows
    opened = store.events(job.id, limit=1, kinds=[DATA_OPENED])
    st.caption("  \n".join(views.provenance_lines(job.spec, opened)))
    layout = store.current_layout(job.id)
    recent = store.metrics(job.id, last=THROUGHPUT_WINDOW)
    rates = [m.samples_per_s for m in recent if m.samples_per_s is not None]
    peak = store.latest_peak_memory(job.id)
    row = st.container(horizontal=True, gap="medium")
    values = [
        ("State", job.state),
        ("Epoch", f"{job.epoch}/{job.spec.training.epochs}"),
        ("Step", str(job.step)),
        *_held_out(store, job),
        ("Frozen", f"{job.freeze_boundary}/{job.spec.model.depth}"),
        (
            "Layout",
            "—" if layout is None else f"v{layout.version} {layout.num_stages}x{layout.replicas}",
        ),
        ("Samples/s", f"{sum(rates) / len(rates):,.0f}" if rates else "—"),
        # MFU and peak GPU memory where the workers measured them (not on the CPU)
        *views.device_use(recent, None if peak is None else peak.peak_memory_mib),
    ]
    for label, value in values:
        row.metric(label, value, width="content", border=True)
    if job.message:
        (st.error if job.state == "failed" else st.info)(job.message)


def training_view(store: Store, job: JobInfo, opts: ChartOptions) -> None:
    metrics = store.metrics(job.id)
    evaluations = store.evaluations(job.id)
    story = tl.timeline(store.layouts(job.id), store.generations(job.id), metrics)
    kw = {"x": opts.x, "timeline": story}
    left, right = st.columns(2)
    with left:
        _chart(figures.loss_figure(metrics, evaluations, smoothing=opts.smoothing, **kw), "loss")
        _chart(
            figures.accuracy_figure(evaluations, job.spec.training.target_accuracy, **kw),
            "accuracy",
        )
    with right:
        _chart(figures.throughput_figure(metrics, smoothing=opts.smoothing, **kw), "throughput")
        _chart(figures.lr_figure(metrics, **kw), "lr")
    # device use: only where the workers measured it (a GPU run; never on the CPU)
    mfu, peaks = figures.has_values(metrics, "mfu"), figures.has_values(metrics, "peak_memory_mib")
    if mfu or peaks:
        left, right = st.columns(2)
        if mfu:
            with left:
                _chart(figures.mfu_figure(metrics, smoothing=opts.smoothing, **kw), "mfu")
        if peaks:
            with right if mfu else left:
                _chart(figures.peak_memory_figure(metrics, **kw), "peak_memory")
    st.caption(
        "Shaded bands: layout versions (shape and frozen blocks); dotted lines: new generations; "
        "red dashed: recoveries after an aborted generation."
    )


def layout_view(store: Store, job: JobInfo) -> None:
    history = store.layouts(job.id)
    if not history:
        st.info("No layout recorded yet.")
        return
    versions = [rec.layout.version for rec in history]
    chosen = (
        st.select_slider(
            "Layout version", options=versions, value=versions[-1], key="layout_version"
        )
        if len(versions) > 1
        else versions[0]
    )
    chosen_rec = next(rec for rec in history if rec.layout.version == chosen)
    layout = chosen_rec.layout
    _chart(figures.layout_figure(layout), "layout")
    st.caption(f"v{layout.version} · {views.fmt_time(chosen_rec.created_at)} · {chosen_rec.reason}")
    st.code(layout.describe(), language=None, wrap_lines=True)
    if len(history) > 1:
        _chart(figures.layout_history_figure(history), "layout_history")


def freezing_view(store: Store, job: JobInfo, options: Options, opts: ChartOptions) -> None:
    metrics = store.metrics(job.id)
    history = store.layouts(job.id)
    story = tl.timeline(history, store.generations(job.id), metrics)
    left, right = st.columns(2)
    with left:
        _chart(figures.freeze_figure(history, metrics, x=opts.x, timeline=story), "freeze")
    with right:
        _chart(figures.grad_norm_figure(metrics, history, x=opts.x), "grad_norms")
    st.markdown("**Freeze requests**")
    events = store.events(job.id, limit=500, kinds=views.FREEZE_REQUEST_KINDS)
    rows = views.freeze_requests(events, pending_raw(job, options))
    if rows:
        # a plain table: a handful of rows, every word readable (and findable) on the page
        st.table(rows, hide_index=True)
    else:
        st.caption("No manual freeze requests yet.")


def workers_view(store: Store, job: JobInfo) -> None:
    workers = store.workers(job.id)
    generations = store.generations(job.id)
    if not generations:
        st.info("No generation has started yet.")
        return
    rows = views.worker_rows(workers, time.time())
    # a rank's stage and replica are its part in the layout in force (re-layouts included)
    for g in reversed(generations):
        mine = [r for r in rows if r["generation"] == g.number]
        ended = f" → {views.fmt_time(g.ended_at)}" if g.ended_at else ""
        st.markdown(
            f"**Generation {g.number}** · {g.state} · {g.world_size} worker(s) · "
            f"{views.fmt_time(g.started_at)}{ended}"
        )
        if g.reason:
            st.caption(g.reason)
        if mine:
            st.dataframe(
                [{k: v for k, v in r.items() if k != "generation"} for r in mine],
                hide_index=True,
                key=f"workers_{g.number}",
            )
        else:
            st.caption("No worker recorded for this generation.")
    layouts = store.layouts(job.id)
    if len(layouts) > 1:  # freezing re-laid the job out: where each rank went
        with st.expander("Each rank's part by layout version (stage · replica)"):
            st.dataframe(views.rank_parts(layouts), hide_index=True, key="rank_parts")


def events_view(store: Store, job: JobInfo) -> None:
    events = store.events(job.id, limit=300)
    kinds = sorted({e.kind for e in events})
    shown = st.multiselect("Kinds", kinds, key="event_kinds", placeholder="all kinds")
    rows = views.event_rows([e for e in events if not shown or e.kind in shown])
    if rows:
        st.dataframe(rows, hide_index=True, key="events")
    else:
        st.info("No events yet.")
    st.markdown("**Checkpoints**")
    checkpoints = [
        {
            "step": c.step,
            "epoch": c.epoch,
            "state": c.state,
            "layout": f"v{c.layout_version}",
            "size (MB)": round(c.size_bytes / 1e6, 2),
            "path": c.path,
            "created": views.fmt_time(c.created_at),
        }
        for c in store.checkpoints(job.id, state=None)
    ]
    if checkpoints:
        st.dataframe(checkpoints, hide_index=True, key="checkpoints")
    else:
        st.caption("No checkpoints yet.")


def spec_view(job: JobInfo) -> None:
    st.code(views.spec_yaml(job.spec), language="yaml")


def compare_view(store: Store, job: JobInfo, jobs: list[JobInfo], opts: ChartOptions) -> None:
    others = [j.id for j in jobs if j.id != job.id]
    chosen = st.multiselect("Compare with", others, key="compare", placeholder="pick jobs")
    ids = [job.id, *chosen]
    metrics = {i: store.metrics(i) for i in ids}
    evaluations = {i: store.evaluations(i) for i in ids}
    sm = opts.smoothing
    left, right = st.columns(2)
    with left:
        _chart(
            figures.compare_figure(metrics, "loss", x=opts.x, smoothing=sm, title="Training loss"),
            "compare_loss",
        )
    with right:
        _chart(
            figures.compare_figure(
                metrics, "samples_per_s", x=opts.x, smoothing=sm, title="Throughput (samples/s)"
            ),
            "compare_throughput",
        )
    _chart(
        figures.compare_figure(
            evaluations, "accuracy", x=opts.x, smoothing=0.0, title="Held-out accuracy"
        ),
        "compare_accuracy",
    )


def render(
    view: str,
    store: Store,
    job: JobInfo,
    jobs: list[JobInfo],
    options: Options,
    opts: ChartOptions,
) -> None:
    """The chosen view of `job` (one of VIEWS)."""
    if view == "Training":
        training_view(store, job, opts)
    elif view == "Layout":
        layout_view(store, job)
    elif view == "Freezing":
        freezing_view(store, job, options, opts)
    elif view == "Workers":
        workers_view(store, job)
    elif view == "Events":
        events_view(store, job)
    elif view == "Spec":
        spec_view(job)
    elif view == "Compare":
        compare_view(store, job, jobs, opts)
    else:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
