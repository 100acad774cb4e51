"""Fixtures for SQL stores.

`db_url` / `store` / `populated_store` are SQLite unless the test module overrides the
`store_backend` fixture: tests/test_store.py makes it `params=STORE_BACKENDS`, so the same tests
run on SQLite and on a real PostgreSQL (tests/fixtures_postgres.py), each in a fresh database.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipetransformer.core.protocol import Metrics
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout, StageLayout, TrainingState
from pipetransformer.store import Store, sqlite_url

STORE_BACKENDS = ("sqlite", "postgresql")
POPULATED_JOB_ID = "vit-digits-3f2a1c"
T0 = 1_700_000_000.0  # fixed unix time so the data is reproducible


@dataclass(frozen=True)
class StoreRun:
    """A store holding one job, as the dashboard and CLI tests see it."""

    store: Store
    db_url: str
    job_id: str


@pytest.fixture
def store_backend() -> str:
    """The database `db_url` points at; override it to run a module on other backends."""
    return "sqlite"


@pytest.fixture
def db_url(store_backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """URL of a fresh, empty database: a SQLite file in tmp_path, or a new PostgreSQL
    database on the session's server."""
    if store_backend == "sqlite":
        return sqlite_url(tmp_path / "store.db")
    if store_backend == "postgresql":
        return request.getfixturevalue("postgres_db_url")
    raise ValueError(f"unknown store backend {store_backend!r}; known: {STORE_BACKENDS}")


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    """A migrated, empty store at `db_url` (SQLite unless `store_backend` says otherwise)."""
    s = Store.open(db_url)
    try:
        yield s
    finally:
        s.close()


def two_stage_layout(version: int = 1, freeze_boundary: int = 0) -> Layout:
    """6 blocks on 2 stages x 1 replica; frozen blocks [0, F) leave the pipeline (F > 0)."""
    start = freeze_boundary
    mid = start + (6 - start + 1) // 2
    return Layout(
        version=version,
        num_blocks=6,
        freeze_boundary=freeze_boundary,
        stages=[
            StageLayout(index=0, start=start, end=mid, ranks=[0]),
            StageLayout(index=1, start=mid, end=6, ranks=[1]),
        ],
        replicas=1,
        microbatches=4,
    )


def packed_layout(version: int, freeze_boundary: int = 5) -> Layout:
    """The active blocks on one pipeline rank, the two ranks as replicas (1x2)."""
    return Layout(
        version=version,
        num_blocks=6,
        freeze_boundary=freeze_boundary,
        stages=[StageLayout(index=0, start=freeze_boundary, end=6, ranks=[0, 1])],
        replicas=2,
        microbatches=4,
    )


def populate(store: Store, job_id: str = POPULATED_JOB_ID) -> None:
    """Fill in one finished job through the Store API, the way the controller would."""
    epochs, steps_per_epoch = 4, 10
    spec = JobSpec.model_validate(
        {
            "name": "vit-digits",
            "model": {"depth": 6},
            "training": {"epochs": epochs, "global_batch_size": 64},
            "parallel": {"stages": 2, "replicas": 1, "microbatches": 4},
        }
    )
    store.create_job(job_id, spec, workdir=f"/tmp/runs/{job_id}")
    store.set_job_state(job_id, "running")
    gen = store.start_generation(job_id, world_size=2)
    store.add_event(job_id, "started", "generation 1 started", data={"world_size": 2})
    store.record_layout(job_id, two_stage_layout(1, 0), reason="initial")
    store.record_layout(job_id, two_stage_layout(2, 2), reason="autofreeze: blocks 0-1 converged")
    store.add_event(job_id, "freeze", "freeze boundary 0 -> 2 (auto)", data={"from": 0, "to": 2})

    rows = []
    for step in range(1, epochs * steps_per_epoch + 1):
        rows.append(
            Metrics(
                rank=0,
                step=step,
                epoch=(step - 1) // steps_per_epoch,
                samples_consumed=0,
                loss=2.3 * math.exp(-step / 15) + 0.1,
                samples_per_s=900.0 + 10 * step,
                lr=3e-3,
                time=T0 + step,
                frozen=2,  # under v2, recorded before the first step
            )
        )
    store.add_metrics(job_id, rows)
    for epoch in range(epochs):
        step = (epoch + 1) * steps_per_epoch
        store.add_evaluation(
            job_id, epoch, step, accuracy=0.6 + 0.1 * epoch, loss=1.0 - 0.2 * epoch, time=T0 + step
        )
    store.add_event(job_id, "eval", "epoch 3: accuracy 0.900", rank=0, data={"accuracy": 0.9})
    store.commit_checkpoint(
        job_id,
        step=epochs * steps_per_epoch,
        epoch=epochs - 1,
        layout_version=2,
        path=f"/tmp/runs/{job_id}/checkpoints/step-{epochs * steps_per_epoch:08d}",
        size_bytes=123_456,
        checksum="sha256:" + "ab" * 32,
        samples_consumed=0,
    )
    store.add_event(job_id, "checkpoint", "committed step 40", rank=0)
    # no freeze boundary here: the job's is that of its latest layout (v2, 2 blocks frozen)
    store.update_progress(
        job_id,
        TrainingState(
            epoch=epochs - 1,
            step=epochs * steps_per_epoch,
            samples_consumed=0,
            lr=3e-3,
            layout_version=2,
        ),
    )
    store.end_generation(job_id, gen, "completed")
    store.add_event(job_id, "done", "training finished", rank=0)
    store.set_job_state(job_id, "completed", "reached 4 epochs")


@pytest.fixture
def populated_store(store: Store, db_url: str) -> StoreRun:
    """A store with one completed job: 2-stage layout of 6 blocks (v1, then v2 with 2 frozen),
    40 metrics rows, 4 evaluations, one committed checkpoint and some events."""
    populate(store)
    return StoreRun(store=store, db_url=db_url, job_id=POPULATED_JOB_ID)
