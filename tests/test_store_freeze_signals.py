"""The store's freeze signals (`Store.add_freeze_signal`, `Store.freeze_signals`, revision
0010), on SQLite and on a real PostgreSQL (tests/fixtures_postgres.py), like
tests/test_store.py: what the freeze policy read at each decision point, one row per step, the
highest generation's kept."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from alembic import command
from sqlalchemy import event, func, inspect, select, text
from sqlalchemy.exc import OperationalError

from pipetransformer.core.protocol import FreezeSignal, Metrics, parse_event
from pipetransformer.core.spec import JobSpec
from pipetransformer.store import FreezeSignalRow, Store, UnknownJob, alembic_config, make_engine
from pipetransformer.store.tables import FreezeSignalRecord
from tests.fixtures_store import STORE_BACKENDS

T0 = 1_700_000_000.0


@pytest.fixture(params=STORE_BACKENDS)
def store_backend(request: pytest.FixtureRequest) -> str:
    """Every test on each backend (overrides tests/fixtures_store.py)."""
    return request.param


def spec() -> JobSpec:
    return JobSpec(name="vit-digits")


def signal(step: int, generation: int = 1, **fields: Any) -> FreezeSignal:
    """Rank 0's reading at the decision point of `step` (4 blocks, the third one unknown)."""
    return FreezeSignal(
        **{
            "rank": 0,
            "generation": generation,
            "time": T0 + step + 0.25,
            "step": step,
            "decision": max(step // 10, 1),
            "boundary": 1,
            "bound": 2,
            "policy": "output",
            "statistic": "output_rate",
            "signal": [0.125, 0.5, None, 2.0],
            "limits": [0.25, 0.25, 0.25, None],
            "probe_s": 0.375,
        }
        | fields
    )


def stored(r: FreezeSignal) -> FreezeSignalRow:
    """The row `r` reads back as."""
    return FreezeSignalRow(
        step=r.step,
        generation=r.generation,
        time=r.time,
        decision=r.decision,
        boundary=r.boundary,
        bound=r.bound,
        policy=r.policy,
        statistic=r.statistic,
        signal=tuple(r.signal),
        limits=tuple(r.limits),
        probe_s=r.probe_s,
    )


def count(store: Store) -> int:
    with store._sessions() as s:
        return s.scalar(select(func.count()).select_from(FreezeSignalRecord))


@pytest.fixture
def job(store: Store) -> Store:
    store.create_job("j", spec(), "/w")
    return store


# --------------------------------------------------------------------------- writes


def test_every_field_round_trips(job: Store) -> None:
    # as the controller gets it: the JSON a worker put in etcd, parsed by the protocol (a
    # non-finite reading travels as null and is stored as NULL)
    raw = signal(
        40,
        generation=3,
        decision=4,
        boundary=2,
        bound=3,
        policy="gradient",
        statistic="gradient_drift",
        signal=[0.0, 1.25, float("nan"), 7.5],
        limits=[1.5, 1.5, 1.5, 1.5],
        probe_s=0.0,
    )
    r = parse_event(raw.model_dump_json())
    assert isinstance(r, FreezeSignal)
    assert job.add_freeze_signal("j", r) is True
    [row] = job.freeze_signals("j")
    assert row == stored(r)
    assert row.signal == (0.0, 1.25, None, 7.5) and row.limits == (1.5,) * 4
    assert (row.policy, row.statistic, row.generation, row.time) == (
        "gradient",
        "gradient_drift",
        3,
        T0 + 40.25,
    )
    assert json.loads(json.dumps(row.model_dump(mode="json")))["signal"] == [0.0, 1.25, None, 7.5]


def test_rows_are_read_by_step(job: Store) -> None:
    for step in (30, 10, 20):
        assert job.add_freeze_signal("j", signal(step))
    assert [r.step for r in job.freeze_signals("j")] == [10, 20, 30]


def test_a_decision_point_is_replaced_only_by_a_higher_generation(job: Store) -> None:
    first = signal(10, generation=2, boundary=1)
    assert job.add_freeze_signal("j", first) is True
    # the same report drained again, or another of the same generation: skipped
    assert job.add_freeze_signal("j", first) is False
    assert job.add_freeze_signal("j", signal(10, generation=2, boundary=3)) is False
    # a late report of an older generation: skipped
    assert job.add_freeze_signal("j", signal(10, generation=1, boundary=3)) is False
    assert job.freeze_signals("j") == [stored(first)]
    # a recovery took the decision point again: the newer reading is the one the job followed
    retaken = signal(10, generation=3, boundary=2, signal=[0.0, 0.0, 0.0, 0.0], probe_s=1.5)
    assert job.add_freeze_signal("j", retaken) is True
    assert job.freeze_signals("j") == [stored(retaken)]
    assert job.add_freeze_signal("j", first) is False  # and the old one stays out
    assert job.freeze_signals("j") == [stored(retaken)]
    assert count(job) == 1
    # another step is another row, whatever its generation
    assert job.add_freeze_signal("j", signal(20, generation=1)) is True
    assert [(r.step, r.generation) for r in job.freeze_signals("j")] == [(10, 3), (20, 1)]


def test_a_report_that_is_not_a_freeze_signal_writes_nothing(job: Store) -> None:
    metrics = Metrics(
        rank=0, step=1, epoch=0, samples_consumed=0, loss=1.0, samples_per_s=1.0, lr=1e-3, frozen=0
    )
    with pytest.raises(TypeError, match="must be a core.protocol.FreezeSignal report, got Metrics"):
        job.add_freeze_signal("j", metrics)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got dict"):
        job.add_freeze_signal("j", signal(10).model_dump())  # type: ignore[arg-type]
    assert job.freeze_signals("j") == []


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("step", -1, r"report\.step"),
        ("decision", 0, r"report\.decision"),
        ("policy", "schedule", r"report\.policy"),
        ("statistic", "loss", r"report\.statistic"),
        ("probe_s", float("inf"), r"report\.probe_s"),
        ("signal", [0.5, -1.0], r"report\.signal\.1"),
    ],
)
def test_a_report_the_protocol_would_refuse_writes_nothing(
    job: Store, field: str, value: Any, message: str
) -> None:
    # pydantic checks a model when it is built, not when a field is set afterwards
    stale = signal(10)
    job.add_freeze_signal("j", stale)
    bad = signal(10, generation=5)
    setattr(bad, field, value)
    with pytest.raises(ValueError, match=message):
        job.add_freeze_signal("j", bad)
    built = FreezeSignal.model_construct(**(signal(20).model_dump() | {field: value}))
    with pytest.raises(ValueError, match=message):
        job.add_freeze_signal("j", built)
    assert job.freeze_signals("j") == [stored(stale)]  # not replaced, nothing added


