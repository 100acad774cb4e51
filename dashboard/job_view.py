"""One job's page: a live header and the view the user picked (training curves, layout, where the
pipeline's time goes, freezing, workers, events, spec; Compare and Runs, over several jobs, are
`dashboard.jobs_view`'s). Everything here reads the
store (and, for a running job, the pending request in its etcd); figures come from
`dashboard.figures`, `dashboard.pipeline_figures` and `dashboard.freeze_figures`, table rows
from `dashboard.views`.
`dashboard.app` decides which job and which view, and how often to refresh.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import streamlit as st

from pipetransformer.core.provenance import DATA_OPENED
from pipetransformer.core.stage_times import PHASE_LABELS, chrome_trace, per_rank, pipeline_reading
from pipetransformer.core.tasks import task_of
from pipetransformer.dashboard import figures, jobs_view, views, widgets
from pipetransformer.dashboard import freeze_figures as ff
from pipetransformer.dashboard import pipeline_figures as pf
from pipetransformer.dashboard import timeline as tl
from pipetransformer.dashboard.control import awaited_trace, pending_raw, trace_arrived
from pipetransformer.dashboard.launch import Options
from pipetransformer.dashboard.logs import LINES, log_tail
from pipetransformer.store import JobInfo, StageTimesRow, Store, WorkerRow

# the job's own views, then those over several jobs (`dashboard.jobs_view`)
VIEWS = [
    "Training",
    "Layout",
    "Pipeline",
    "Freezing",
    "Workers",
    "Events",
    "Spec",
    "Compare",
    "Runs",
]
STATE_ICONS = {
    "pending": "⏳",
    "running": "▶️",
    "completed": "✅",
    "failed": "❌",
    "interrupted": "⏸️",
}
THROUGHPUT_WINDOW = 20  # steps averaged for the header's samples/s and MFU
# the newest intervals (distinct interval ends, every rank's row of each) the Pipeline and
# Workers views read: a long job's page stays fast, and its recent layouts are all there
STAGE_TIME_INTERVALS = 2000
TRACE_PICKER_KEY = "trace_request"  # session state: the traced step the Pipeline view shows
LOG_OPEN_KEY = "worker_log_open"  # session state: whether the Workers view's log is open
LOG_HEIGHT = 480  # px: the log's lines scroll inside their box
# the Workers table's long text (px each): wrapped, so the columns after it stay on the page
WORKER_TEXT = {"host": 120, "detail": 120, "log": 150}
# the Pipeline table's phases under short names (the long ones in their tooltips; seconds, as
# its caption says), so its columns fit the page
PHASE_SHORT = {
    "forward": "fwd",
    "backward": "bwd",
    "pipeline_wait": "wait",
    "grad_sync": "sync",
    "optimizer": "optim",
    "frozen_prefix": "frozen",
    "data_wait": "data",
    "checkpoint": "ckpt",
    "evaluation": "eval",
    "other": "other",
}
PHASE_COLUMNS = {
    f"{PHASE_LABELS[p]} (s)": st.column_config.NumberColumn(
        short, help=f"seconds {PHASE_LABELS[p]}", format="%.3f"
    )
    for p, short in PHASE_SHORT.items()
}


@dataclass(frozen=True)
class ChartOptions:
    """The reader's choices that every chart honours (set in the sidebar)."""

    x: tl.XAxis = "step"
    smoothing: float = widgets.DEFAULT_SMOOTHING


def job_label(job: JobInfo) -> str:
    acc = "—" if job.accuracy is None else f"{job.accuracy:.1%}"
    return f"{STATE_ICONS.get(job.state, '')} {job.id} · {job.state} · {acc}"


def _chart(fig: Any, key: str) -> None:
    widgets.chart(fig, key)


