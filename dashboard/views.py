"""Table rows for the dashboard: pure functions of store data (no I/O, no Streamlit), so what a
person reads in each table is unit-tested.

Times come in as unix seconds (the store's typed rows) and leave as readable UTC strings; missing
values leave as "" or "—", never as the text "None", except in the columns a table sorts by
number (the runs table's, Compare's summary), which stay numbers or None (shown as "—").
"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any

import yaml

from pipetransformer.core.protocol import FreezeOutcome, read_freeze_request
from pipetransformer.core.provenance import origin_of, provenance
from pipetransformer.core.readings import mfu_text, peak_memory_text, perplexity
from pipetransformer.core.spec import JobSpec, ModelSpec
from pipetransformer.core.stage_times import PHASE_LABELS, PHASES, RankTimes
from pipetransformer.core.state import Layout
from pipetransformer.core.tasks import task_of
from pipetransformer.store.rows import (
    EvaluationRow,
    EventRow,
    JobInfo,
    MetricRow,
    RecordedLayout,
    StageTimesRow,
    WorkerRow,
)

REQUEST_EVENT = "freeze_requested"
OUTCOME_EVENTS = {f"freeze_{o.value}": o.value for o in FreezeOutcome}
FREEZE_REQUEST_KINDS = [REQUEST_EVENT, *OUTCOME_EVENTS]


def fmt_time(t: float | datetime | None) -> str:
    if t is None:
        return ""
    dt = t if isinstance(t, datetime) else datetime.fromtimestamp(t, UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def fmt_ago(t: float | None, now: float) -> str:
    """'12 s ago', '3 min ago', '2 h ago'; '' when never."""
    if t is None:
        return ""
    s = max(0.0, now - t)
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 90 * 60:
        return f"{s / 60:.0f} min ago"
    return f"{s / 3600:.1f} h ago"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_text(exit_code: int | None, sig: int | None) -> str:
    """How a process ended, as a person says it: 'exit 1', 'SIGKILL (9)', '' while alive."""
    if sig is not None:
        return f"{signal_name(sig)} ({sig})"
    if exit_code is not None:
        return f"exit {exit_code}"
    return ""


def freeze_requests(
    events: Sequence[EventRow], pending_raw: str | None = None
) -> list[dict[str, Any]]:
    """Every manual freeze request of a job, newest first, with what became of it.

    `events`: the job's freeze-request events (`FREEZE_REQUEST_KINDS`) as `Store.events`
    returns them, newest first. `pending_raw`: the request waiting in etcd, which the controller
    may not have audited yet (shown as pending until it has)."""
    by_id: dict[str, dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: (e.time, e.id)):  # oldest first
        request = (e.data or {}).get("request") or {}
        rid = request.get("id") or request.get("raw") or f"event {e.id}"
        row = by_id.setdefault(
            rid,
            {
                "request": rid[:12],
                "layers": request.get("layers", ""),
                "who": request.get("who", ""),
                "reason": request.get("reason", "unreadable request"),
                "filed": fmt_time(request.get("time") or e.time),
                "status": "pending",
                "decided": "",
                "step": "",
                "outcome": "",
            },
        )
        if e.kind in OUTCOME_EVENTS:
            data = e.data or {}
            row["status"] = OUTCOME_EVENTS[e.kind]
            row["decided"] = fmt_time(e.time)
            row["step"] = data.get("step", "")
            row["outcome"] = e.message
    if pending_raw:
        request = read_freeze_request(pending_raw)
        rid = getattr(request, "id", None) or pending_raw[:12]
        if rid not in by_id:
            by_id[rid] = {
                "request": rid[:12],
                "layers": getattr(request, "layers", ""),
                "who": getattr(request, "who", ""),
                "reason": getattr(request, "reason", "unreadable request"),
                "filed": fmt_time(getattr(request, "time", None)),
                "status": "pending",
                "decided": "",
                "step": "",
                "outcome": "filed; the controller has not audited it yet",
            }
    return sorted(by_id.values(), key=lambda r: r["filed"], reverse=True)


def parts_in_force(measured: Sequence[StageTimesRow]) -> dict[tuple[int, int], StageTimesRow]:
    """Each (generation, rank)'s newest measured interval (`Store.stage_times` rows): the
    layout version, stages and replica the rank ran last, re-layouts in the running processes
    included."""
    newest: dict[tuple[int, int], StageTimesRow] = {}
    for r in measured:
        key = (r.generation, r.rank)
        prev = newest.get(key)
        if prev is None or (r.to_step, r.time) >= (prev.to_step, prev.time):
            newest[key] = r
    return newest


def stages_part(stages: Sequence[int], replica: int) -> str:
    """A rank's part as `part_text` writes it: "S1 · r0", "S0,S2 · r0"."""
    return f"{','.join(f'S{s}' for s in stages)} · r{replica}"


