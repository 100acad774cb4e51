"""What a person reads in the dashboard's tables: pure row builders of store data."""

from __future__ import annotations

import yaml

from pipetransformer.core.protocol import DataOpened, FreezeRequest
from pipetransformer.core.provenance import DATA_OPENED, describe_data
from pipetransformer.core.spec import ModelSpec, parse_spec
from pipetransformer.dashboard.views import (
    FREEZE_REQUEST_KINDS,
    WRAPPED_ROW_PX,
    HeldOut,
    compare_rows,
    device_use,
    event_rows,
    exit_text,
    fmt_ago,
    freeze_requests,
    held_out,
    idle_columns,
    markdown_text,
    model_name,
    provenance_lines,
    rank_parts,
    run_row,
    spec_yaml,
    throughput,
    without_empty,
    worker_rows,
    wrap_height,
)
from pipetransformer.store.rows import (
    EvaluationRow,
    EventRow,
    JobInfo,
    MetricRow,
    RecordedLayout,
    WorkerRow,
)
from tests.fixtures_store import packed_layout, two_stage_layout

T0 = 1_800_000_000.0


def event(id: int, time: float, kind: str, message: str, data: dict | None) -> EventRow:
    return EventRow(id=id, time=time, kind=kind, rank=None, message=message, data=data)


def metric(step: int, **fields: float | None) -> MetricRow:
    """A metric row with only what the header reads (the rest left plain)."""
    plain = {"epoch": 0, "loss": None, "samples_per_s": None, "lr": 0.0, "time": T0 + step}
    return MetricRow(step=step, **(plain | fields))


def request(rid: str, layers: int, who: str = "alice (dashboard)", t: float = T0) -> dict:
    return FreezeRequest(id=rid, layers=layers, who=who, reason=f"why {rid}", time=t).model_dump(
        mode="json"
    )


def test_freeze_requests_follow_each_request_to_its_outcome() -> None:
    a, b, c = request("a1", 2), request("b2", 3, t=T0 + 50), request("c3", 5, t=T0 + 90)
    events = [  # newest first, as Store.events returns them
        event(6, T0 + 95, "freeze_requested", "", {"request": c}),
        event(
            5,
            T0 + 80,
            "freeze_rejected",
            "request b2 by alice: layers=3 is below the current boundary 4",
            {"request": b, "step": 40, "outcome": "rejected", "boundary": 4},
        ),
        event(4, T0 + 60, "freeze_requested", "", {"request": b}),
        event(
            3,
            T0 + 30,
            "freeze_applied",
            "request a1 by alice: moved boundary 0 -> 2",
            {"request": a, "step": 20, "outcome": "applied", "boundary": 2},
        ),
        event(2, T0 + 1, "freeze_requested", "", {"request": a}),
    ]
    rows = freeze_requests(events)
    assert [(r["request"], r["status"]) for r in rows] == [
        ("c3", "pending"),
        ("b2", "rejected"),
        ("a1", "applied"),
    ]
    applied = rows[2]
    assert applied["who"] == "alice (dashboard)" and applied["reason"] == "why a1"
    assert applied["layers"] == 2 and applied["step"] == 20
    assert applied["filed"] == "2027-01-15 08:00:00 UTC"
    assert applied["decided"] == "2027-01-15 08:00:30 UTC"
    assert "moved boundary" in applied["outcome"]
    assert set(FREEZE_REQUEST_KINDS) == {
        "freeze_requested",
        "freeze_applied",
        "freeze_superseded",
        "freeze_rejected",
    }


def test_a_request_not_yet_audited_shows_as_pending() -> None:
    pending = FreezeRequest(id="d4", layers=4, who="bob", reason="r", time=T0).model_dump_json()
    rows = freeze_requests([], pending)
    assert [(r["request"], r["status"], r["who"]) for r in rows] == [("d4", "pending", "bob")]
    assert "not audited" in rows[0]["outcome"]
    # once audited, it is listed once
    audited = event(
        1,
        T0 + 2,
        "freeze_requested",
        "",
        {"request": FreezeRequest.model_validate_json(pending).model_dump(mode="json")},
    )
    assert len(freeze_requests([audited], pending)) == 1
    # text filed by hand that is no request
    assert freeze_requests([], "{not json")[0]["reason"] == "unreadable request"