def _held_out(store: Store, job: JobInfo) -> list[tuple[str, str]]:
    """The latest held-out result in its task's metric (question answering: exact match, and
    F1)."""
    task = task_of(job.spec.model)
    acc = "—" if job.accuracy is None else f"{job.accuracy:.1%}"
    if not task.reports_f1:
        return [(task.metric.capitalize(), acc)]
    evaluations = store.evaluations(job.id)
    f1 = evaluations[-1].f1 if evaluations else None
    return [(task.metric.capitalize(), acc), ("F1", "—" if f1 is None else f"{f1:.1%}")]


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
        if task_of(job.spec.model).targets_per_token:  # a language model
            _chart(
                figures.perplexity_figure(evaluations, job.spec.training.target_perplexity, **kw),
                "perplexity",
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


def pipeline_view(store: Store, job: JobInfo) -> None:
    """Where each rank's time went under a layout version (the newest measured by default): the
    phases per rank, the bubble per stage beside the schedule's, both over the steps across
    re-layouts, the seconds as a table and what they say in one line."""
    rows = store.stage_times(job.id, last_intervals=STAGE_TIME_INTERVALS)
    if not rows:
        st.info(
            "No stage timings reported yet: the ranks report where their time went at the end "
            "of each reporting interval (jobs run before stage timing was added have none)."
        )
    else:
        _stage_timings(store, job, rows)
    trace_section(store, job)


def _predictions(store: Store, job: JobInfo) -> dict[int, list[float]]:
    """AutoPipe's predicted forward + backward seconds per step of each stage, by the layout
    version it planned (the `layout_planned` events that carry them)."""
    found: dict[int, list[float]] = {}
    for e in store.events(job.id, limit=500, kinds=["layout_planned"]):
        data = e.data or {}
        if isinstance(data.get("version"), int) and data.get("predicted_stage_s"):
            found.setdefault(data["version"], data["predicted_stage_s"])
    return found


def _stage_timings(store: Store, job: JobInfo, rows: list[StageTimesRow]) -> None:
    history = store.layouts(job.id)
    layouts = {rec.layout.version: rec.layout for rec in history}
    versions = sorted({r.layout_version for r in rows})
    chosen = (
        st.select_slider(
            "Layout version",
            options=versions,
            value=versions[-1],
            format_func=lambda v: f"v{v}",
            key="pipeline_version",
        )
        if len(versions) > 1
        else versions[0]
    )
    layout = layouts.get(chosen)
    if layout is None:
        st.warning(f"Layout v{chosen} was measured but is not recorded in the store.")
        return
    ranks = per_rank(rows, chosen)
    reading = pipeline_reading(
        ranks, layout.schedule, layout.pipeline_ranks, layout.microbatches, layout.virtual_stages
    )
    if reading is not None:
        st.markdown(f"**Reading** · {reading.text()}")
    _chart(pf.breakdown_figure(ranks, layout), "pipeline_breakdown")
    left, right = st.columns(2)
    with left:
        _chart(pf.bubble_figure(ranks, layout), "pipeline_bubble")
    with right:
        _chart(pf.bubble_over_time_figure(rows, history), "pipeline_bubble_over_time")
    _chart(
        pf.predicted_figure(
            ranks,
            layout,
            _predictions(store, job).get(chosen),
            next((rec.reason for rec in history if rec.layout.version == chosen), None),
        ),
        "pipeline_predicted",
    )
    table = views.phase_rows(ranks)
    idle = views.idle_columns(table, list(PHASE_COLUMNS))  # left out, as the breakdown does
    widgets.table(
        table,
        "pipeline_phases",
        pinned="rank",
        columns=PHASE_COLUMNS,
        column_order=[c for c in table[0] if c not in idle] if table else None,
    )
    measured = [r for r in rows if r.layout_version == chosen]
    clocks = sorted({r.clock for r in measured})
    first, last = min(r.from_step for r in measured), max(r.to_step for r in measured)
    st.caption(
        f"Seconds summed over steps {first + 1}-{last} under v{chosen} "
        f"(the newest {STAGE_TIME_INTERVALS:,} intervals at most), timed with "
        f"{' and '.join('CUDA events' if c == 'cuda' else 'the host clock' for c in clocks)}. "
        "Bubble: waiting for a neighbour stage over forward + backward + waiting; busy: "
        "forward + backward over the wall time."
    )


def trace_label(step: int, started: float) -> str:
    """A traced step in the picker: "step 41 · 2027-01-15 08:00:02 UTC"."""
    return f"step {step} · {views.fmt_time(started)}"


def trace_section(store: Store, job: JobInfo) -> None:
    """One traced step: which capture (newest first), its Gantt chart, its Chrome trace. A
    capture filed from this page (`dashboard.control.trace_control`, below the view) is shown
    as soon as the ranks have reported it: the live refresh picks it up."""
    st.markdown("**One step's schedule**")
    captured = store.trace_requests(job.id)
    labels = {req: trace_label(step, started) for req, step, started in captured}
    awaited = awaited_trace(job.id)
    if awaited is not None and awaited in labels:
        st.session_state[TRACE_PICKER_KEY] = awaited  # the capture asked for, once it is in
        trace_arrived(job.id)
    elif awaited is not None:
        st.caption(
            f"Waiting for trace request {awaited}: every rank traces the step after its next "
            f"control point (at most {job.spec.runtime.control_every_steps} step(s) away)."
        )
    if not captured:
        st.caption(
            "No step traced yet. A signed-in user captures one from a running job below, or "
            f"`pipetransformer trace {job.id}`."
        )
        return
    chosen = st.selectbox(
        "Traced step (newest first)",
        list(labels),
        format_func=labels.__getitem__,
        key=TRACE_PICKER_KEY,
    )
    rows = store.step_traces(job.id, request=chosen)
    _chart(pf.trace_figure(rows), "pipeline_trace")
    st.caption(
        "Each rank's spans from its own start of the step, lined up by the ranks' clocks "
        "(hosts' clocks may differ by their NTP offset). F3 / B3: micro-batch 3's forward / "
        "backward; the gaps inside the schedule are waiting for a neighbour stage."
    )
    st.download_button(
        "Download as a Chrome / Perfetto trace",
        data=json.dumps(chrome_trace(rows)),
        file_name=f"trace-{chosen}.json",
        mime="application/json",
        key="trace_download",
        on_click="ignore",  # a download, not a reason to rerun the page
    )
    st.caption(
        "Open it in ui.perfetto.dev or chrome://tracing: a process per rank, a thread per stage."
    )


def freezing_view(store: Store, job: JobInfo, options: Options, opts: ChartOptions) -> None:
    metrics = store.metrics(job.id)
    history = store.layouts(job.id)
    story = tl.timeline(history, store.generations(job.id), metrics)
    left, right = st.columns(2)
    with left:
        _chart(figures.freeze_figure(history, metrics, x=opts.x, timeline=story), "freeze")
    with right:
        _chart(figures.grad_norm_figure(metrics, history, x=opts.x), "grad_norms")
    signals = store.freeze_signals(job.id)
    if signals:
        _chart(ff.signal_figure(signals), "freeze_signals")
        st.caption(ff.signal_caption(signals))
    else:
        st.caption(ff.no_signals_text(job.spec.freeze.policy))
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
    measured = store.stage_times(job.id, last_intervals=STAGE_TIME_INTERVALS)
    # a rank's stage and replica are its part in the layout in force (re-layouts included):
    # that of its newest measured interval where it reported one
    rows = views.worker_rows(workers, time.time(), measured)
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
            widgets.table(
                [{k: v for k, v in r.items() if k != "generation"} for r in mine],
                f"workers_{g.number}",
                wide=WORKER_TEXT,
                pinned="rank",
            )
        else:
            st.caption("No worker recorded for this generation.")
    parts = views.measured_parts(measured)
    if len(parts) > 1:  # re-laid out while measured: where each rank ran, version by version
        st.markdown("**Each rank's part by layout version, as measured** (stage · replica)")
        widgets.table(parts, "measured_parts", pinned="layout")
    layouts = store.layouts(job.id)
    if len(layouts) > 1:  # freezing re-laid the job out: where each rank went
        with st.expander("Each rank's part by layout version (stage · replica)"):
            widgets.table(views.rank_parts(layouts), "rank_parts", pinned="layout")
    _log_tail([w for w in workers if w.generation == generations[-1].number])


def _log_tail(workers: list[WorkerRow]) -> None:
    """The newest generation's ranks: pick one, and, while its expander is open, the end of its
    log (`dashboard.logs.log_tail`: at most the last 256 KiB read at each refresh, never while
    closed), or why it cannot be read here and how to get it."""
    if not workers:
        return
    st.markdown("**Recent log lines**")
    by_rank = {w.rank: w for w in workers}
    rank = st.selectbox(
        "Rank",
        sorted(by_rank),
        format_func=lambda r: f"rank {r}" + (f" · {by_rank[r].host}" if by_rank[r].host else ""),
        key="log_rank",
    )
    worker = by_rank[rank]
    # one label whatever the rank: the expander stays open while the reader switches ranks
    box = st.expander(f"Its last {LINES} lines", key=LOG_OPEN_KEY, on_change="rerun")
    if not box.open:  # read nothing until asked
        return
    with box:
        tail = log_tail(worker.log)
        if tail.text is None:
            st.info(tail.reason)
            if worker.host:  # in a pod, the host name is the pod's name
                st.caption(
                    f"Rank {rank} ran on `{worker.host}`; where that is a trainer pod: "
                    f"`kubectl logs {worker.host} --tail {LINES}`."
                )
            return
        cut = " (its end only)" if tail.truncated else ""
        st.caption(f"`{worker.log}`{cut}")
        st.code(tail.text or "(empty so far)", language=None, height=LOG_HEIGHT)


def events_view(store: Store, job: JobInfo) -> None:
    events = store.events(job.id, limit=300)
    kinds = sorted({e.kind for e in events})
    shown = st.multiselect("Kinds", kinds, key="event_kinds", placeholder="all kinds")
    rows = views.event_rows([e for e in events if not shown or e.kind in shown])
    if rows:
        widgets.table(rows, "events", wide={"message": 440})
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
        widgets.table(checkpoints, "checkpoints", wide={"path": 300})
    else:
        st.caption("No checkpoints yet.")


def spec_view(job: JobInfo) -> None:
    # wrapped: a long path in the spec would otherwise scroll the block sideways
    st.code(views.spec_yaml(job.spec), language="yaml", wrap_lines=True)


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
    elif view == "Pipeline":
        pipeline_view(store, job)
    elif view == "Freezing":
        freezing_view(store, job, options, opts)
    elif view == "Workers":
        workers_view(store, job)
    elif view == "Events":
        events_view(store, job)
    elif view == "Spec":
        spec_view(job)
    elif view == "Compare":
        jobs_view.compare_view(store, job, jobs, opts.x)
    elif view == "Runs":
        jobs_view.runs_view(store)
    else:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
