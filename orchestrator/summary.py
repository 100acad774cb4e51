"""The layout history of a job and what its re-layouts bought, for the end-of-run summary.

Pure functions over what the store returns (`Store.layouts`, `metrics`, `events`,
`generations`), so they are unit-testable on hand-built data; `history_from_store` only reads.

**When a layout took effect.** The store records when each layout was *written*, which is not
when the workers started training under it (the controller drains worker reports in batches), so
the first step trained under each layout version is derived:

* A re-layout after a freeze decision (its freeze boundary grew past the previous version's): the
  workers decide after step *s*, re-lay out, and train step *s + 1* under it. *s* comes from the
  job's `freeze` event for that boundary (its `data.step`), so this is exact.
* Any other layout (the initial one, one the workers measured and planned at start-up, one
  planned for a re-formed world after a failure) is in force from the first step recorded in
  its generation: the generation running when it was recorded (start-up planning happens after
  the generation opens), or else the next one to start (a re-formed world's layout is recorded
  just before its generation opens). Without generation rows the job counts as one generation.

A version superseded before it trained a step (the initial layout, when the workers re-planned
it at start-up) gets a row without steps.

**Samples/s** per version is the median of the per-step `samples_per_s` over the steps trained
under it (the median ignores the odd slow step: an evaluation, a checkpoint, a decision point).
"before" is the previous version's median (the previous one that trained any step).

**What it bought** compares the last version that trained with the first one:

* speed-up: the ratio of their median samples/s;
* estimated wall time saved: for every later version, its steps x (median wall time per step
  under the first version - median wall time per step under it), minus the pauses the switches
  cost. Wall time per step is the gap between consecutive metric rows (worker clock, the whole
  loop: data, pipeline, optimizer, reports), medians again; a switch's pause is the gap before
  the first step under the new version minus that version's median step time (the decision,
  the checkpoint the re-layout commits through, rebuilding the process groups). The
  counterfactual is "the job had kept its first layout and trained every step at that layout's
  median pace": an estimate, since that pace would have varied too, but not a flattering one
  (eval and checkpoint time are the same in both and are left out of both).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.table import Table

from pipetransformer.core.stage_times import PipelineReading, per_rank, pipeline_reading
from pipetransformer.core.state import Layout

if TYPE_CHECKING:
    from pipetransformer.store import (
        EventRow,
        GenerationRow,
        MetricRow,
        RecordedLayout,
        StageTimesRow,
        Store,
    )

__all__ = [
    "Bought",
    "LayoutPeriod",
    "bought_line",
    "cache_line",
    "effective_steps",
    "history_from_store",
    "history_table",
    "layout_history",
    "pipeline_from_store",
    "pipeline_reading_of",
    "what_it_bought",
]

# Events are read newest first with a limit; a summary needs every freeze event of the job.
_EVENT_LIMIT = 1_000_000
# Longer reasons (a planner's arithmetic) are cut in the table; the events keep them whole.
_REASON_CHARS = 48


@dataclass(frozen=True)
class LayoutPeriod:
    """One layout version and the steps trained under it."""

    layout: Layout
    reason: str
    from_step: int | None  # first step trained under it; None if it trained none
    steps: tuple[int, ...]  # the metric steps trained under it
    samples_per_s: float | None  # median over `steps`
    before: float | None  # the previous version's median samples/s (None for the first)
    step_s: float | None  # median wall seconds per step under it
    pause_s: float | None  # the switch to it: its first step's gap minus step_s

    @property
    def version(self) -> int:
        return self.layout.version


@dataclass(frozen=True)
class Bought:
    """What the re-layouts bought over the first layout (see the module docstring)."""

    first: int  # layout versions compared
    last: int
    frozen: int  # blocks frozen in the last version
    depth: int
    speedup: float  # median samples/s, last / first
    saved_s: float  # estimated wall time saved, net of pauses
    pauses_s: float  # what the switches cost (included in saved_s)
    train_s: float  # wall time from the first to the last recorded step


def _median(values: Iterable[float | None]) -> float | None:
    finite = [v for v in values if v is not None]
    return statistics.median(finite) if finite else None


def _first_step_from(metrics: Sequence[MetricRow], t: float) -> int | None:
    """The lowest step whose metric row was recorded at or after unix time `t`."""
    steps = [m.step for m in metrics if m.time >= t]
    return min(steps) if steps else None


def _freeze_steps(events: Iterable[EventRow]) -> dict[int, int]:
    """Freeze boundary -> the step after which the decision reaching it was taken (the latest
    such event, should a boundary have been reached twice after a recovery)."""
    found: dict[int, tuple[float, int]] = {}
    for e in events:
        d = e.data or {}
        if e.kind != "freeze" or "boundary" not in d or "step" not in d:
            continue
        when = e.time
        if d["boundary"] not in found or when >= found[d["boundary"]][0]:
            found[d["boundary"]] = (when, int(d["step"]))
    return {boundary: step for boundary, (_, step) in found.items()}


def effective_steps(
    layouts: Sequence[RecordedLayout],
    metrics: Sequence[MetricRow],
    events: Iterable[EventRow] = (),
    generations: Sequence[GenerationRow] = (),
) -> list[int | None]:
    """For each of `layouts` (in the order given, as `Store.layouts` returns them: by version),
    the first step trained under it, or None (see the module docstring for the rules)."""
    freeze_at = _freeze_steps(events)
    gens = sorted(
        (g.started_at.timestamp(), None if g.ended_at is None else g.ended_at.timestamp())
        for g in generations
    )
    out: list[int | None] = []
    previous: Layout | None = None
    for recorded in layouts:
        layout = recorded.layout
        f = layout.freeze_boundary
        grew = previous is not None and f > previous.freeze_boundary
        if grew and f in freeze_at:
            out.append(freeze_at[f] + 1)
        else:
            start = _generation_start(gens, recorded.created_at.timestamp())
            out.append(_first_step_from(metrics, start))
        previous = layout
    return out


def _generation_start(gens: Sequence[tuple[float, float | None]], created: float) -> float:
    """The start of the generation a layout recorded at `created` was made for: the one running
    then, else the next to start; -inf when the store has no generations (one implicit one),
    +inf when none starts after it (it never trained)."""
    if not gens:
        return float("-inf")
    for start, end in gens:
        if start <= created and (end is None or created < end):
            return start
    later = [start for start, _ in gens if start >= created]
    return min(later) if later else float("inf")


def _step_seconds(metrics: Sequence[MetricRow]) -> dict[int, float]:
    """Step -> wall seconds since the previous step's metric row (only where that step was
    recorded too and the clock moved forward)."""
    times = {m.step: m.time for m in metrics}
    return {
        s: t - times[s - 1] for s, t in times.items() if s - 1 in times and t - times[s - 1] > 0
    }


def layout_history(
    layouts: Sequence[RecordedLayout],
    metrics: Sequence[MetricRow],
    events: Iterable[EventRow] = (),
    generations: Sequence[GenerationRow] = (),
) -> list[LayoutPeriod]:
    """One `LayoutPeriod` per layout version: the steps trained under it (from its effective
    step up to the next version's), their median samples/s and step time, the previous
    version's samples/s, and the pause the switch to it cost."""
    starts = effective_steps(layouts, metrics, events, generations)
    rate = {m.step: m.samples_per_s for m in metrics}
    seconds = _step_seconds(metrics)
    all_steps = sorted(rate)
    periods: list[LayoutPeriod] = []
    before: float | None = None
    for i, (recorded, start) in enumerate(zip(layouts, starts, strict=True)):
        later = [s for s in starts[i + 1 :] if s is not None]
        end = min(later) if later else None  # the next version takes over there
        if start is None:
            steps: tuple[int, ...] = ()
        else:
            steps = tuple(s for s in all_steps if s >= start and (end is None or s < end))
        # the first step's gap holds the switch itself; the others are the version's pace
        step_s = _median(seconds.get(s) for s in steps[1:])
        pause = None
        if steps and steps[0] in seconds and step_s is not None and periods:
            pause = max(0.0, seconds[steps[0]] - step_s)
        median_rate = _median(rate[s] for s in steps)
        periods.append(
            LayoutPeriod(
                layout=recorded.layout,
                reason=recorded.reason,
                from_step=steps[0] if steps else None,
                steps=steps,
                samples_per_s=median_rate,
                before=before if periods else None,
                step_s=step_s,
                pause_s=pause,
            )
        )
        if median_rate is not None:
            before = median_rate
    return periods


def what_it_bought(history: Sequence[LayoutPeriod], metrics: Sequence[MetricRow]) -> Bought | None:
    """The last trained version against the first (module docstring); None when fewer than two
    versions trained steps (the layout never changed while training)."""
    trained = [p for p in history if p.steps and p.samples_per_s]
    if len(trained) < 2:
        return None
    first, last = trained[0], trained[-1]
    saved = pauses = 0.0
    for p in trained[1:]:
        if first.step_s is not None and p.step_s is not None:
            saved += len(p.steps) * (first.step_s - p.step_s)
        pauses += p.pause_s or 0.0
    times = [m.time for m in metrics]
    return Bought(
        first=first.version,
        last=last.version,
        frozen=last.layout.freeze_boundary,
        depth=last.layout.num_blocks,
        speedup=last.samples_per_s / first.samples_per_s,
        saved_s=saved - pauses,
        pauses_s=pauses,
        train_s=max(times) - min(times) if times else 0.0,
    )


def history_from_store(store: Store, job_id: str) -> tuple[list[LayoutPeriod], Bought | None]:
    """`layout_history` and `what_it_bought` of a job, read from the store."""
    metrics = store.metrics(job_id)
    history = layout_history(
        store.layouts(job_id),
        metrics,
        store.events(job_id, limit=_EVENT_LIMIT),
        store.generations(job_id),
    )
    return history, what_it_bought(history, metrics)


# -- presentation ----------------------------------------------------------------------------


def frozen_text(layout: Layout) -> str:
    """`F=0`, `F=1 (block 0)`, `F=5 (blocks 0-4)`."""
    f = layout.freeze_boundary
    if f == 0:
        return "F=0"
    return f"F={f} (block 0)" if f == 1 else f"F={f} (blocks 0-{f - 1})"


def shape_text(layout: Layout) -> str:
    """Pipeline ranks x replicas and each stage's blocks: `2x1 [0-2|3-5]`, `1x2 [5]`."""
    ranges = "|".join(
        str(s.start) if s.num_blocks == 1 else f"{s.start}-{s.end - 1}" for s in layout.stages
    )
    return f"{layout.pipeline_ranks}x{layout.replicas} [{ranges}]"


def short_reason(reason: str) -> str:
    """The gist of a recorded reason. A re-layout's reason is the freeze decision, then the
    planner's arithmetic (`autofreeze (decision 16: converged prefix 6 (gradient norm <= 0.2 x
    its peak), clipped to 5: froze blocks 0..4); F=5: autopipe 1x2 ...`): the table keeps why the
    blocks were frozen and leaves the rest to the job's events (`pipetransformer status`)."""
    text = " ".join(reason.split())
    if text.startswith("autofreeze ("):
        if "manual override" in text:
            return "manual freeze override"
        threshold = re.search(r"gradient norm <= (\S+) x its peak", text)
        if threshold:
            return f"AutoFreeze: gradient norms <= {threshold.group(1)} x peak"
        if "schedule: alpha-bound" in text:
            return "AutoFreeze: alpha-schedule"
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 1] + "…"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def history_table(history: Sequence[LayoutPeriod]) -> Table:
    """The layout history as a rich table, one row per version."""
    table = Table(title="layout history", title_justify="left", box=None, pad_edge=False)
    table.add_column("v", justify="right")
    table.add_column("from step", justify="right")
    table.add_column("frozen")
    table.add_column("shape")
    table.add_column("reason")
    table.add_column("samples/s before", justify="right")
    table.add_column("after", justify="right")
    for p in history:
        table.add_row(
            str(p.version),
            "-" if p.from_step is None else str(p.from_step),
            frozen_text(p.layout),
            shape_text(p.layout),
            short_reason(p.reason),
            _rate(p.before),
            _rate(p.samples_per_s),
        )
    return table