def worker_rows(
    workers: Sequence[WorkerRow], now: float, measured: Sequence[StageTimesRow] = ()
) -> list[dict[str, Any]]:
    """One row per rank of each generation (as `Store.workers` returns them), newest generation
    first: where it runs, what it holds, whether its lease is held, and how it ended.

    A rank's stage and replica are those of its newest measured interval in `measured` (the
    rows of `Store.stage_times`: the layout in force, after any re-layout), with that layout's
    version; a rank without one keeps the part the worker table recorded (and no version)."""
    in_force = parts_in_force(measured)
    rows = []
    for w in sorted(workers, key=lambda w: (-w.generation, w.rank)):
        last = in_force.get((w.generation, w.rank))
        stages = last.stages if last is not None else w.stages
        replica = last.replica if last is not None else w.replica
        rows.append(
            {
                "generation": w.generation,
                "rank": w.rank,
                "state": w.state,
                "host": w.host or w.node or "",
                "pid": "" if w.pid is None else w.pid,
                "stage": ",".join(map(str, stages)) if stages else "",
                "replica": "" if replica is None else replica,
                "layout": "" if last is None else f"v{last.layout_version}",
                "lease": w.lease or "",
                "last report": fmt_ago(w.last_report_at, now),
                "exit": exit_text(w.exit_code, w.signal),
                "detail": w.detail or "",
                "log": w.log or "",
            }
        )
    return rows


def measured_parts(measured: Sequence[StageTimesRow]) -> list[dict[str, Any]]:
    """Each rank's part in every layout version it was measured under, in the order the versions
    took effect: the steps measured under it and, per rank, "S1 · r0" (its newest interval
    under that version; "" for a rank not measured under it). What ran, beside `rank_parts`'
    plan."""
    versions: dict[int, dict[str, Any]] = {}
    newest: dict[tuple[int, int], StageTimesRow] = {}
    for r in measured:
        span = versions.setdefault(r.layout_version, {"first": r.from_step, "last": r.to_step})
        span["first"] = min(span["first"], r.from_step)
        span["last"] = max(span["last"], r.to_step)
        key = (r.layout_version, r.rank)
        prev = newest.get(key)
        if prev is None or (r.generation, r.to_step) >= (prev.generation, prev.to_step):
            newest[key] = r
    ranks = sorted({r.rank for r in measured})
    return [
        {
            "layout": f"v{v}",
            "steps": f"{span['first'] + 1}-{span['last']}",
            **{
                f"rank {k}": stages_part(row.stages, row.replica)
                if (row := newest.get((v, k))) is not None
                else ""
                for k in ranks
            },
        }
        for v, span in sorted(versions.items(), key=lambda kv: (kv[1]["first"], kv[0]))
    ]


def phase_rows(ranks: Sequence[RankTimes]) -> list[dict[str, Any]]:
    """The Pipeline view's table: one row per rank (`core.stage_times.per_rank`) with its part,
    the intervals summed, the wall time, the seconds of every phase (`PHASES` order, named by
    `PHASE_LABELS`), its measured bubble and its busy share (forward + backward over wall)."""
    return [
        {
            "rank": r.rank,
            "part": stages_part(r.stages, r.replica),
            "intervals": r.intervals,
            "wall (s)": round(r.wall_s, 3),
            **{f"{PHASE_LABELS[p]} (s)": round(getattr(r.seconds, p), 3) for p in PHASES},
            "bubble": "—" if r.bubble is None else f"{r.bubble:.1%}",
            "busy": f"{r.busy_fraction:.1%}",
        }
        for r in ranks
    ]


def idle_columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[str]:
    """Those of `columns` that are 0 or missing in every row (phases nobody spent time in)."""
    return [c for c in columns if all(not r.get(c) for r in rows)]


def part_text(layout: Layout, rank: int) -> str:
    """A rank's part in a layout: its stage(s) and replica, "S1 · r0" ("S0,S2 · r0" with
    virtual stages); "" for a rank the layout has no place for."""
    try:
        placed = layout.placements(rank)
    except KeyError:
        return ""
    return f"{','.join(f'S{s.index}' for s, _ in placed)} · r{placed[0][1]}"


