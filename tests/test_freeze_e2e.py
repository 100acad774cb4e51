"""Freezing in a real job: a manual override through the CLI is validated, audited and applied at
the next decision point; the frozen prefix leaves the pipeline and the freed rank becomes a
replica (re-layout in the running processes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipetransformer.store import Store, sqlite_url
from tests.fixtures_run import cli, start_cli, store_probe, wait_for, write_spec

pytestmark = pytest.mark.slow


def test_manual_freeze_is_validated_audited_and_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path / "cache"))
    # decision points every 5 steps. The job must outlast two `freeze` commands after its
    # second step (each a fresh CLI process: 2 to 3 s alone, more on a loaded machine): over 6
    # epochs (138 steps, about 6 s alone) it once completed before the second one was filed;
    # 20 epochs (460 steps) leave it running about 15 s longer
    spec = write_spec(
        tmp_path / "spec.yaml",
        model={"depth": 4},
        training={"epochs": 20},
        freeze={"every": 5},
    )
    workdir, log = tmp_path / "runs", tmp_path / "run.log"
    proc = start_cli("run", str(spec), "--workdir", str(workdir), "--job-id", "fz", log=log)
    try:
        started = store_probe(workdir / "store.db", "fz", lambda st, job: st.get_job(job).step >= 2)
        wait_for(started, 120, "training to start", log)
        bad = cli("freeze", "fz", "--layers", "4", "--workdir", str(workdir))
        assert bad.returncode == 2 and "layers=4" in bad.stderr, bad.stderr  # keep 1 trainable
        ok = cli("freeze", "fz", "--layers", "2", "--reason", "test", "--workdir", str(workdir))
        assert ok.returncode == 0, ok.stderr
        assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        proc.kill()
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    kinds = [e.kind for e in store.events("fz", limit=500)]
    assert "freeze_requested" in kinds and "freeze_applied" in kinds
    history = store.layouts("fz")
    frozen = [h.layout for h in history if h.layout.freeze_boundary == 2]
    assert frozen, [h.layout.describe() for h in history]
    lay = frozen[0]
    assert lay.stages[0].start == 2, "frozen blocks left the pipeline"
    assert lay.world_size == 2
    # AutoCache decided on each rank running the frozen prefix, measuring where the job's cache
    # files live (not /tmp) at the share of rows its RAM tier holds
    decided = [e for e in store.events("fz", limit=500) if e.kind == "cache_decided"]
    assert decided and {e.data["boundary"] for e in decided} == {2}
    for e in decided:
        assert Path(e.data["directory"]).is_relative_to(workdir / "jobs" / "fz"), e.data
        assert 0 < e.data["ram_fraction"] <= 1
    # evaluations after the freeze read the held-out rows' frozen prefix outputs from AutoCache:
    # its level in the job's files (shared by the node's two ranks) holds every held-out row
    assert all(e.data["use"] for e in decided), [e.data["reason"] for e in decided]
    heldout = Path(decided[0].data["directory"]) / "heldout"
    present = [np.fromfile(p, np.uint8) for p in heldout.glob("*.present")]
    assert len(present) == 1 and present[0].size > 0 and present[0].all(), present
    applied = next(e for e in store.events("fz", limit=500) if e.kind == "freeze_applied")
    assert applied.data["outcome"] == "applied" and applied.data["boundary"] == 2
    job = store.get_job("fz")
    assert job.state == "completed" and job.freeze_boundary == 2
    steps = [m.step for m in store.metrics("fz")]
    assert steps == list(range(1, job.step + 1)), "no step lost or repeated across the re-layout"
    done = cli("freeze", "fz", "--layers", "3", "--workdir", str(workdir))
    assert done.returncode == 2 and "completed" in done.stderr


def test_freeze_requests_are_validated_before_anything_is_filed(store, etcd) -> None:
    from pipetransformer.core import keys
    from pipetransformer.core.spec import parse_spec
    from pipetransformer.edge.overrides import OverrideError, file_freeze_request

    spec = parse_spec({"name": "x", "model": {"depth": 6}, "freeze": {"keep_trainable": 2}})
    store.create_job("j", spec, "/tmp")
    with pytest.raises(OverrideError, match="is pending"):
        file_freeze_request(etcd, store.get_job("j"), 2, "why")  # not running yet
    store.set_job_state("j", "running")
    for layers, phrase in (
        (5, "layers=5"),
        (-1, "layers must be >= 0"),
        (0, r"layers=0 freezes nothing \(nothing is frozen yet\).*ask for 1\.\.4"),
    ):
        with pytest.raises(OverrideError, match=phrase):
            file_freeze_request(etcd, store.get_job("j"), layers, "why")
    with pytest.raises(OverrideError, match="reason"):
        file_freeze_request(etcd, store.get_job("j"), 2, "  ")
    assert etcd.get(keys.freeze_override("j")) is None, "nothing filed by a rejected request"
    request = file_freeze_request(etcd, store.get_job("j"), 4, "converged", who="ana@lab")
    assert request.layers == 4 and request.who == "ana@lab"
    with pytest.raises(OverrideError, match="already has a pending"):
        file_freeze_request(etcd, store.get_job("j"), 4, "again")


def test_relayout_modes_in_real_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`freeze.relayout: off` keeps the 2x1 [0-2|3-5] stages while F moves past stage 0's blocks;
    'repartition' keeps 2x1 and starts stage 0 at F. A decision every 3 steps under the
    schedule policy freezes F = 2, 3, 4 at steps 3, 6, 9 (alpha-bound of 6 blocks)."""
    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path / "cache"))
    workdir = tmp_path / "runs"
    for mode, keep in (("off", 1), ("repartition", 2)):
        spec = write_spec(
            tmp_path / f"{mode}.yaml",
            model={"depth": 6},
            training={"epochs": 1, "max_steps": 10},
            freeze={"policy": "schedule", "every": 3, "relayout": mode, "keep_trainable": keep},
        )
        run = cli("run", str(spec), "--workdir", str(workdir), "--job-id", mode)
        assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    for mode in ("off", "repartition"):
        job = store.get_job(mode)
        assert job.state == "completed" and job.step == 10 and job.freeze_boundary == 4, mode
        layouts = [h.layout for h in store.layouts(mode)]
        assert [lay.freeze_boundary for lay in layouts] == [0, 2, 3, 4], mode
        assert [lay.version for lay in layouts] == [1, 2, 3, 4], mode
        for lay in layouts:
            assert (lay.pipeline_ranks, lay.replicas, lay.microbatches) == (2, 1, 4), lay.short
        steps = [m.step for m in store.metrics(mode)]
        assert steps == list(range(1, 11)), "no step lost or repeated across the re-layouts"
        assert [m.frozen for m in store.metrics(mode) if m.step in (3, 4, 10)] == [0, 2, 4]
    # off: the same stages throughout, stage 0 all frozen at the end; no prefix to cache
    for lay in (h.layout for h in store.layouts("off")):
        assert [(s.start, s.end) for s in lay.stages] == [(0, 3), (3, 6)], lay.short
    assert not [e for e in store.events("off", limit=500) if e.kind == "cache_decided"]
    # repartition: the frozen prefix leaves the pipeline, the active blocks are cut again
    for lay in [h.layout for h in store.layouts("repartition")][1:]:
        f = lay.freeze_boundary
        assert lay.stages[0].start == f and f < lay.stages[1].start < 6, lay.short
        assert lay.planner == "autopipe"
    # so AutoCache decides on the prefix at each boundary, as under elastic
    decided = [e for e in store.events("repartition", limit=500) if e.kind == "cache_decided"]
    assert {e.data["boundary"] for e in decided} == {2, 3, 4}


