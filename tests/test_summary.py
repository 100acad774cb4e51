"""The end-of-run summary's layout history (orchestrator/summary.py): when each layout version
took effect, samples/s before and after, and what the re-layouts bought, on hand-built data and
on a hand-built SQLite store; and how device use (MFU, peak GPU memory) reads in the progress
lines and `pipetransformer status`."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from rich.console import Console

from pipetransformer.core.protocol import Metrics
from pipetransformer.core.readings import largest_peak, mfu_text, peak_memory_text
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout
from pipetransformer.orchestrator.cli import main
from pipetransformer.orchestrator.controller import Progress
from pipetransformer.orchestrator.progress import _fmt
from pipetransformer.orchestrator.summary import (
    bought_line,
    effective_steps,
    history_from_store,
    history_table,
    layout_history,
    short_reason,
    what_it_bought,
)
from pipetransformer.store import (
    EventRow,
    GenerationRow,
    MetricRow,
    RecordedLayout,
    Store,
    sqlite_url,
)
from tests.fixtures_store import packed_layout, two_stage_layout

T0 = 10_000.0  # small: unix-sized times would leave step gaps only ~1e-7 s precise
REASON_V2 = (
    "autofreeze (decision 5: converged prefix 2 (gradient norm <= 0.2 x its peak): froze "
    "blocks 0..1); F=2: autopipe 2x1 [2-3|4-5] m=4 b=16 F=2 bottleneck=3.1ms (stage 0)"
)
REASON_V3 = (
    "autofreeze (decision 8: converged prefix 6 (gradient norm <= 0.2 x its peak), clipped to "
    "5: froze blocks 2..4); F=5: autopipe 1x2 [5-5] m=4 b=8 F=5 bottleneck=1.2ms (stage 0)"
)


# Steps 1-10 under v1 (0.1 s and 640 samples/s a step, step 5 a slow outlier), 11-20 under v2
# (0.05 s, 1280/s; the switch before step 11 cost 0.5 s), 21-30 under v3 (0.025 s, 2560/s; the
# switch before step 21 cost 0.3 s).
PACE = {1: (0.1, 640.0), 2: (0.05, 1280.0), 3: (0.025, 2560.0)}
PAUSE = {11: 0.5, 21: 0.3}


def relaid_metrics(t0: float = T0) -> list[MetricRow]:
    rows, t = [], t0
    for step in range(1, 31):
        seconds, rate = PACE[1 + (step - 1) // 10]
        t += seconds + PAUSE.get(step, 0.0)
        rate = 100.0 if step == 5 else rate
        frozen = 0 if step <= 10 else 2 if step <= 20 else 5
        rows.append(
            MetricRow(
                step=step, epoch=0, samples_per_s=rate, time=t, loss=1.0, lr=1e-3, frozen=frozen
            )
        )
    return rows


def reports(rows: list[MetricRow]) -> list[Metrics]:
    """The worker reports the store keeps as `rows`."""
    return [Metrics(rank=0, samples_consumed=0, **r.model_dump()) for r in rows]


def event(kind: str, t: float, message: str = "", data: dict | None = None) -> EventRow:
    return EventRow(id=0, time=t, kind=kind, rank=None, message=message, data=data)


def layout(lay: Layout, reason: str, t: float) -> RecordedLayout:
    return RecordedLayout(layout=lay, reason=reason, created_at=t)


def generation(number: int, started: float, ended: float | None = None) -> GenerationRow:
    state = "running" if ended is None else "aborted"
    return GenerationRow(
        number=number, world_size=2, state=state, started_at=started, ended_at=ended, reason=None
    )


def freeze_event(step: int, previous: int, boundary: int, t: float) -> EventRow:
    return event(
        "freeze",
        t,
        f"auto: blocks {previous}..{boundary - 1} frozen at step {step}",
        {"step": step, "previous": previous, "boundary": boundary, "source": "auto"},
    )


def relaid_inputs(t0: float = T0):
    layouts = [
        layout(two_stage_layout(1, 0), "initial", t0 - 5),
        # recorded some time after the steps they govern started: the freeze events decide
        layout(two_stage_layout(2, 2), REASON_V2, t0 + 3.0),
        layout(packed_layout(3), REASON_V3, t0 + 3.0),
    ]
    events = [  # newest first, as the store returns them
        freeze_event(20, 2, 5, t0 + 2.0),
        freeze_event(10, 0, 2, t0 + 1.1),
        event("checkpoint_committed", t0 + 1.2, "step 10"),
    ]
    generations = [generation(1, t0 - 1)]
    return layouts, relaid_metrics(t0), events, generations


def test_two_relayouts_take_effect_after_their_freeze_decisions() -> None:
    layouts, metrics, events, generations = relaid_inputs()
    assert effective_steps(layouts, metrics, events, generations) == [1, 11, 21]
    # without generation rows the job counts as one generation: same answer
    assert effective_steps(layouts, metrics, events) == [1, 11, 21]


def test_two_relayouts_history_numbers() -> None:
    history = layout_history(*relaid_inputs())
    assert [p.version for p in history] == [1, 2, 3]
    assert [p.from_step for p in history] == [1, 11, 21]
    assert [p.steps for p in history] == [
        tuple(range(1, 11)),
        tuple(range(11, 21)),
        tuple(range(21, 31)),
    ]
    # medians: step 5's outlier does not move v1's 640
    assert [p.samples_per_s for p in history] == [640.0, 1280.0, 2560.0]
    assert [p.before for p in history] == [None, 640.0, 1280.0]
    assert [p.step_s for p in history] == pytest.approx([0.1, 0.05, 0.025])
    assert history[0].pause_s is None
    assert [p.pause_s for p in history[1:]] == pytest.approx([0.5, 0.3])


def test_two_relayouts_what_it_bought() -> None:
    layouts, metrics, events, generations = relaid_inputs()
    history = layout_history(layouts, metrics, events, generations)
    bought = what_it_bought(history, metrics)
    assert bought is not None
    assert (bought.first, bought.last, bought.frozen, bought.depth) == (1, 3, 5, 6)
    assert bought.speedup == pytest.approx(4.0)
    # 10 steps x (0.1 - 0.05) + 10 steps x (0.1 - 0.025) - the 0.8 s the two switches cost
    assert bought.pauses_s == pytest.approx(0.8)
    assert bought.saved_s == pytest.approx(0.5 + 0.75 - 0.8)
    assert bought.train_s == pytest.approx(metrics[-1].time - metrics[0].time)
    line = bought_line(history, bought)
    assert line.startswith("after freezing 5 of 6 blocks: 4.0x samples/s (v3 vs v1)")
    assert "saved: 0 s" in line and "re-layouts took 0.8 s" in line


def test_history_table_shows_each_version() -> None:
    history = layout_history(*relaid_inputs())
    console = Console(record=True, width=160)
    console.print(history_table(history))
    text = console.export_text()
    for expected in (
        "2x1 [0-2|3-5]",
        "2x1 [2-3|4-5]",
        "1x2 [5]",
        "F=2 (blocks 0-1)",
        "F=5 (blocks 0-4)",
        "AutoFreeze: gradient norms <= 0.2 x peak",
        "1,280",
        "2,560",
    ):
        assert expected in text, expected


def test_short_reason() -> None:
    assert short_reason(REASON_V3) == "AutoFreeze: gradient norms <= 0.2 x peak"
    assert short_reason("initial") == "initial"
    assert (
        short_reason("autofreeze (decision 2: schedule: alpha-bound 2: froze blocks 0..1); F=2: x")
        == "AutoFreeze: alpha-schedule"
    )
    manual = "autofreeze (manual override at decision 3: moved boundary 0 -> 3 (automatic: 0)); x"
    assert short_reason(manual) == "manual freeze override"
    assert len(short_reason("re-formed for 1 worker(s) " + "x" * 100)) == 48


def test_static_job_has_one_row_and_says_the_layout_never_changed() -> None:
    metrics = relaid_metrics()[:10]
    history = layout_history([layout(two_stage_layout(1, 0), "initial", T0 - 5)], metrics)
    assert len(history) == 1
    (only,) = history
    assert (only.from_step, len(only.steps), only.samples_per_s, only.before) == (1, 10, 640, None)
    assert only.step_s == pytest.approx(0.1)
    assert what_it_bought(history, metrics) is None
    line = bought_line(history, None)
    assert line == "the layout never changed while training (v1 throughout)"


def test_layout_planned_at_startup_supersedes_the_initial_one() -> None:
    # v2 measured by the workers once generation 1 had started (same F): in force from its
    # first step; v1 never trained a step and gets an empty row
    metrics = relaid_metrics()[:10]
    measured = two_stage_layout(2, 0)
    layouts = [
        layout(two_stage_layout(1, 0), "initial", T0 - 5),
        layout(measured, "autopipe 2x1 [0-2|3-5] m=4", T0 + 0.35),  # drained after steps 1-2
    ]
    generations = [generation(1, T0 - 1)]
    history = layout_history(layouts, metrics, (), generations)
    assert [p.from_step for p in history] == [None, 1]
    assert history[0].steps == () and history[0].samples_per_s is None
    assert history[1].before is None and history[1].samples_per_s == 640.0
    assert what_it_bought(history, metrics) is None


def test_reformed_world_takes_effect_at_its_generation() -> None:
    # generation 1 ran steps 1-10 and was lost; the controller recorded v2 for the smaller
    # world just before generation 2 opened; generation 2 re-ran steps 9-10 (already recorded,
    # so kept from generation 1) and went on from step 11
    first = relaid_metrics()[:10]
    end1 = first[-1].time + 2.0
    second = [
        MetricRow(
            step=s, epoch=0, loss=None, lr=1e-3, samples_per_s=300.0, time=end1 + 1 + 0.2 * (s - 8)
        )
        for s in range(11, 16)
    ]
    layouts = [
        layout(two_stage_layout(1, 0), "initial", T0 - 5),
        layout(packed_layout(2, 0), "re-formed for 1 worker(s)", end1 + 0.1),
    ]
    generations = [generation(1, T0 - 1, end1), generation(2, end1 + 0.2)]
    history = layout_history(layouts, first + second, (), generations)
    assert [p.from_step for p in history] == [1, 11]
    assert history[1].steps == tuple(range(11, 16))
    assert (history[1].before, history[1].samples_per_s) == (640.0, 300.0)
    bought = what_it_bought(history, first + second)
    assert bought is not None and bought.frozen == 0
    assert bought_line(history, bought).startswith("after re-layout to v2: 0.5x samples/s")


# -- the same through a real (SQLite) store ---------------------------------------------------


def _job(store: Store, job_id: str) -> float:
    """A job with its initial layout and a running generation; returns a unix time after both
    were recorded (the store stamps layouts and generations with the current time)."""
    spec = JobSpec.model_validate({"name": "vit-digits", "model": {"depth": 6}})
    store.create_job(job_id, spec, workdir="/tmp/runs")
    store.record_layout(job_id, two_stage_layout(1, 0), reason="initial")
    store.start_generation(job_id, world_size=2)
    return datetime.now(UTC).timestamp() + 1.0


def test_history_from_store_with_two_relayouts(store: Store) -> None:
    t0 = _job(store, "relaid")
    metrics = relaid_metrics(t0)
    store.add_metrics("relaid", reports(metrics))
    for e in reversed(relaid_inputs(t0)[2]):
        store.add_event("relaid", e.kind, e.message, data=e.data, time=e.time)
    store.record_layout("relaid", two_stage_layout(2, 2), reason=REASON_V2)
    store.record_layout("relaid", packed_layout(3), reason=REASON_V3)
    history, bought = history_from_store(store, "relaid")
    assert [p.from_step for p in history] == [1, 11, 21]
    assert [p.samples_per_s for p in history] == [640.0, 1280.0, 2560.0]
    assert [p.before for p in history] == [None, 640.0, 1280.0]
    assert bought is not None
    assert bought.speedup == pytest.approx(4.0)
    assert bought.saved_s == pytest.approx(0.45, abs=1e-3)  # times are stored to microseconds


def test_history_from_store_static_job(store: Store) -> None:
    t0 = _job(store, "static")
    store.add_metrics("static", reports(relaid_metrics(t0)[:10]))
    history, bought = history_from_store(store, "static")
    assert [(p.version, p.from_step, len(p.steps), p.samples_per_s) for p in history] == [
        (1, 1, 10, 640.0)
    ]
    assert bought is None


def test_the_cache_line_says_what_autocache_decided_at_the_newest_boundary() -> None:
    from pipetransformer.orchestrator.summary import cache_line

    def decided(rank: int, boundary: int, use: bool, t: float) -> EventRow:
        reason = f"measured at F={boundary}, batch 32: recompute 2.00 ms vs cache 0.50 ms"
        data = {"boundary": boundary, "use": use, "reason": reason}
        return EventRow(id=0, kind="cache_decided", rank=rank, time=t, message="", data=data)

    assert cache_line([event("freeze", 0.0, data={"boundary": 1})]) is None
    events = [decided(0, 1, False, 1.0), decided(0, 5, True, 2.0), decided(1, 5, True, 2.1)]
    line = cache_line(events)
    assert line is not None and line.startswith("AutoCache at F=5: served")
    assert "on 2 of 2 rank(s)" in line and "recompute 2.00 ms vs cache 0.50 ms" in line
    line = cache_line([decided(0, 3, False, 1.0)])
    assert line is not None and "recomputed the frozen blocks" in line


# ---- device use: MFU and peak GPU memory in the progress lines and `pipetransformer status`


def test_mfu_and_peak_memory_texts() -> None:
    assert mfu_text(0.412) == "41.2 %"
    assert mfu_text(0.0) == "0.0 %"
    assert mfu_text(None) is None and mfu_text(float("nan")) is None
    assert largest_peak([12.0, None, 30.0, 30.0]) == (2, 30.0)  # a tie: the lowest rank
    assert largest_peak([None, None]) is None and largest_peak([]) is None
    assert largest_peak(None) is None
    assert peak_memory_text([1024.0, 12595.2, None]) == "12.3 GiB (rank 1)"
    assert peak_memory_text([512.0]) == "0.5 GiB (rank 0)"
    assert peak_memory_text([None]) is None and peak_memory_text(None) is None


def test_progress_lines_show_mfu_and_peak_memory_only_when_known() -> None:
    layout = two_stage_layout(1, 0)
    cpu = Progress(step=5, epoch=0, total_steps=10, loss=0.5, samples_per_s=1234.0)
    # exactly the line a CPU run printed before workers measured anything
    assert (
        _fmt(cpu, layout)
        == f"epoch 0  step 5/10  loss 0.5000  1,234 samples/s  layout {layout.short}"
    )
    gpu = Progress(
        step=5,
        epoch=0,
        total_steps=10,
        loss=0.5,
        samples_per_s=1234.0,
        mfu=0.412,
        peak_memory_mib=[11000.0, 9000.0, 12595.2, None],
    )
    assert _fmt(gpu, layout) == (
        "epoch 0  step 5/10  loss 0.5000  1,234 samples/s  MFU 41.2 %  "
        f"peak 12.3 GiB (rank 2)  layout {layout.short}"
    )
    line = _fmt(Progress(step=5, epoch=0, peak_memory_mib=[2048.0]), layout)  # no MFU known
    assert "MFU" not in line and "peak 2.0 GiB (rank 0)" in line


def _status(url: str, *args: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["status", "--db", url, *args]) == 0
    return capsys.readouterr().out


def test_status_shows_mfu_and_peak_memory_only_when_known(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = sqlite_url(tmp_path / "store.db")
    with Store.open(url) as store:
        for job in ("cpu", "gpu"):
            store.create_job(job, JobSpec(name=job), str(tmp_path))
        row = {"rank": 0, "epoch": 0, "samples_consumed": 0, "loss": 1.0, "samples_per_s": 10.0,
               "lr": 1e-3, "frozen": 0}  # fmt: skip
        store.add_metrics("cpu", [Metrics(**row, step=1, time=T0 + 1)])
        store.add_metrics(
            "gpu",
            [
                Metrics(**row, step=1, time=T0 + 1, mfu=0.4, peak_memory_mib=[1024.0, 3174.4]),
                Metrics(**row, step=2, time=T0 + 2, mfu=0.412),  # between control points
            ],
        )

    out = _status(url, "gpu", capsys=capsys)
    assert "41.2 %" in out and "3.1 GiB (rank 1)" in out
    assert [line.split()[0] for line in out.splitlines() if "%" in line or "GiB" in line] == [
        "mfu",
        "peak",
    ]
    status = json.loads(_status(url, "gpu", "--json", capsys=capsys))
    assert (status["mfu"], status["peak_memory_mib"]) == (0.412, [1024.0, 3174.4])

    out = _status(url, "cpu", capsys=capsys)
    assert "mfu" not in out and "peak" not in out and "GiB" not in out
    status = json.loads(_status(url, "cpu", "--json", capsys=capsys))
    assert (status["mfu"], status["peak_memory_mib"]) == (None, None)
