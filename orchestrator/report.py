"""What `pipetransformer run`, `resume` and the controller role print when a job's run ends: the
job's state, where its model and data came from and where its things are, then what the elastic
machinery did (one row per layout version, what re-laying out bought, what AutoCache decided).
Reads the store; renders with rich.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipetransformer.core.protocol import DataOrigin
from pipetransformer.core.provenance import DATA_OPENED, describe_data, origin_of, provenance
from pipetransformer.core.readings import held_out_text
from pipetransformer.core.recoveries import ABORTED, STARTED, Recovery, recoveries
from pipetransformer.core.tasks import task_of
from pipetransformer.orchestrator.summary import (
    bought_line,
    cache_line,
    history_from_store,
    history_table,
    pipeline_from_store,
)
from pipetransformer.store import JobInfo, Store


def data_origin(store: Store, job: JobInfo) -> DataOrigin:
    """Where the job's data came from: the newest `data_opened` event's (the workers' report,
    with the rows read), or the spec's data set and paths before one."""
    opened = store.events(job.id, limit=1, kinds=[DATA_OPENED])
    return origin_of(opened[0].data if opened else None) or describe_data(job.spec.data)


SHOWN_RECOVERIES = 5  # the newest; older ones are counted


def recoveries_of(store: Store, job_id: str) -> list[Recovery]:
    """The job's recoveries (`core.recoveries`), oldest first, from its stored events and steps."""
    events = store.events(job_id, limit=100_000, kinds=[ABORTED, STARTED])
    reasons = {g.number: g.reason for g in store.generations(job_id)}
    return recoveries(events, store.metrics(job_id), reasons)


def recovery_rows(found: list[Recovery]) -> list[tuple[str, str]]:
    """(label, text) rows of the newest recoveries, for `status` and the summary."""
    if not found:
        return []
    label = f"recoveries ({len(found)})" if len(found) > 1 else "recovery"
    shown = found[-SHOWN_RECOVERIES:]
    rows = [(label if i == 0 else "", r.text()) for i, r in enumerate(shown)]
    if len(found) > len(shown):
        rows.append(("", f"and {len(found) - len(shown)} earlier (pipetransformer status --json)"))
    return rows


def provenance_rows(store: Store, job: JobInfo) -> list[tuple[str, str]]:
    """Where the job's model and data came from (`core.provenance.provenance`): the model from
    its stored spec, the data's rows from the newest `data_opened` event (the workers' report)."""
    return provenance(job.spec, data_origin(store, job))


def print_summary(
    console: Console,
    store: Store,
    job_id: str,
    *,
    wall_s: float,
    store_url: str,
    checkpoints: Path,
    where: str,
) -> None:
    """The end-of-run summary of `job_id`. `where` is how later commands find the same store
    (`--workdir DIR` or `--db URL`), for the lines that say what to run next."""
    job = store.get_job(job_id)
    ckpt = store.latest_checkpoint(job_id)
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_row("job", f"{job.id} ({job.state})")
    if job.message:
        table.add_row("message", escape(job.message))
    evaluations = store.evaluations(job_id)
    f1 = evaluations[-1].f1 if evaluations else None
    token_loss = (
        evaluations[-1].loss if evaluations and task_of(job.spec.model).targets_per_token else None
    )
    table.add_row(
        "held-out", held_out_text(job.accuracy, f1, digits=2, token_loss=token_loss) or "n/a"
    )
    table.add_row("progress", f"epoch {job.epoch}, step {job.step}")
    table.add_row("wall time", f"{wall_s:.1f}s")
    for label, text in recovery_rows(recoveries_of(store, job.id)):
        table.add_row(label, escape(text))
    for label, text in provenance_rows(store, job):
        table.add_row(label, escape(text))
    table.add_row("store", store_url)
    table.add_row("checkpoints", str(checkpoints))
    if ckpt:
        table.add_row("last committed", f"{ckpt.path} (step {ckpt.step})")
    table.add_row("dashboard", f"pipetransformer dashboard {where}")
    if job.state != "completed":
        table.add_row("resume", f"pipetransformer resume {job.id} {where}")
    console.rule("summary")
    console.print(table)
    # What the elastic machinery did: one row per layout version, and what re-laying out bought
    history, bought = history_from_store(store, job.id)
    if history:
        console.print()
        console.print(history_table(history))
        console.print(bought_line(history, bought))
        cached = cache_line(store.events(job.id, limit=1000))
        if cached:
            console.print(escape(cached))
    # where the stages' time went under the last layout (the ranks' stage timings)
    if (reading := pipeline_from_store(store, job.id)) is not None:
        console.print(escape(f"pipeline: {reading.text()}"))
