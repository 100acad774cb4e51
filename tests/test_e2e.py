"""End to end through the CLI: a real job (embedded etcd, SQLite, torchrun workers over gloo)
trains, is recorded in the store, and resumes after Ctrl-C or a SIGKILL."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest

from pipetransformer.edge.manifest import verify_checkpoint
from pipetransformer.store import Store, sqlite_url
from tests.fixtures_run import (
    STEPS_PER_EPOCH,
    RealRun,
    cli,
    start_cli,
    store_probe,
    wait_for,
    write_spec,
)

pytestmark = pytest.mark.slow

# Signal tests need the job still running when the signal lands, well after its first
# checkpoint, even on a loaded machine: give them room.
SIGNAL_EPOCHS = 6
# what `status` and the summary say of TINY_SPEC's model and data (1438 + 359 digits, the stratified split)
BUILT_IN = (
    "seeded vit, 2 blocks of dim 32, 10 classes on built-in digits, 1,438 train / 359 held-out rows"
)


def test_run_records_job_layout_metrics_and_checkpoint(trained_run: RealRun) -> None:
    out = trained_run.result.stdout
    assert re.search(r"held-out +acc \d", out) and "pipetransformer dashboard" in out
    assert BUILT_IN in out  # where the model and the data came from, in one line
    store = trained_run.store()
    job = store.get_job(trained_run.job_id)
    assert job.state == "completed"
    assert (job.epoch, job.step) == (2, 2 * STEPS_PER_EPOCH)

    layout = store.current_layout(job.id)
    assert [(s.start, s.end, s.ranks) for s in layout.stages] == [(0, 1, [0]), (1, 2, [1])]

    steps = [m.step for m in store.metrics(job.id)]
    assert steps == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    assert all(m.loss > 0 and m.samples_per_s > 0 for m in store.metrics(job.id))

    evals = store.evaluations(job.id)
    assert [e.epoch for e in evals] == [1, 2]
    assert all(0.0 <= e.accuracy <= 1.0 for e in evals)
    assert job.accuracy == evals[-1].accuracy

    ckpts = store.checkpoints(job.id)
    assert [c.step for c in ckpts] == [2 * STEPS_PER_EPOCH, STEPS_PER_EPOCH]
    for c in ckpts:
        assert verify_checkpoint(c.path, c.checksum) == c.size_bytes > 0

    kinds = [e.kind for e in store.events(job.id)]
    assert kinds.count("worker_started") == 2 and "job_completed" in kinds
    assert kinds.count("data_opened") == 1  # rank 0's DataOpened, once per generation
    assert [g.state for g in store.generations(job.id)] == ["completed"]


def test_status_json_reports_accuracy(trained_run: RealRun) -> None:
    res = cli("status", "--json", "--workdir", str(trained_run.workdir))
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert status["id"] == trained_run.job_id and status["state"] == "completed"
    assert 0.0 <= status["accuracy"] <= 1.0
    assert status["layout"]["stages"][0]["ranks"] == [0]
    # the table a person reads names the last committed checkpoint, as the JSON does
    table = cli("status", "--workdir", str(trained_run.workdir))
    assert table.returncode == 0 and status["checkpoint"]["path"] in table.stdout, table.stdout
    assert BUILT_IN in table.stdout  # the seeded model and the built-in data, rows reported

    res = cli("status", "no-such-job", "--workdir", str(trained_run.workdir))
    assert res.returncode == 2
    assert "no-such-job" in res.stderr and trained_run.job_id in res.stderr


def test_resume_refuses_a_completed_job(trained_run: RealRun) -> None:
    res = cli("resume", trained_run.job_id, "--workdir", str(trained_run.workdir))
    assert res.returncode == 2 and "already completed" in res.stderr


def _first_checkpoint(db: Path, job_id: str):
    return store_probe(db, job_id, lambda store, job: store.latest_checkpoint(job))


def _resume_and_check(workdir: Path, job_id: str, resumed_from: int, total: int) -> Store:
    res = cli("resume", job_id, "--workdir", str(workdir))
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert f"step {resumed_from}" in res.stdout
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    job = store.get_job(job_id)
    assert job.state == "completed" and job.step == total
    steps = [m.step for m in store.metrics(job_id)]
    assert steps == list(range(1, total + 1)), "every step recorded exactly once"
    gens = store.generations(job_id)
    assert [g.state for g in gens][-1] == "completed" and len(gens) == 2
    return store


def test_ctrl_c_checkpoints_and_resume_finishes(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", training={"epochs": SIGNAL_EPOCHS})
    workdir, log = tmp_path / "runs", tmp_path / "run.log"
    proc = start_cli("run", str(spec), "--workdir", str(workdir), "--job-id", "ctrlc", log=log)
    try:
        wait_for(_first_checkpoint(workdir / "store.db", "ctrlc"), 120, "a checkpoint", log)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, log.read_text()
    finally:
        proc.kill()
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    job = store.get_job("ctrlc")
    assert job.state == "interrupted"
    stopped_at = store.latest_checkpoint("ctrlc").step
    assert stopped_at == job.step, "a graceful stop checkpoints the step it stopped at"
    assert stopped_at < SIGNAL_EPOCHS * STEPS_PER_EPOCH
    _resume_and_check(workdir, "ctrlc", stopped_at, SIGNAL_EPOCHS * STEPS_PER_EPOCH)


def test_sigkill_of_run_resumes_from_last_committed_checkpoint(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", training={"epochs": SIGNAL_EPOCHS})
    workdir, log = tmp_path / "runs", tmp_path / "run.log"
    proc = start_cli("run", str(spec), "--workdir", str(workdir), "--job-id", "killed", log=log)
    try:
        ckpt = wait_for(_first_checkpoint(workdir / "store.db", "killed"), 120, "a checkpoint", log)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    pids = [e.data["pid"] for e in store.events("killed") if e.kind == "worker_started"]

    def workers_gone() -> bool:  # they die with `run` (parent-death signal), not linger
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        return not alive

    wait_for(workers_gone, 30, "orphaned workers to exit")
    assert store.get_job("killed").state == "running"  # nobody lived to record the end
    committed = store.latest_checkpoint("killed").step
    assert committed >= ckpt.step
    _resume_and_check(workdir, "killed", committed, SIGNAL_EPOCHS * STEPS_PER_EPOCH)


def test_bad_spec_is_rejected_before_anything_starts(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "bad.yaml", training={"global_batch_size": -4}, colour="blue")
    workdir = tmp_path / "runs"
    res = cli("run", str(spec), "--workdir", str(workdir))
    assert res.returncode == 2
    assert "training.global_batch_size" in res.stderr and "greater than 0" in res.stderr
    assert "colour: unknown field" in res.stderr
    assert not workdir.exists(), "nothing was created"


def test_external_etcd_and_db(tmp_path: Path, etcd_factory) -> None:
    server = etcd_factory()
    spec = write_spec(tmp_path / "spec.yaml", training={"epochs": 1, "max_steps": 4})
    db = sqlite_url(tmp_path / "elsewhere.db")
    workdir = tmp_path / "runs"
    args = ("--workdir", str(workdir), "--etcd", server.endpoint, "--db", db)
    res = cli("run", str(spec), "--job-id", "ext", *args)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert f"etcd {server.endpoint}" in res.stdout
    assert not (workdir / "jobs" / "ext" / "etcd").exists(), "no embedded etcd was started"
    assert not (workdir / "store.db").exists(), "the store is the --db one"
    store = Store.open(db, migrate=False)
    job = store.get_job("ext")
    assert job.state == "completed" and job.step == 4
    assert store.latest_checkpoint("ext").step == 4  # ended mid-epoch at max_steps: saved
    status = cli("status", "ext", "--json", "--db", db)
    assert json.loads(status.stdout)["step"] == 4


def test_autopipe_plans_from_measurement_and_records_the_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path / "cache"))  # a fresh profile cache
    spec = write_spec(
        tmp_path / "spec.yaml",
        model={"depth": 4},
        training={"epochs": 1, "max_steps": 3},
        parallel={"partition": "autopipe", "microbatches": "auto"},
    )
    workdir = tmp_path / "runs"
    res = cli("run", str(spec), "--workdir", str(workdir), "--job-id", "auto")
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    history = store.layouts("auto")
    assert [h.layout.version for h in history] == [1, 2]
    planned, reason = history[-1].layout, history[-1].reason
    assert planned.planner == "autopipe" and reason.startswith("autopipe:")
    assert planned.microbatches in (2, 4, 8, 16, 32) and 2 <= planned.microbatches <= 12
    assert store.current_layout("auto") == planned and store.get_job("auto").step == 3
    assert any(e.kind == "layout_planned" for e in store.events("auto"))
    assert list((tmp_path / "cache").rglob("*.json")), "the measured profile is cached"


@pytest.mark.slow
def test_a_job_with_dropout_trains_the_same_losses_twice(tmp_path: Path) -> None:
    """Dropout draws from each rank's own seeded stream (a fresh process seeds torch's
    generator at random): the same spec, run twice, trains the same losses. The same
    computation twice on one machine, so bit for bit."""
    spec = write_spec(
        tmp_path / "drop.yaml", model={"dropout": 0.3}, training={"epochs": 1, "max_steps": 6}
    )
    losses = []
    for run in ("first", "second"):
        res = cli("run", str(spec), "--workdir", str(tmp_path / run), "--job-id", "drop")
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        store = Store.open(sqlite_url(tmp_path / run / "store.db"), migrate=False)
        losses.append([m.loss for m in store.metrics("drop")])
        store.close()
    assert len(losses[0]) == 6 and losses[0] == losses[1], losses