def test_unknown_job_is_refused_by_writes_and_reads(job: Store) -> None:
    with pytest.raises(UnknownJob, match="'nope'") as err:
        job.add_freeze_signal("nope", signal(10))
    assert "j" in str(err.value)
    with pytest.raises(UnknownJob, match="'nope'"):
        job.freeze_signals("nope")
    assert count(job) == 0


def test_a_job_without_signals_reads_none(job: Store) -> None:
    assert job.freeze_signals("j") == []


def test_deleting_a_job_deletes_its_signals(job: Store) -> None:
    job.create_job("other", spec(), "/w")
    job.add_freeze_signal("j", signal(10))
    job.add_freeze_signal("j", signal(20))
    job.add_freeze_signal("other", signal(10))
    job.delete_job("j")
    with job._sessions() as s:
        assert s.scalars(select(FreezeSignalRecord.job_id)).all() == ["other"]


def lost_connection() -> OperationalError:
    return OperationalError(
        "COMMIT",
        {},
        Exception("server closed the connection unexpectedly"),
        connection_invalidated=True,
    )


@pytest.mark.parametrize("replacing", [False, True])
def test_a_retry_after_a_lost_commit_ack_says_it_was_stored(
    job: Store, caplog: pytest.LogCaptureFixture, replacing: bool
) -> None:
    # The first try commits, then its acknowledgement is lost: the retry finds its own row.
    if replacing:
        job.add_freeze_signal("j", signal(10, generation=1))
    armed = True

    def lose_ack(_session: Any) -> None:
        nonlocal armed
        if armed:
            armed = False
            raise lost_connection()

    r = signal(10, generation=2)
    event.listen(job._sessions, "after_commit", lose_ack)
    try:
        with caplog.at_level(logging.WARNING, logger="store"):
            assert job.add_freeze_signal("j", r) is True
    finally:
        event.remove(job._sessions, "after_commit", lose_ack)
    assert not armed
    assert any("add_freeze_signal" in rec.getMessage() for rec in caplog.records)
    assert job.freeze_signals("j") == [stored(r)]
    assert job.add_freeze_signal("j", r) is False  # a new call, not a retry: nothing is new


def test_a_read_only_store_reads_them(job: Store, db_url: str) -> None:
    job.add_freeze_signal("j", signal(10))
    reader = Store(db_url, read_only=True)
    try:
        assert reader.freeze_signals("j") == job.freeze_signals("j")
        with pytest.raises(PermissionError):
            reader.add_freeze_signal("j", signal(20))
    finally:
        reader.close()


# --------------------------------------------------------------------------- migration


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_0010_adds_the_freeze_signals_table(db_url: str) -> None:
    with Store.open(db_url, migrate=False) as s:
        s.migrate("0009")
        s.create_job("old", spec(), "/w")
        assert "freeze_signals" not in tables(db_url)
        s.migrate("0010")
        assert s.revision() == "0010"
        assert s.freeze_signals("old") == []  # a job from before: nothing to read, no error
        assert s.add_freeze_signal("old", signal(10))
        assert s.add_freeze_signal("old", signal(10, generation=2))
        assert [r.generation for r in s.freeze_signals("old")] == [2]
        command.check(alembic_config(url=db_url))  # the models are the migrated schema
        command.downgrade(alembic_config(url=db_url), "0009")
        assert s.revision() == "0009"
        assert "freeze_signals" not in tables(db_url)
        assert "stage_times" in tables(db_url)  # the rest stays
        with s._engine.connect() as conn:
            assert conn.execute(text("SELECT id FROM jobs")).scalars().all() == ["old"]
        s.migrate()
        assert s.freeze_signals("old") == []  # the table is back, empty
        assert s.add_freeze_signal("old", signal(10))
    command.check(alembic_config(url=db_url))
