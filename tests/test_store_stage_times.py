"""The store's stage times (`Store.add_stage_times`, `Store.stage_times`, revision 0009), on
SQLite and on a real PostgreSQL (tests/fixtures_postgres.py), like tests/test_store.py."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from alembic import command
from sqlalchemy import event, func, inspect, select, text
from sqlalchemy.exc import OperationalError

from pipetransformer.core.protocol import Metrics, StageTimes
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.stage_times import PHASES, PhaseSeconds, per_rank
from pipetransformer.store import StageTimesRow, Store, UnknownJob, alembic_config, make_engine
from pipetransformer.store.tables import StageTime
from tests.fixtures_store import STORE_BACKENDS

T0 = 1_700_000_000.0


@pytest.fixture(params=STORE_BACKENDS)
def store_backend(request: pytest.FixtureRequest) -> str:
    """Every test on each backend (overrides tests/fixtures_store.py)."""
    return request.param


def spec() -> JobSpec:
    return JobSpec(name="vit-digits")


def seconds(scale: float = 1.0) -> PhaseSeconds:
    """A different, exactly representable value in every phase."""
    return PhaseSeconds(**{p: scale * (i + 1) / 8 for i, p in enumerate(PHASES)})


def report(rank: int, to_step: int, generation: int = 1, **fields: Any) -> StageTimes:
    """Rank `rank`'s report of the interval ending at `to_step` (10 steps long)."""
    return StageTimes(
        **{
            "rank": rank,
            "generation": generation,
            "time": T0 + to_step + 0.25,
            "from_step": max(to_step - 10, 0),
            "to_step": to_step,
            "layout_version": 1,
            "stages": [rank],
            "replica": 0,
            "wall_s": 2.5,
            "seconds": seconds(),
        }
        | fields
    )


def stored(r: StageTimes) -> StageTimesRow:
    """The row `r` reads back as."""
    return StageTimesRow(
        generation=r.generation,
        rank=r.rank,
        time=r.time,
        from_step=r.from_step,
        to_step=r.to_step,
        layout_version=r.layout_version,
        stages=tuple(r.stages),
        replica=r.replica,
        wall_s=r.wall_s,
        seconds=r.seconds,
        clock=r.clock,
    )


def keys(rows: list[StageTimesRow]) -> list[tuple[int, int, int]]:
    return [(r.to_step, r.rank, r.generation) for r in rows]


@pytest.fixture
def job(store: Store) -> Store:
    store.create_job("j", spec(), "/w")
    return store


# --------------------------------------------------------------------------- writes


def test_every_field_round_trips(job: Store) -> None:
    r = report(
        3,
        40,
        generation=2,
        from_step=30,
        layout_version=4,
        stages=[2, 5],
        replica=1,
        wall_s=7.125,
        seconds=seconds(3.0),
        clock="cuda",
    )
    assert job.add_stage_times("j", [r]) == 1
    [row] = job.stage_times("j")
    assert row == stored(r)
    assert row.seconds == r.seconds and row.seconds.total() == r.seconds.total()
    assert row.stages == (2, 5) and row.clock == "cuda" and row.time == T0 + 40.25
    assert json.loads(json.dumps(row.model_dump(mode="json")))["seconds"] == r.seconds.model_dump()


def test_phase_columns_are_the_phases() -> None:
    columns = {c.name for c in StageTime.__table__.columns}
    assert {c for c in columns if c.endswith("_s") and c != "wall_s"} == {f"{p}_s" for p in PHASES}


def test_adding_again_stores_nothing_twice(job: Store) -> None:
    assert job.add_stage_times("j", [report(0, 10), report(1, 10)]) == 2
    assert job.add_stage_times("j", [report(0, 10), report(1, 10)]) == 0
    # overlapping, with a repeat inside the batch: only (rank 0, step 20) is new, first one stands
    again = [report(1, 10, wall_s=9.0), report(0, 20), report(0, 20, wall_s=9.0)]
    assert job.add_stage_times("j", again) == 1
    rows = job.stage_times("j")
    assert keys(rows) == [(10, 0, 1), (10, 1, 1), (20, 0, 1)]
    assert [r.wall_s for r in rows] == [2.5, 2.5, 2.5]
    assert job.add_stage_times("j", []) == 0
    # the same interval of a later generation is another row (a restart repeats steps)
    assert job.add_stage_times("j", [report(0, 10, generation=2)]) == 1
    with job._sessions() as s:
        assert s.scalar(select(func.count()).select_from(StageTime)) == 4


