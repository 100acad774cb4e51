"""The worker <-> controller protocol (core/protocol.py): every message round-trips as
JSON into its own type, and anything else is refused with the field that is wrong."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from pipetransformer.core.protocol import (
    BadReport,
    CheckpointWritten,
    Control,
    FreezeDecided,
    FreezeRequest,
    Metrics,
    UnreadableRequest,
    parse_event,
    read_freeze_request,
)
from pipetransformer.core.state import Layout, TrainingState


def test_events_round_trip_into_their_own_type() -> None:
    layout = Layout.build([(0, 3), (3, 6)], num_blocks=6, replicas=1, microbatches=2)
    events = [
        Metrics(
            rank=1,
            generation=2,
            step=3,
            epoch=0,
            samples_consumed=96,
            loss=0.5,
            lr=1e-3,
            samples_per_s=100.0,
            frozen=0,
        ),  # fmt: skip
        CheckpointWritten(
            rank=0,
            path="/x",
            size_bytes=10,
            checksum="ab",
            seconds=0.1,
            blocked_s=0.0,
            state=TrainingState(step=3),
            layout_version=1,
        ),  # fmt: skip
        FreezeDecided(
            rank=0,
            step=3,
            previous=0,
            boundary=2,
            source="manual",
            reason="r",
            request=FreezeRequest(id="q", layers=2, who="a", reason="b"),
            outcome="applied",
        ),  # fmt: skip
    ]
    for event in events:
        back = parse_event(event.model_dump_json())
        assert type(back) is type(event) and back == event
    assert layout.num_stages == 2


def test_a_nan_loss_travels_as_none() -> None:
    m = Metrics(rank=0, step=1, epoch=0, samples_consumed=0, loss=float("nan"), lr=0.0,
                samples_per_s=1.0, frozen=0)  # fmt: skip
    assert parse_event(m.model_dump_json()).loss is None


@pytest.mark.parametrize(
    "raw, where",
    [
        ({"kind": "metrics", "rank": 0}, "metrics.step"),
        ({"kind": "nope", "rank": 0}, "kind"),
        ({"kind": "done", "rank": 0, "outcome": "exploded"}, "done.outcome"),
        (
            {
                "kind": "eval",
                "rank": 0,
                "epoch": 1,
                "step": 2,
                "accuracy": 0.5,
                "loss": 0.1,
                "extra": 1,
            },
            "eval.extra",
        ),  # fmt: skip
    ],
)
def test_a_bad_report_names_its_field(raw: dict, where: str) -> None:
    with pytest.raises(BadReport, match=rf"^{where}"):
        parse_event(json.dumps(raw))


def test_freeze_requests_parse_or_say_why_not() -> None:
    ok = read_freeze_request(json.dumps({"id": "q", "layers": 3, "who": "a", "reason": "b"}))
    assert isinstance(ok, FreezeRequest) and ok.layers == 3
    for raw in ("{not json", json.dumps({"id": "q", "layers": "3", "who": "a", "reason": "b"})):
        bad = read_freeze_request(raw)
        assert isinstance(bad, UnreadableRequest) and bad.error
        assert bad.model_dump() == {"raw": raw}  # the audit trail keeps the text, not the error


def test_only_an_explicit_stop_stops() -> None:
    assert Control.read("stop") is Control.STOP
    assert Control.read(None) is Control.RUN and Control.read("pause?") is Control.RUN


def test_metrics_carry_grad_norms_and_older_reports_still_parse() -> None:
    old = {"kind": "metrics", "rank": 1, "generation": 2, "time": 5.0, "step": 3, "epoch": 0,
           "samples_consumed": 96, "loss": 0.5, "lr": 1e-3, "samples_per_s": 100.0, "frozen": 0}  # fmt: skip
    parsed = parse_event(json.dumps(old))  # a worker from before grad_norms existed
    assert isinstance(parsed, Metrics) and parsed.grad_norms is None
    new = Metrics.model_validate(old | {"grad_norms": [0.0, 1.5, float("nan"), None]})
    back = parse_event(new.model_dump_json())
    assert back.grad_norms == [0.0, 1.5, None, None]  # not finite travels as None, like loss
    assert "NaN" not in new.model_dump_json()


def test_started_names_its_log_file_when_it_has_one() -> None:
    fields = {"kind": "started", "rank": 0, "stages": [0], "replica": 0, "pid": 7, "host": "h",
              "node": "h:1", "total_steps": 10}  # fmt: skip
    assert parse_event(json.dumps(fields)).log is None  # an older worker's report
    assert parse_event(json.dumps(fields | {"log": "/w/n0.log"})).log == "/w/n0.log"


METRICS = {"rank": 0, "step": 1, "epoch": 0, "samples_consumed": 0, "loss": 0.5, "lr": 1e-3,
           "samples_per_s": 100.0, "frozen": 0}  # fmt: skip


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"step": -1}, "step"),
        ({"epoch": -1}, "epoch"),
        ({"lr": -1e-3}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"time": float("inf")}, "time"),
        ({"frozen": -1}, "frozen"),
        ({"mfu": -0.1}, "mfu"),
        ({"grad_norms": [1.0, -0.5]}, "grad_norms.1"),
        ({"peak_memory_mib": [-1.0]}, "peak_memory_mib.0"),
    ],
)
def test_metrics_refuse_values_no_step_can_have(bad: dict, field: str) -> None:
    # what the store's own checks refused before it took the protocol's reports
    with pytest.raises(ValidationError, match=rf"(?m)^{re.escape(field)}$"):
        Metrics.model_validate(METRICS | bad)


def test_metrics_read_non_finite_values_as_unknown() -> None:
    nan, inf = float("nan"), float("inf")
    m = Metrics.model_validate(
        METRICS
        | {
            "loss": nan,
            "samples_per_s": inf,
            "mfu": nan,
            "grad_norms": [0.0, inf],
            "peak_memory_mib": [nan, 1.0],
        }  # fmt: skip
    )
    assert (m.loss, m.samples_per_s, m.mfu) == (None, None, None)
    assert (m.grad_norms, m.peak_memory_mib) == ([0.0, None], [None, 1.0])
