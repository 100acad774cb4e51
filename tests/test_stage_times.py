"""Where a rank's time goes: the phase arithmetic (core/stage_times.py), the clock that measures
it (trainer/stage_clock.py) and the report that carries it (core.protocol.StageTimes)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import pytest
import torch
from pydantic import ValidationError

from pipetransformer.core.protocol import BadReport, StageTimes, parse_event
from pipetransformer.core.stage_times import (
    PHASES,
    PhaseSeconds,
    measured_bubble,
    per_rank,
    pipeline_reading,
    theoretical_bubble,
)
from pipetransformer.trainer.stage_clock import StageClock


def test_theoretical_bubble_follows_the_schedules_formulas() -> None:
    assert theoretical_bubble("gpipe", 1, 4) == 0.0
    assert theoretical_bubble("gpipe", 2, 4) == pytest.approx(1 / 5)
    assert theoretical_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    # interleaving divides the bubble by the stages per rank
    assert theoretical_bubble("interleaved-1f1b", 4, 8, virtual=2) == pytest.approx(3 / 19)
    assert theoretical_bubble("zbv", 2, 4, virtual=2) is None
    with pytest.raises(ValueError, match="microbatches"):
        theoretical_bubble("gpipe", 2, 0)


def test_phase_seconds_refuse_negative_and_nan() -> None:
    with pytest.raises(ValidationError, match="forward"):
        PhaseSeconds(forward=-1.0)
    with pytest.raises(ValidationError, match="pipeline_wait"):
        PhaseSeconds(pipeline_wait=float("nan"))
    s = PhaseSeconds(forward=1.0, backward=2.0, pipeline_wait=1.0)
    assert s.total() == 4.0 and s.compute() == 3.0
    assert measured_bubble(s) == pytest.approx(0.25)
    assert measured_bubble(PhaseSeconds(data_wait=1.0)) is None


@dataclass(frozen=True)
class _Interval:
    rank: int
    from_step: int
    to_step: int
    layout_version: int
    stages: tuple[int, ...]
    replica: int
    wall_s: float
    seconds: PhaseSeconds


def test_per_rank_sums_a_layouts_intervals_and_names_the_slowest_stage() -> None:
    def row(rank: int, step: int, version: int, stage: int, fwd: float, wait: float) -> _Interval:
        s = PhaseSeconds(forward=fwd, backward=2 * fwd, pipeline_wait=wait)
        return _Interval(rank, step - 10, step, version, (stage,), 0, s.total(), s)

    rows = [
        row(0, 10, 1, 0, 0.1, 0.5),  # an older layout: left out
        row(0, 20, 2, 0, 0.2, 0.3),
        row(1, 20, 2, 1, 0.4, 0.0),
        row(0, 30, 2, 0, 0.2, 0.3),
        row(1, 30, 2, 1, 0.4, 0.0),
    ]
    ranks = per_rank(rows)
    assert [r.rank for r in ranks] == [0, 1]
    assert ranks[0].intervals == 2 and ranks[0].steps == 20 and ranks[0].layout_version == 2
    assert ranks[0].seconds.forward == pytest.approx(0.4)
    assert ranks[0].bubble == pytest.approx(0.6 / (1.2 + 0.6))
    reading = pipeline_reading(ranks, "gpipe", 2, 4, 1)
    assert reading is not None
    assert reading.slowest_stages == (1,)
    assert reading.slowest_compute_s == pytest.approx(2 * 1.2 / 20)  # per step
    assert reading.theory == pytest.approx(1 / 5)
    assert "slowest stage 1" in reading.text() and "layout v2" in reading.text()
    assert per_rank([], None) == [] and pipeline_reading([], "gpipe", 1, 1, 1) is None
    assert [r.layout_version for r in per_rank(rows, 1)] == [1]


def test_the_report_round_trips_and_bad_ones_are_named() -> None:
    report = StageTimes(
        rank=3,
        from_step=10,
        to_step=20,
        layout_version=2,
        stages=[1],
        replica=1,
        wall_s=2.0,
        seconds=PhaseSeconds(forward=0.5, backward=1.0, pipeline_wait=0.25, other=0.25),
    )
    assert parse_event(report.model_dump_json()) == report
    raw = report.model_dump(mode="json")
    raw["seconds"]["backward"] = -1
    with pytest.raises(BadReport, match="seconds.backward"):
        parse_event(json.dumps(raw))


class _Stage:
    """What the clock wraps: a PipelineStage's per-micro-batch methods."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.calls = 0

    def forward_one_chunk(self, i: int) -> int:
        self.calls += 1
        time.sleep(self.seconds)
        return i

    def backward_one_chunk(self, i: int) -> int:
        self.calls += 1
        time.sleep(2 * self.seconds)
        return i


def test_the_clock_splits_the_schedule_into_compute_and_wait() -> None:
    clock = StageClock(torch.device("cpu"))
    stage = _Stage(0.01)
    clock.wrap_stages([stage])
    clock.wrap_stages([stage])  # wrapping twice times once
    with clock.measure("data_wait"):
        time.sleep(0.02)
    with clock.schedule():
        for i in range(2):
            stage.forward_one_chunk(i)
        time.sleep(0.03)  # the schedule waiting on a neighbour
        for i in range(2):
            stage.backward_one_chunk(i)
    stage.forward_one_chunk(9)  # outside the schedule (evaluation): not forward
    time.sleep(0.01)
    seconds, wall = clock.take()
    # sleeps last at least what they ask; the upper bounds allow a loaded 2-core machine
    assert 0.02 <= seconds.forward < 0.2
    assert 0.04 <= seconds.backward < 0.4
    assert 0.03 <= seconds.pipeline_wait < 0.3
    assert 0.02 <= seconds.data_wait < 0.2
    assert seconds.other >= 0.01  # the call outside the schedule and the sleep after it
    assert seconds.total() == pytest.approx(wall)  # every second is in some phase
    assert stage.calls == 5
    # take() began a new interval
    again, wall2 = clock.take()
    assert again.forward == 0.0 and wall2 < wall


def test_a_clock_that_is_off_measures_nothing() -> None:
    clock = StageClock(torch.device("cpu"), enabled=False)
    stage = _Stage(0.0)
    clock.wrap_stages([stage])
    assert not hasattr(stage.forward_one_chunk, "_stage_clock")
    with clock.schedule():
        stage.forward_one_chunk(0)
    seconds, _ = clock.take()
    assert all(getattr(seconds, p) == 0.0 for p in PHASES if p != "other")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_clock_times_the_device_work_with_events() -> None:
    """Device phases are timed by CUDA events (queued work, not the host's launch time); a
    traced step's spans sit on one time axis from the trace's start."""
    device = torch.device("cuda", 0)
    clock = StageClock(device)
    assert clock.clock == "cuda"
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    clock.restart()
    clock.begin_trace()
    with clock.schedule():
        for i in range(3):
            with clock.measure("forward", stage=0, microbatch=i):
                b = a @ a
    with clock.measure("optimizer"):
        b.add_(1.0)
    started, spans = clock.end_trace()
    seconds, wall = clock.take()
    assert seconds.forward > 0 and seconds.optimizer > 0
    assert seconds.total() == pytest.approx(wall, rel=1e-6)
    forwards = [s for s in spans if s.phase == "forward"]
    assert [s.microbatch for s in forwards] == [0, 1, 2]
    # queued one after the other on the stream: each starts after the previous ended
    assert all(x.end_s <= y.start_s + 1e-4 for x, y in zip(forwards, forwards[1:], strict=False))
    assert abs(started - time.time()) < 60