def rank_parts(layouts: Sequence[RecordedLayout]) -> list[dict[str, Any]]:
    """Each rank's part in every recorded layout version, oldest first: how freezing moved the
    ranks between stages and replicas (a 2x1 job that became 1x2: rank 1 goes from stage 1 to
    replica 1 of stage 0)."""
    world = max((r.layout.world_size for r in layouts), default=0)
    return [
        {
            "layout": f"v{r.layout.version}",
            "shape": f"{r.layout.pipeline_ranks}x{r.layout.replicas}",
            "frozen": r.layout.freeze_boundary,
            "recorded": fmt_time(r.created_at),
            **{f"rank {rank}": part_text(r.layout, rank) for rank in range(world)},
        }
        for r in layouts
    ]


def event_rows(events: Sequence[EventRow]) -> list[dict[str, Any]]:
    """The event log as a table: the controller's own events say so instead of a blank rank."""
    return [
        {
            "time": fmt_time(e.time),
            "kind": e.kind,
            "from": "controller" if e.rank is None else f"rank {e.rank}",
            "message": e.message,
        }
        for e in events
    ]


def device_use(
    recent: Sequence[MetricRow], peak_memory_mib: Sequence[float | None] | None
) -> list[tuple[str, str]]:
    """The header's device metrics, each only where known (never on the CPU): MFU, the mean of
    the known values over `recent` (the newest metric rows, the window the header's samples/s
    averages), and the largest rank's peak GPU memory from the newest per-rank list
    (`Store.latest_peak_memory`)."""
    out: list[tuple[str, str]] = []
    known = [m.mfu for m in recent if m.mfu is not None]
    if (mfu := mfu_text(sum(known) / len(known) if known else None)) is not None:
        out.append(("MFU", mfu))
    if (peak := peak_memory_text(peak_memory_mib)) is not None:
        out.append(("Peak GPU memory", peak))
    return out


_MARKDOWN = str.maketrans({c: "\\" + c for c in "\\`*_[]<>#|~$"})


def markdown_text(text: str) -> str:
    """Plain text (a path, a column name) that Streamlit's markdown shows as written."""
    return text.translate(_MARKDOWN)


def provenance_lines(spec: JobSpec, opened: Sequence[EventRow]) -> list[str]:
    """Where the job's model and data came from, one markdown line per row of
    `core.provenance.provenance`. `opened`: the job's `data_opened` events, newest first (as
    `Store.events` returns them); the newest gives each split's rows."""
    origin = origin_of(opened[0].data) if opened else None
    return [f"**{label}** · {markdown_text(text)}" for label, text in provenance(spec, origin)]