def test_in_memory_and_checkpoint_handovers_train_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same job re-laid out twice (F=3 at step 3, AutoPipe's choice of shape; F=5 at step
    6, where one active block leaves 1x2 as the only shape: rank 1 gains the embedding and
    the frozen blocks) with `freeze.handover` memory and checkpoint. Both runs plan from the
    same stored profiles, so it is the same computation twice: the same losses bit for bit.
    The memory path writes no checkpoint at a re-layout and moves units over the wire; each
    re-layout's cost is stored with its event."""
    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path / "cache"))
    workdir = tmp_path / "runs"
    for handover in ("memory", "checkpoint"):
        spec = write_spec(
            tmp_path / f"{handover}.yaml",
            model={"depth": 6},
            training={"epochs": 1, "max_steps": 9},
            freeze={
                "policy": "schedule",
                "every": 3,
                "alpha": 0.5,
                "handover": handover,
                "cache": "off",  # cached rows differ from recomputed ones in the last bits
            },
            # periodic checkpoints only at the end: any other committed one is a re-layout's
            checkpoint={"every_epochs": 100},
        )
        run = cli("run", str(spec), "--workdir", str(workdir), "--job-id", handover)
        assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    shapes, losses = {}, {}
    for handover in ("memory", "checkpoint"):
        shapes[handover] = [h.layout.short for h in store.layouts(handover)]
        losses[handover] = [m.loss for m in store.metrics(handover)]
        assert len(losses[handover]) == 9
        planned = [e for e in store.events(handover, limit=500) if e.kind == "layout_planned"]
        costs = sorted((e.data["cost"] for e in planned if "cost" in e.data), key=str)
        assert len(costs) == 2 and all(c["handover"] == handover for c in costs), costs
        steps = sorted(c.step for c in store.checkpoints(handover))
        if handover == "memory":
            assert all(c["checkpoint_s"] == 0 for c in costs)
            assert max(c["moved_bytes"] for c in costs) > 0  # -> 1x2 moves units to rank 1
            assert steps == [9]
        else:
            assert all(c["checkpoint_s"] > 0 and c["moved_bytes"] == 0 for c in costs)
            assert steps == [3, 6, 9]
    assert shapes["memory"] == shapes["checkpoint"]
    assert shapes["memory"][-1] == "1x2 [5-5] F=5 v3", shapes["memory"]
    assert losses["memory"] == losses["checkpoint"]
    # the ranks' stage timings follow the re-layouts: an interval ends at each (steps 3, 6),
    # and rank 1 runs stage 1 of replica 0 under v1, stage 0 of replica 1 under v3 (1x2)
    rows = store.stage_times("memory")
    for rank in (0, 1):
        mine = [(r.from_step, r.to_step, r.layout_version) for r in rows if r.rank == rank]
        assert mine == [(0, 3, 1), (3, 6, 2), (6, 9, 3)], (rank, mine)
    parts = {(r.rank, r.layout_version): (r.stages, r.replica) for r in rows}
    assert parts[(1, 1)] == ((1,), 0) and parts[(1, 3)] == ((0,), 1)
    assert parts[(0, 3)] == ((0,), 0)
    # 1x2: one stage per pipeline, nothing to wait for between stages; the replicas sum
    assert all(r.seconds.grad_sync > 0 for r in rows if r.layout_version == 3)