def test_worker_rows_say_how_each_rank_ended() -> None:
    base = {
        "node": "n1:100",
        "host": "n1",
        "log": "/runs/jobs/j/logs/node-0.log",
        "assigned_at": T0,
        "started_at": T0 + 1,
        "detail": None,
    }
    workers = [
        {
            **base,
            "generation": 1,
            "rank": 0,
            "pid": 11,
            "stages": [0],
            "replica": 0,
            "last_report_at": T0 + 10,
            "lease": "released",
            "state": "aborted",
            "exit_code": None,
            "signal": None,
        },
        {
            **base,
            "generation": 1,
            "rank": 1,
            "pid": 12,
            "stages": [1],
            "replica": 0,
            "last_report_at": None,
            "lease": "lapsed",
            "state": "died",
            "exit_code": None,
            "signal": 9,
            "detail": "killed",
        },
        {
            **base,
            "generation": 2,
            "rank": 0,
            "pid": 21,
            "stages": [0, 1],
            "replica": 0,
            "last_report_at": T0 + 118,
            "lease": "held",
            "state": "running",
            "exit_code": None,
            "signal": None,
        },
        {
            **base,
            "generation": 2,
            "rank": 1,
            "pid": None,
            "stages": None,
            "replica": None,
            "host": None,
            "last_report_at": None,
            "lease": "unknown",
            "state": "assigned",
            "exit_code": None,
            "signal": None,
            "log": None,
        },
    ]
    rows = worker_rows([WorkerRow(**w) for w in workers], now=T0 + 120)
    assert [(r["generation"], r["rank"]) for r in rows] == [(2, 0), (2, 1), (1, 0), (1, 1)]
    live, assigned, _, died = rows
    assert live["last report"] == "2 s ago" and live["stage"] == "0,1" and live["lease"] == "held"
    assert assigned["host"] == "n1:100"  # before Started: the node from the join request
    assert assigned["pid"] == "" and assigned["stage"] == "" and assigned["log"] == ""
    assert died["exit"] == "SIGKILL (9)" and died["lease"] == "lapsed"
    assert all(v is not None and v != "None" for r in rows for v in r.values())


def test_small_formatters() -> None:
    assert exit_text(None, None) == "" and exit_text(1, None) == "exit 1"
    assert exit_text(None, 15) == "SIGTERM (15)" and exit_text(None, 99) == "signal 99 (99)"
    assert fmt_ago(None, T0) == "" and fmt_ago(T0 - 600, T0) == "10 min ago"
    assert fmt_ago(T0 - 7200, T0) == "2.0 h ago"


def test_event_rows_name_the_controller() -> None:
    rows = event_rows(
        [
            EventRow(id=1, time=T0, kind="job_created", rank=None, message="m", data=None),
            EventRow(id=2, time=T0, kind="worker_started", rank=1, message="m", data={}),
        ]
    )
    assert [r["from"] for r in rows] == ["controller", "rank 1"]


def test_spec_yaml_round_trips() -> None:
    spec = parse_spec({"name": "x", "model": {"depth": 4}, "freeze": {"policy": "gradient"}})
    text = spec_yaml(spec)
    assert parse_spec(yaml.safe_load(text)) == spec
    assert text.startswith("name: x")


def test_device_use_in_the_header_only_when_known() -> None:
    cpu = [metric(s, samples_per_s=10.0, mfu=None) for s in range(3)]
    assert device_use(cpu, None) == []  # a CPU run: the header is as it was
    assert device_use([metric(1)], [None, None]) == []  # older rows; no rank said
    gpu = [metric(1, mfu=0.40), metric(2, mfu=None), metric(3, mfu=0.424)]
    assert device_use(gpu, [11000.0, 12595.2]) == [
        ("MFU", "41.2 %"),  # over the recent window, like the header's samples/s
        ("Peak GPU memory", "12.3 GiB (rank 1)"),
    ]
    assert device_use(cpu, [2048.0]) == [("Peak GPU memory", "2.0 GiB (rank 0)")]
    assert device_use(gpu, None) == [("MFU", "41.2 %")]


def test_the_header_says_where_model_and_data_came_from() -> None:
    """The model from the stored spec, each split's rows from the newest `data_opened` event
    (events come newest first), paths and column names shown as written, not as markdown."""
    spec = parse_spec(
        {
            "name": "x",
            "model": {
                "pretrained": {"source": "./my_vit", "path": "/m/my_vit", "fingerprint": "ab" * 16},
                "family": "vit", "dim": 32, "depth": 3, "heads": 2, "image_size": 16,
                "patch_size": 4, "channels": 3, "num_classes": 5,
            },
            "data": {"dataset": "table", "train": "/d/train_*.parquet", "test": "/d/test.parquet",
                     "columns": {"image": "img_col"}},
            "parallel": {"stages": 1},
        }
    )  # fmt: skip

    def opened(id: int, rows: int) -> EventRow:
        origin = describe_data(spec.data, rows, 20)
        data = DataOpened(rank=0, generation=id, origin=origin).payload()
        return EventRow(id=id, time=T0 + id, kind=DATA_OPENED, rank=0, message="", data=data)

    lines = provenance_lines(spec, [opened(2, 80), opened(1, 79)])
    assert lines == [
        "**model** · /m/my\\_vit (vit, 3 blocks of dim 32, 5 classes; fingerprint abababababab)",
        "**data** · table; columns img\\_col (image), label",
        "**train** · 80 rows from /d/train\\_\\*.parquet",
        "**held-out** · 20 rows from /d/test.parquet",
    ]
    assert (
        provenance_lines(spec, [])[2]
        == "**train** · /d/train\\_\\*.parquet (rows not reported yet)"
    )
    seeded = provenance_lines(parse_spec({"name": "s", "data": {"dataset": "digits"}}), [])
    assert seeded == [
        "**model, data** · seeded vit, 6 blocks of dim 64, 10 classes on built-in digits, "
        "rows not reported yet"
    ]
    assert markdown_text("a_b *c* `d` $e$ <f>") == "a\\_b \\*c\\* \\`d\\` \\$e\\$ \\<f\\>"