def test_rows_are_ordered_by_step_rank_then_generation(job: Store) -> None:
    reports = [
        report(1, 20, generation=2),
        report(0, 20, generation=2),
        report(1, 10),
        report(0, 20),
        report(1, 20),
        report(0, 10),
    ]
    assert job.add_stage_times("j", reports) == 6
    assert keys(job.stage_times("j")) == [
        (10, 0, 1),
        (10, 1, 1),
        (20, 0, 1),
        (20, 0, 2),
        (20, 1, 1),
        (20, 1, 2),
    ]


def test_bad_items_name_their_index_and_write_nothing(job: Store) -> None:
    metrics = Metrics(
        rank=0, step=1, epoch=0, samples_consumed=0, loss=1.0, samples_per_s=1.0, lr=1e-3, frozen=0
    )
    with pytest.raises(TypeError, match=r"reports\[1\] must be a core.protocol.StageTimes"):
        job.add_stage_times("j", [report(0, 10), metrics])  # type: ignore[list-item]
    assert job.stage_times("j") == []


def test_unknown_job_is_refused_by_writes_and_reads(job: Store) -> None:
    with pytest.raises(UnknownJob, match="'nope'") as err:
        job.add_stage_times("nope", [report(0, 10)])
    assert "j" in str(err.value)  # names the jobs there are, like every read
    with pytest.raises(UnknownJob, match="'nope'"):
        job.add_stage_times("nope", [])
    with pytest.raises(UnknownJob, match="'nope'"):
        job.stage_times("nope")


def test_deleting_a_job_deletes_its_stage_times(job: Store) -> None:
    job.create_job("other", spec(), "/w")
    job.add_stage_times("j", [report(0, 10), report(1, 10)])
    job.add_stage_times("other", [report(0, 10)])
    job.delete_job("j")
    with job._sessions() as s:
        assert s.scalars(select(StageTime.job_id)).all() == ["other"]


def lost_connection() -> OperationalError:
    return OperationalError(
        "COMMIT",
        {},
        Exception("server closed the connection unexpectedly"),
        connection_invalidated=True,
    )


def test_a_retry_after_a_lost_commit_ack_lands_once(
    job: Store, caplog: pytest.LogCaptureFixture
) -> None:
    # The first try commits, then its acknowledgement is lost: the retry finds its own rows.
    armed = True

    def lose_ack(_session: Any) -> None:
        nonlocal armed
        if armed:
            armed = False
            raise lost_connection()

    job.add_stage_times("j", [report(0, 10)])  # stored before: not this call's
    event.listen(job._sessions, "after_commit", lose_ack)
    try:
        with caplog.at_level(logging.WARNING, logger="store"):
            batch = [report(0, 10), report(0, 20), report(1, 20), report(1, 20)]
            assert job.add_stage_times("j", batch) == 2
    finally:
        event.remove(job._sessions, "after_commit", lose_ack)
    assert not armed
    assert any("add_stage_times" in r.getMessage() for r in caplog.records)
    assert keys(job.stage_times("j")) == [(10, 0, 1), (20, 0, 1), (20, 1, 1)]
    assert job.add_stage_times("j", batch) == 0  # a new call, not a retry: nothing is new


# --------------------------------------------------------------------------- reads


@pytest.fixture
def intervals(job: Store) -> Store:
    """Two ranks' intervals ending at steps 10, 20, 30 and 40 (rank 1 missed step 30)."""
    reports = [report(r, step) for step in (10, 20, 30, 40) for r in (0, 1)]
    job.add_stage_times("j", [r for r in reports if (r.rank, r.to_step) != (1, 30)])
    return job