def test_the_output_rule_probes_across_re_layouts_and_records_its_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Policy 'output' in a real 2-rank job: a probe before the first step and one at every
    decision point (every 3 steps), each recorded with its per-block signal and threshold.
    Once a prefix is frozen and the layout has moved it out of the pipeline (its rank turned
    into a replica), the frozen blocks read as unmoved: the probe's rows are the same whatever
    the layout, so the reference taken under the old layout compares with the new one."""
    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path / "cache"))
    workdir = tmp_path / "runs"
    spec = write_spec(
        tmp_path / "output.yaml",
        model={"depth": 6},
        training={"epochs": 1, "max_steps": 15},
        # a high ratio freezes at the first slowing: the test is the mechanism, not the rule
        freeze={"policy": "output", "every": 3, "output_ratio": 0.99, "alpha": 0.5},
    )
    run = cli("run", str(spec), "--workdir", str(workdir), "--job-id", "out")
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    signals = store.freeze_signals("out")
    assert [s.step for s in signals] == [3, 6, 9, 12]
    assert [s.decision for s in signals] == [1, 2, 3, 4]
    assert {(s.policy, s.statistic) for s in signals} == {("output", "output_rate")}
    assert all(s.probe_s > 0 for s in signals)
    # the probe before the first step is the first decision's reference: every rate is known
    assert all(v is not None and v > 0 for v in signals[0].signal)
    moved = next(i for i, s in enumerate(signals) if s.boundary > 0)
    frozen = signals[moved].boundary
    layouts = [h.layout for h in store.layouts("out")]
    assert layouts[-1].freeze_boundary == signals[-1].boundary
    assert any(lay.replicas > 1 for lay in layouts), "the freed rank became a replica"
    assert moved + 1 < len(signals), "a decision point after the first freeze"
    after = signals[moved + 1]
    for i in range(frozen):
        # unmoved across the layout change (to float noise: the rows now run in other batch
        # shapes, whose sums may differ in the last bits on some CPUs)
        assert after.signal[i] < 1e-3 * after.limits[i], (i, after.signal, after.limits)
    for i in range(frozen, 6):
        assert after.signal[i] > 1e-3 * after.limits[i], "active blocks still move"