def test_rank_parts_follow_each_layout_version() -> None:
    """A 2x1 job that froze into 1x2: rank 1 moves from stage 1 to replica 1 of stage 0."""
    from datetime import UTC, datetime

    when = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    layouts = [
        RecordedLayout(layout=two_stage_layout(1), reason="initial", created_at=when),
        RecordedLayout(layout=packed_layout(2, 5), reason="autofreeze", created_at=when),
    ]
    rows = rank_parts(layouts)
    assert [(r["layout"], r["shape"], r["frozen"]) for r in rows] == [
        ("v1", "2x1", 0),
        ("v2", "1x2", 5),
    ]
    assert [(r["rank 0"], r["rank 1"]) for r in rows] == [
        ("S0 · r0", "S1 · r0"),
        ("S0 · r0", "S0 · r1"),
    ]
    assert rank_parts([]) == []


# ---- several jobs: the runs table and Compare's summary


def job_info(
    job_id: str, *, step: int = 40, frozen: int = 2, minutes: float = 3.0, **spec
) -> JobInfo:
    """A stored job as `Store.list_jobs` returns it."""
    from datetime import UTC, datetime, timedelta

    created = datetime.fromtimestamp(T0, UTC)
    return JobInfo(
        id=job_id,
        name=job_id,
        spec=parse_spec({"name": job_id, "model": {"depth": 6, "dim": 32}, **spec}),
        workdir="/w",
        state="completed",
        message=None,
        created_at=created,
        updated_at=created + timedelta(minutes=minutes),
        epoch=3,
        step=step,
        samples_consumed=0,
        lr=1e-3,
        freeze_boundary=frozen,
        layout_version=2,
        accuracy=None,
    )


def evaluation(step: int, accuracy: float, loss: float | None = None) -> EvaluationRow:
    return EvaluationRow(epoch=step // 10, step=step, accuracy=accuracy, loss=loss, time=T0 + step)


def as_language_model(job: JobInfo) -> JobInfo:
    """`job` with a causal LM's task (what a decoder checkpoint's job reads as)."""
    model = job.spec.model.model_copy(update={"task": "causal-lm"})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"model": model})})


def test_held_out_is_the_newest_and_the_best_of_a_jobs_evaluations() -> None:
    """Classification: accuracy, the last one and the highest (evaluations in any order); a
    language model also its perplexity, exp of the held-out loss, the last and the lowest."""
    import math

    job = job_info("a")
    evals = [evaluation(30, 0.7), evaluation(10, 0.5), evaluation(20, 0.8)]
    assert held_out(job, evals) == HeldOut(final=0.7, best=0.8)
    assert held_out(job, []) == HeldOut()
    lm = as_language_model(job)
    found = held_out(lm, [evaluation(10, 0.2, loss=3.0), evaluation(20, 0.3, loss=2.0),
                          evaluation(30, 0.25, loss=2.5)])  # fmt: skip
    assert (found.final, found.best) == (0.25, 0.3)
    assert found.final_ppl == math.exp(2.5) and found.best_ppl == math.exp(2.0)
    # an evaluation without a loss has no perplexity; the best is over those that have one
    found = held_out(lm, [evaluation(10, 0.2, loss=2.0), evaluation(20, 0.3)])
    assert found.final_ppl is None and found.best_ppl == math.exp(2.0)


def test_throughput_weighs_each_step_by_its_time() -> None:
    """Two steps of the same batch at 100 and 300 samples/s took 1/100 + 1/300 s per sample:
    150 samples/s over the run (the plain mean, 200, would overstate it)."""
    rows = [metric(1, samples_per_s=100.0), metric(2, samples_per_s=300.0)]
    assert throughput(rows) == 150.0
    unknown = [metric(3, samples_per_s=None), metric(4, samples_per_s=0.0)]
    assert throughput(rows + unknown) == 150.0  # steps that reported none are left out
    assert throughput(unknown) is None and throughput([]) is None


