"""`core.recoveries`: a job's recoveries read back from its stored events and steps (each step
stored once, the first time it trained), on hand-made histories."""

from __future__ import annotations

from types import SimpleNamespace

from pipetransformer.core.recoveries import ABORTED, STARTED, Recovery, recoveries


def _event(time: float, kind: str, **data: object) -> SimpleNamespace:
    return SimpleNamespace(time=time, kind=kind, data=data)


def _steps(first: int, last: int, t0: float, dt: float = 1.0) -> list[SimpleNamespace]:
    return [SimpleNamespace(step=s, time=t0 + (s - first) * dt) for s in range(first, last + 1)]


def _started(time: float, generation: int, step: int, checkpoint: str | None) -> SimpleNamespace:
    return _event(
        time, STARTED, generation=generation, start={"step": step, "checkpoint": checkpoint}
    )


def test_a_worker_lost_and_the_generation_that_resumed() -> None:
    """Steps 1-163 (one a second from t=100), rank 1 lost at t=263.5, generation 2 from the
    checkpoint at step 161 at t=270: steps 162-163 trained again (not stored twice), step 164
    at t=275. 2 steps redone, 13 s from step 163 to step 164."""
    steps = _steps(1, 163, 101.0) + [SimpleNamespace(step=164, time=276.0)]
    events = [
        _started(100.0, 1, 0, None),
        _event(263.5, ABORTED, generation=1, reason="rank 1 (pid 7) killed by signal 9 (SIGKILL)"),
        _started(270.0, 2, 161, "/ck/step-00000161"),
        _event(264.0, "worker_died", rank=1),  # other kinds are ignored, in any order
    ]
    (found,) = recoveries(events, steps)
    assert found == Recovery(
        generation=1,
        failed_at=263.5,
        reason="rank 1 (pid 7) killed by signal 9 (SIGKILL)",
        resumed_generation=2,
        resumed_from_step=161,
        from_checkpoint=True,
        steps_redone=2,
        seconds_lost=13.0,
    )
    assert found.text() == (
        "generation 1: rank 1 (pid 7) killed by signal 9 (SIGKILL); generation 2 resumed from "
        "the checkpoint at step 161 (2 steps redone), 13.0 s without a new step"
    )


def test_no_failure_no_recovery_and_one_not_resumed_yet() -> None:
    steps = _steps(1, 20, 1.0)
    assert recoveries([_started(0.0, 1, 0, None)], steps) == []
    events = [
        _started(0.0, 1, 0, None),
        _event(10.5, ABORTED, generation=1, reason="node a left"),
        _event(12.0, ABORTED, generation=2, reason="re-formed by the agents"),
        _started(15.0, 3, 0, None),
        _event(30.0, ABORTED, generation=3, reason="rank 0 lost its lease"),
    ]
    first, second, third = recoveries(events, _steps(1, 10, 1.0) + _steps(1, 25, 16.0)[10:])
    assert first.resumed_from_step is None and first.text().endswith("; not resumed")
    # from scratch: every step before the failure is trained again
    assert (second.resumed_generation, second.steps_redone, second.from_checkpoint) == (
        3,
        10,
        False,
    )
    assert second.seconds_lost == 26.0 - 10.0  # step 10 at t=10, step 11 at t=26
    assert "generation 3 resumed from scratch (10 steps redone)" in second.text()
    assert third.resumed_from_step is None and third.reason == "rank 0 lost its lease"
    # a generation's final explanation replaces the reason its abort was recorded with
    (refined,) = recoveries(events[:2], _steps(1, 10, 1.0), {1: "node a left: rank 1 exited 0"})
    assert refined.reason == "node a left: rank 1 exited 0"
