"""Table rows for the dashboard: pure functions of store data (no I/O, no Streamlit), so what a
person reads in each table is unit-tested.

Times come in as unix seconds (the store's typed rows) and leave as readable UTC strings; missing
values leave as "" or "—", never as the text "None".
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import yaml

from pipetransformer.core.protocol import FreezeOutcome, read_freeze_request
from pipetransformer.core.provenance import origin_of, provenance
from pipetransformer.core.readings import mfu_text, peak_memory_text
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.stage_times import PHASE_LABELS, PHASES, RankTimes
from pipetransformer.core.state import Layout
from pipetransformer.store.rows import EventRow, MetricRow, RecordedLayout, StageTimesRow, WorkerRow

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