def test_since_step_reads_the_intervals_that_end_after_it(intervals: Store) -> None:
    assert keys(intervals.stage_times("j", since_step=20)) == [
        (30, 0, 1),
        (40, 0, 1),
        (40, 1, 1),
    ]
    assert keys(intervals.stage_times("j", since_step=25)) == keys(
        intervals.stage_times("j", since_step=20)
    )
    assert intervals.stage_times("j", since_step=0) == intervals.stage_times("j")
    assert intervals.stage_times("j", since_step=40) == []


def test_last_intervals_reads_the_newest_distinct_steps(intervals: Store) -> None:
    everything = intervals.stage_times("j")
    assert len(everything) == 7
    assert keys(intervals.stage_times("j", last_intervals=1)) == [(40, 0, 1), (40, 1, 1)]
    # every rank's row of each of the newest two steps (30 has one row only)
    assert keys(intervals.stage_times("j", last_intervals=2)) == [
        (30, 0, 1),
        (40, 0, 1),
        (40, 1, 1),
    ]
    assert intervals.stage_times("j", last_intervals=3) == everything[2:]
    assert intervals.stage_times("j", last_intervals=99) == everything
    # both: the rows that pass both
    assert keys(intervals.stage_times("j", since_step=30, last_intervals=3)) == [
        (40, 0, 1),
        (40, 1, 1),
    ]
    assert keys(intervals.stage_times("j", since_step=10, last_intervals=2)) == keys(
        intervals.stage_times("j", last_intervals=2)
    )


def test_a_job_without_stage_times_reads_none(job: Store) -> None:
    assert job.stage_times("j") == []
    assert job.stage_times("j", last_intervals=3) == []
    assert job.stage_times("j", since_step=5, last_intervals=1) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"since_step": -1}, "since_step must be an integer >= 0"),
        ({"since_step": 1.5}, "since_step must be an integer >= 0"),
        ({"last_intervals": 0}, "last_intervals must be an integer >= 1"),
        ({"last_intervals": True}, "last_intervals must be an integer >= 1"),
        ({"last_intervals": "3"}, "last_intervals must be an integer >= 1"),
    ],
)
def test_bad_read_arguments_are_named(job: Store, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        job.stage_times("j", **kwargs)


def test_a_read_only_store_reads_them(intervals: Store, db_url: str) -> None:
    reader = Store(db_url, read_only=True)
    try:
        assert reader.stage_times("j", last_intervals=1) == intervals.stage_times(
            "j", last_intervals=1
        )
        with pytest.raises(PermissionError):
            reader.add_stage_times("j", [report(0, 50)])
    finally:
        reader.close()


def test_rows_are_what_the_readings_take(job: Store) -> None:
    job.add_stage_times(
        "j",
        [report(0, 10), report(0, 20), report(1, 10, layout_version=2)],
    )
    [rank0] = per_rank(job.stage_times("j"), layout_version=1)
    assert (rank0.rank, rank0.intervals, rank0.wall_s) == (0, 2, 5.0)
    assert rank0.seconds == seconds(2.0)


# --------------------------------------------------------------------------- migration


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_0009_adds_the_stage_times_table(db_url: str) -> None:
    with Store.open(db_url, migrate=False) as s:
        s.migrate("0008")
        s.create_job("old", spec(), "/w")
        assert "stage_times" not in tables(db_url)
        s.migrate("0009")
        assert s.revision() == "0009"
        assert s.add_stage_times("old", [report(0, 10), report(1, 10)]) == 2
        # (`alembic check` only at the head: the models are the newest revision's schema)
        command.downgrade(alembic_config(url=db_url), "0008")
        assert "stage_times" not in tables(db_url)
        assert [j.id for j in s.list_jobs()] == ["old"]  # the rest stays
        with s._engine.connect() as conn:
            assert conn.execute(text("SELECT id FROM jobs")).scalars().all() == ["old"]
        s.migrate()
        assert s.stage_times("old") == []  # the table is back, empty
        assert s.add_stage_times("old", [report(0, 10)]) == 1
    command.check(alembic_config(url=db_url))
