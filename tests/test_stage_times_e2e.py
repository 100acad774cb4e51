"""Where each stage's time goes, in real jobs through the CLI (issue 28): every rank reports its
phases per interval, the store keeps them, `status` and the summary name the slowest stage and
the bubble, and `pipetransformer trace` captures one step's schedule from every rank."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest

from pipetransformer.core.stage_times import PHASES
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


def test_every_rank_reports_where_its_time_went(trained_run: RealRun) -> None:
    """The shared 2x1 run (gpipe, 4 micro-batches, 2 epochs, control every 10 steps)."""
    store = trained_run.store()
    job = trained_run.job_id
    rows = store.stage_times(job)
    total = 2 * STEPS_PER_EPOCH
    for rank, stage in ((0, 0), (1, 1)):
        mine = [r for r in rows if r.rank == rank]
        # intervals chain from the first step to the last, one report per 10 steps and the end
        assert [(r.from_step, r.to_step) for r in mine] == [
            (a, min(a + 10, total)) for a in range(0, total, 10)
        ], rank
        for r in mine:
            assert r.stages == (stage,) and r.replica == 0 and r.layout_version == 1
            assert r.clock == "host"
            # every second of the interval is in some phase
            assert r.seconds.total() == pytest.approx(r.wall_s, rel=1e-6)
            assert r.seconds.forward > 0 and r.seconds.backward > 0
            assert r.seconds.optimizer > 0 and r.seconds.grad_sync > 0
        # the last stage reads no inputs; the first waits for data (the host copy) each step
        waited = sum(r.seconds.data_wait for r in mine)
        assert (waited > 0) if rank == 0 else waited == 0
        # epoch ends (steps 23 and 46) evaluate; checkpoints are written at both
        evaluated = [r.to_step for r in mine if r.seconds.evaluation > 0]
        assert evaluated == [30, 46], evaluated
        assert sum(r.seconds.checkpoint for r in mine) > 0
    # under GPipe the stages wait on each other: some bubble on both ranks
    assert all(sum(r.seconds.pipeline_wait for r in rows if r.rank == k) > 0 for k in (0, 1))
    assert "pipeline: slowest stage" in trained_run.result.stdout
    assert "(schedule: 20%)" in trained_run.result.stdout  # (p-1)/(m+p-1), p=2, m=4


def test_status_names_the_slowest_stage_and_the_bubble(trained_run: RealRun) -> None:
    res = cli("status", trained_run.job_id, "--workdir", str(trained_run.workdir))
    assert res.returncode == 0, res.stderr
    assert "slowest stage" in res.stdout and "bubble" in res.stdout
    res = cli("status", trained_run.job_id, "--json", "--workdir", str(trained_run.workdir))
    reading = json.loads(res.stdout)["pipeline"]
    assert reading["layout_version"] == 1 and reading["slowest_stages"] in ([0], [1])
    assert reading["theory"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1), p=2, m=4
    assert 0 <= reading["bubble"] < 1


def test_a_running_job_is_traced_scraped_and_logged_for_tensorboard(tmp_path: Path) -> None:
    """One running job: `pipetransformer trace` captures a step on every rank, its Prometheus
    endpoint answers while it trains, and its TensorBoard event files hold every step."""
    # long enough to be still training when `trace` (a fresh process) files its request: the
    # 6 epochs this had ran out first on a loaded machine (18 s of training in all)
    spec = write_spec(
        tmp_path / "spec.yaml", training={"epochs": 16}, runtime={"tensorboard": True}
    )
    workdir, log = tmp_path / "runs", tmp_path / "run.log"
    port = free_port()
    proc = start_cli(
        "run",
        str(spec),
        "--workdir",
        str(workdir),
        "--job-id",
        "tr",
        "--metrics-port",
        str(port),
        log=log,
    )
    out = tmp_path / "trace.json"
    try:
        started = store_probe(workdir / "store.db", "tr", lambda st, job: st.get_job(job).step >= 2)
        wait_for(started, 120, "training to start", log)
        res = cli("trace", "tr", "--workdir", str(workdir), "--out", str(out), "--wait", "60")
        assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
        assert "Chrome / Perfetto trace" in res.stdout
        scraped = scrape(port)
        assert scraped[("pipetransformer_step", "tr")] >= 2
        assert scraped[("pipetransformer_layout_version", "tr")] == 1
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    trace = json.loads(out.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_rank = {pid: [e for e in spans if e["pid"] == pid] for pid in (0, 1)}
    for rank, mine in by_rank.items():
        # 4 micro-batches, each forward and backward on the rank's stage
        for phase in ("forward", "backward"):
            mbs = sorted(e["args"]["microbatch"] for e in mine if e["cat"] == phase)
            assert mbs == [0, 1, 2, 3], (rank, phase, mbs)
            assert all(e["tid"] == rank for e in mine if e["cat"] == phase)
        assert {e["cat"] for e in mine} <= set(PHASES)
        assert all(e["dur"] >= 0 for e in mine)
    # the last stage waits for the first stage's first forward before it can start
    assert any(e["cat"] == "pipeline_wait" for e in by_rank[1])
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    rows = store.step_traces("tr")
    assert {r.rank for r in rows} == {0, 1} and len({r.step for r in rows}) == 1
    assert len({r.request for r in rows}) == 1
    # every step's loss in the TensorBoard event files, as in the store
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(
        str(workdir / "jobs" / "tr" / "tensorboard"), size_guidance={"scalars": 0}
    )
    acc.Reload()
    losses = acc.Scalars("train/loss")
    assert [e.step for e in losses] == [m.step for m in store.metrics("tr")]
    assert [e.value for e in losses] == pytest.approx([m.loss for m in store.metrics("tr")])
    # a finished job is not traced
    late = cli("trace", "tr", "--workdir", str(workdir), "--wait", "1")
    assert late.returncode == 2 and "completed" in late.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, str], float]:
    """(metric name, job_id) -> value of the samples without other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, s.labels["job_id"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if set(s.labels) == {"job_id"}
    }