def spec_yaml(spec: JobSpec) -> str:
    """The job's spec as the YAML a user would write (every field, defaults included)."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)


# ---- tables that fit the page

CHAR_PX = 7.0  # a character's mean width in Streamlit's tables (14 px Source Sans)
CELL_PAD_PX = 17  # a cell's padding, both sides
# three lines of text: Streamlit wraps a cell's text only in rows taller than 64 px
WRAPPED_ROW_PX = 72


def wrap_height(rows: Sequence[Mapping[str, Any]], widths: Mapping[str, int]) -> int | None:
    """The row height a table needs for its long text: `widths` gives the columns whose text
    wraps within that many pixels; rows three lines tall where some cell of them is longer than
    one line, None (one line a row, Streamlit's default) where none is."""
    for row in rows:
        for column, width in widths.items():
            text = str(row.get(column) or "")
            if text and len(text) * CHAR_PX + CELL_PAD_PX > width:
                return WRAPPED_ROW_PX
    return None


# ---- several jobs: the runs table and Compare's summary


@dataclass(frozen=True)
class HeldOut:
    """A job's held-out results over its evaluations: its task's accuracy (a fraction:
    classification's accuracy, question answering's exact match, a language model's next-token
    accuracy), the newest and the best; a language model's perplexity (exp of the held-out mean
    loss per token), the newest and the lowest. None where there is none."""

    final: float | None = None
    best: float | None = None
    final_ppl: float | None = None
    best_ppl: float | None = None


def held_out(job: JobInfo, evaluations: Sequence[EvaluationRow]) -> HeldOut:
    """`job`'s `HeldOut` from its evaluations (`Store.evaluations`)."""
    if not evaluations:
        return HeldOut()
    ordered = sorted(evaluations, key=lambda e: e.step)
    accuracy = [e.accuracy for e in ordered]
    if not task_of(job.spec.model).targets_per_token:  # no perplexity but a language model's
        return HeldOut(final=accuracy[-1], best=max(accuracy))
    ppl = [None if e.loss is None else perplexity(e.loss) for e in ordered]
    known = [p for p in ppl if p is not None]
    return HeldOut(accuracy[-1], max(accuracy), ppl[-1], min(known) if known else None)


def model_name(model: ModelSpec) -> str:
    """A job's model in a table cell: a checkpoint by its hub id or its directory's name, a
    seeded model by its family, blocks and width ("vit 6×64")."""
    pre = model.pretrained
    if pre is None:
        return f"{model.family} {model.depth}×{model.dim}"
    if pre.commit is not None or pre.revision is not None:  # a hub id (`provenance.model_text`)
        return pre.source
    return PurePosixPath(pre.path or pre.source).name or pre.source


def duration_min(job: JobInfo) -> float:
    """Minutes from the job's creation to its last update (its end, once it ended)."""
    return (job.updated_at - job.created_at).total_seconds() / 60


def throughput(metrics: Sequence[MetricRow]) -> float | None:
    """The job's samples/s over its whole run: samples per second of step time, so each step
    weighs its time (the harmonic mean of the steps' samples/s; the plain mean would favour the
    fast steps a frozen prefix buys). None before a step reported one."""
    rates = [
        m.samples_per_s
        for m in metrics
        if m.samples_per_s is not None and math.isfinite(m.samples_per_s) and m.samples_per_s > 0
    ]
    return len(rates) / sum(1 / r for r in rates) if rates else None


def frozen_text(job: JobInfo) -> str:
    """The blocks frozen at the job's last layout, of its model's: "2/6"."""
    return f"{job.freeze_boundary}/{job.spec.model.depth}"


PERPLEXITY_COLUMNS = ("final ppl", "best ppl")


def _metric_columns(found: HeldOut) -> dict[str, float | None]:
    return {
        "final": found.final,
        "best": found.best,
        PERPLEXITY_COLUMNS[0]: found.final_ppl,
        PERPLEXITY_COLUMNS[1]: found.best_ppl,
    }


def run_row(job: JobInfo, found: HeldOut, recoveries: int) -> dict[str, Any]:
    """One job's row in the runs table: what it is, when, how far it went, its held-out results
    (`found`, `held_out` of its evaluations), its frozen blocks and its recoveries
    (`core.recoveries`, counted by the caller from the stored events)."""
    return {
        "job": job.id,
        "state": job.state,
        "model": model_name(job.spec.model),
        "dataset": job.spec.data.dataset,
        "created": fmt_time(job.created_at),  # ISO order: sorting the text sorts the times
        "duration": round(duration_min(job), 2),
        "steps": job.step,
        **_metric_columns(found),
        "frozen": frozen_text(job),
        "recoveries": recoveries,
    }


def without_empty(
    rows: list[dict[str, Any]], columns: Sequence[str] = PERPLEXITY_COLUMNS
) -> list[dict[str, Any]]:
    """`rows` without those of `columns` that no row has a value in (perplexity, where no job
    is a language model)."""
    empty = [c for c in columns if all(r.get(c) is None for r in rows)]
    return [{k: v for k, v in r.items() if k not in empty} for r in rows]


def compare_rows(
    jobs: Sequence[JobInfo],
    metrics: Mapping[str, Sequence[MetricRow]],
    evaluations: Mapping[str, Sequence[EvaluationRow]],
) -> list[dict[str, Any]]:
    """Compare's summary, one row per job in `jobs`' order: its held-out results, steps,
    duration, samples/s over the run (`throughput`), frozen blocks, and its speed-up: its
    samples/s over the first job's (None where either is unknown)."""
    rates = [throughput(metrics.get(j.id, ())) for j in jobs]
    base = rates[0] if rates else None
    rows = [
        {
            "job": job.id,
            "state": job.state,
            "model": model_name(job.spec.model),
            **_metric_columns(held_out(job, evaluations.get(job.id, ()))),
            "steps": job.step,
            "duration": round(duration_min(job), 2),
            "samples/s": None if rate is None else round(rate, 1),
            "frozen": frozen_text(job),
            "speed-up": None if rate is None or not base else round(rate / base, 3),
        }
        for job, rate in zip(jobs, rates, strict=True)
    ]
    return without_empty(rows)
