"""What a person reads in the dashboard's tables: pure row builders of store data."""

from __future__ import annotations

import yaml

from pipetransformer.core.protocol import DataOpened, FreezeRequest
from pipetransformer.core.provenance import DATA_OPENED, describe_data
from pipetransformer.core.spec import parse_spec
from pipetransformer.dashboard.views import (
    FREEZE_REQUEST_KINDS,
    device_use,
    event_rows,
    exit_text,
    fmt_ago,
    freeze_requests,
    markdown_text,
    provenance_lines,
    rank_parts,
    spec_yaml,
    worker_rows,
)
from pipetransformer.store.rows import EventRow, MetricRow, RecordedLayout, WorkerRow
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