def test_run_row_sums_up_a_job_from_its_stored_rows() -> None:
    job = job_info("vit-a", data={"dataset": "synthetic"}, minutes=90)
    evals = [evaluation(10, 0.5), evaluation(20, 0.9), evaluation(30, 0.85)]
    row = run_row(job, held_out(job, evals), 2)
    assert row == {
        "job": "vit-a",
        "state": "completed",
        "model": "vit 6×32",
        "dataset": "synthetic",
        "created": "2027-01-15 08:00:00 UTC",
        "duration": 90.0,
        "steps": 40,
        "final": 0.85,
        "best": 0.9,
        "final ppl": None,
        "best ppl": None,
        "frozen": "2/6",
        "recoveries": 2,
    }
    # before its first evaluation: no numbers made up
    assert run_row(job, held_out(job, []), 0)["final"] is None
    # perplexity columns only where some job has a perplexity
    assert "final ppl" not in without_empty([row])[0]
    lm_job = as_language_model(job)
    lm = run_row(lm_job, held_out(lm_job, [evaluation(10, 0.3, loss=1.0)]), 0)
    assert set(without_empty([row, lm])[0]) == set(row)


def test_model_name_is_short_enough_for_a_cell() -> None:
    hub = {"source": "Qwen/Qwen3-0.6B", "revision": "main", "path": "/cache/snap/abc"}
    folder = {"source": "./my_vit", "path": "/m/my_vit"}
    shared = {"family": "vit", "dim": 32, "depth": 3, "heads": 2, "image_size": 16,
              "patch_size": 4, "channels": 3, "num_classes": 5}  # fmt: skip
    data = {"dataset": "table", "train": "/d/train.parquet", "test": "/d/test.parquet",
            "columns": {"image": "img"}}  # fmt: skip

    def model(pretrained: dict) -> ModelSpec:
        spec = {"name": "p", "model": {"pretrained": pretrained, **shared}, "data": data}
        return parse_spec({**spec, "parallel": {"stages": 1}}).model

    assert model_name(parse_spec({"name": "s"}).model) == "vit 6×64"
    assert model_name(model(hub)) == "Qwen/Qwen3-0.6B"
    assert model_name(model(folder)) == "my_vit"


def test_compare_rows_give_each_job_its_speed_up_against_the_first() -> None:
    """The first job picked is the baseline: a job at twice its samples/s is 2.0x, one that
    reported no throughput has none (never a made-up 0)."""
    base, fast, idle = job_info("base"), job_info("fast", frozen=4, minutes=1.5), job_info("idle")
    metrics = {
        "base": [metric(1, samples_per_s=100.0), metric(2, samples_per_s=100.0)],
        "fast": [metric(1, samples_per_s=150.0), metric(2, samples_per_s=300.0)],
    }
    evaluations = {"base": [evaluation(20, 0.6)], "fast": [evaluation(20, 0.7)]}
    rows = compare_rows([base, fast, idle], metrics, evaluations)
    assert [r["job"] for r in rows] == ["base", "fast", "idle"]
    assert [r["speed-up"] for r in rows] == [1.0, 2.0, None]
    assert [r["samples/s"] for r in rows] == [100.0, 200.0, None]
    assert [(r["final"], r["best"]) for r in rows] == [(0.6, 0.6), (0.7, 0.7), (None, None)]
    assert [r["frozen"] for r in rows] == ["2/6", "4/6", "2/6"]
    assert [r["duration"] for r in rows] == [3.0, 1.5, 3.0]
    assert "final ppl" not in rows[0]  # no language model among them
    # a baseline without throughput gives no job a speed-up
    assert [r["speed-up"] for r in compare_rows([idle, fast], metrics, evaluations)] == [None] * 2
    assert compare_rows([], {}, {}) == []


def test_wrap_height_only_where_some_text_needs_more_than_a_line() -> None:
    rows = [{"message": "short", "kind": "x" * 200}, {"message": "also short"}]
    assert wrap_height(rows, {"message": 300}) is None  # other columns do not count
    rows.append({"message": "a long message " * 10})
    assert wrap_height(rows, {"message": 300}) == WRAPPED_ROW_PX > 64  # Streamlit wraps above
    assert wrap_height([], {"message": 300}) is None
    assert wrap_height([{"message": None}], {"message": 10}) is None


def test_idle_columns_are_those_nobody_spent_time_in() -> None:
    rows = [{"a": 0.0, "b": 1.0, "c": 0.0}, {"a": 0.0, "b": 0.0}]
    assert idle_columns(rows, ["a", "b", "c"]) == ["a", "c"]
