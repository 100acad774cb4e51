"""A real training run through the `pipetransformer` CLI, shared by the end-to-end and dashboard
tests (one run per session; tests that write get their own copy of its store)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipetransformer.store import Store, sqlite_url
from tests.fixtures_store import StoreRun

REPO = Path(__file__).resolve().parents[1]

TINY_SPEC: dict[str, Any] = {
    "name": "tiny",
    "model": {"depth": 2, "dim": 32, "heads": 4, "mlp_ratio": 2.0},
    "data": {"dataset": "digits"},
    "training": {"epochs": 2, "global_batch_size": 64, "lr": 0.003, "warmup_steps": 5},
    "parallel": {"stages": 2, "microbatches": 4},
    "checkpoint": {"every_epochs": 1, "keep": 3},
}
STEPS_PER_EPOCH = 23  # ceil(1437 training digits / 64)


def write_spec(path: Path, **sections: dict[str, Any]) -> Path:
    spec = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY_SPEC.items()}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(spec))
    return path


def cli(*args: str, timeout: float = 240, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run the `pipetransformer` CLI as a user would, in a fresh process."""
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-m", "pipetransformer.orchestrator.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )
    return proc


def start_cli(*args: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "COLUMNS": "200"}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pipetransformer.orchestrator.cli", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_for(pred: Callable[[], Any], timeout: float, what: str, log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    detail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{detail}")


def store_probe(
    db: Path | str, job_id: str, read: Callable[[Store, str], Any]
) -> Callable[[], Any]:
    """For `wait_for`: `read(store, job_id)` once a run's store (an SQLite file, or a database
    URL) exists and holds the job, else None (it may exist before its migrations have run)."""

    def check() -> Any:
        if isinstance(db, Path) and not db.exists():
            return None
        store = Store.open(sqlite_url(db) if isinstance(db, Path) else db, migrate=False)
        try:
            if store.revision() is None or not store.list_jobs():
                return None
            return read(store, job_id)
        finally:
            store.close()

    return check


@dataclass(frozen=True)
class RealRun:
    workdir: Path
    db_url: str
    job_id: str
    result: subprocess.CompletedProcess[str]

    def store(self) -> Store:
        return Store.open(self.db_url, migrate=False)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> RealRun:
    root = tmp_path_factory.mktemp("trained")
    spec = write_spec(root / "tiny.yaml")
    workdir = root / "runs"
    result = cli("run", str(spec), "--workdir", str(workdir), "--job-id", "tiny-e2e")
    assert result.returncode == 0, f"run failed:\n{result.stdout}\n{result.stderr}"
    return RealRun(workdir, sqlite_url(workdir / "store.db"), "tiny-e2e", result)


@pytest.fixture
def finished_run(trained_run: RealRun, tmp_path: Path) -> Iterator[StoreRun]:
    """A private copy of the real run's store (tests may write to it)."""
    target = tmp_path / "store.db"
    src = sqlite3.connect(trained_run.workdir / "store.db")
    dst = sqlite3.connect(target)
    with dst:
        src.backup(dst)  # consistent copy, WAL included
    src.close()
    dst.close()
    url = sqlite_url(target)
    store = Store.open(url, migrate=False)
    try:
        yield StoreRun(store, url, trained_run.job_id)
    finally:
        store.close()


def probe(workdir: Path, job_id: str, read):  # noqa: ANN001, ANN201
    """`store_probe` of the store a `pipetransformer run --workdir workdir` keeps."""
    return store_probe(workdir / "store.db", job_id, read)


def workers_of(store: Store, job_id: str) -> dict[int, dict]:
    """rank -> `worker_started` data of the newest generation's workers (those started since
    its `generation_started`)."""
    out: dict[int, dict] = {}
    for e in reversed(store.events(job_id, limit=1000)):  # oldest first
        if e.kind == "generation_started":
            out = {}
        elif e.kind == "worker_started":
            out[e.rank] = e.data
    return out


def running_after_checkpoint(
    workdir: Path, job_id: str, log: Path, world: int = 2
) -> tuple[int, dict[int, dict]]:
    """Wait until the job has committed a checkpoint and a generation of `world` workers runs,
    all of them started; return that generation's number and its workers (with min_nodes 1 a
    node late for a round joins at the next, so an earlier generation may be narrower)."""

    def ready(store: Store, job: str) -> tuple[int, dict[int, dict]] | None:
        gens = store.generations(job)
        if not gens or gens[-1].state != "running" or gens[-1].world_size != world:
            return None
        workers = workers_of(store, job)
        if store.latest_checkpoint(job) is None or sorted(workers) != list(range(world)):
            return None
        return gens[-1].number, workers

    return wait_for(probe(workdir, job_id, ready), 150, f"a checkpoint and {world} workers", log)


def finish(proc, log: Path, timeout: float = 240) -> None:  # noqa: ANN001
    """Wait for a `start_cli` process to end; it must succeed (else its log's tail)."""
    try:
        code = proc.wait(timeout=timeout)
    finally:
        proc.kill()
    assert code == 0, log.read_text(errors="replace")[-4000:]


def run_job(tmp_path: Path, name: str, spec: dict[str, Any]) -> tuple[Store, str]:
    """`pipetransformer run` of `spec` named `name`, in `tmp_path/name`, to its successful end:
    the job's store and what `run` printed (its end-of-run summary)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**spec, "name": name}))
    res = cli("run", str(path), "--workdir", str(tmp_path / name), "--job-id", name, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return Store.open(sqlite_url(tmp_path / name / "store.db"), migrate=False), res.stdout