def bought_line(history: Sequence[LayoutPeriod], bought: Bought | None) -> str:
    """One sentence on what the re-layouts bought, or that the layout never changed."""
    if bought is None:
        trained = [p for p in history if p.steps]
        version = trained[-1].version if trained else (history[-1].version if history else 1)
        return f"the layout never changed while training (v{version} throughout)"
    sign = "saved" if bought.saved_s >= 0 else "lost"
    what = (
        f"after freezing {bought.frozen} of {bought.depth} blocks"
        if bought.frozen
        else f"after re-layout to v{bought.last}"
    )
    return (
        f"{what}: "
        f"{bought.speedup:.1f}x samples/s (v{bought.last} vs v{bought.first}); "
        f"estimated wall time {sign}: {abs(bought.saved_s):.0f} s of {bought.train_s:.0f} s "
        f"(re-layouts took {bought.pauses_s:.1f} s)"
    )


def cache_line(events: Iterable[EventRow]) -> str | None:
    """What AutoCache decided at the newest freeze boundary (the job's `cache_decided` events,
    one per rank that runs the frozen prefix), or None when nothing was frozen."""
    decided = [(e, e.data) for e in events if e.kind == "cache_decided" and e.data]
    if not decided:
        return None
    newest, d = max(decided, key=lambda ed: (ed[1].get("boundary", 0), ed[0].time))
    at = [data for _, data in decided if data.get("boundary") == d.get("boundary")]
    serving = sum(1 for data in at if data.get("use"))
    verb = (
        f"served the frozen blocks' output from the cache on {serving} of {len(at)} rank(s)"
        if serving
        else "recomputed the frozen blocks (the cache was not measured cheaper)"
    )
    return f"AutoCache at F={d.get('boundary')}: {verb}; {d.get('reason')}"


# the newest intervals `status` and the summary read: enough for every rank of a large job's
# newest layout without reading a long job's every row
PIPELINE_INTERVALS = 50


def pipeline_reading_of(
    rows: Sequence[StageTimesRow], layouts: Sequence[Layout]
) -> PipelineReading | None:
    """The slowest stage and the measured bubble under the newest layout the ranks measured
    (`core.stage_times.pipeline_reading`), or None without measurements (stage timing off,
    an older job, or before the first interval)."""
    if not rows:
        return None
    version = max(r.layout_version for r in rows)
    layout = next((lay for lay in layouts if lay.version == version), None)
    if layout is None:
        return None
    return pipeline_reading(
        per_rank(rows, version),
        layout.schedule,
        layout.pipeline_ranks,
        layout.microbatches,
        layout.virtual_stages,
    )


def pipeline_from_store(store: Store, job_id: str) -> PipelineReading | None:
    """`pipeline_reading_of` over the job's newest stored intervals and its layouts."""
    rows = store.stage_times(job_id, last_intervals=PIPELINE_INTERVALS)
    return pipeline_reading_of(rows, [r.layout for r in store.layouts(job_id)])
