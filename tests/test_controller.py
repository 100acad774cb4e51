"""The controller's generation protocol against a real etcd and a real SQLite store, without
workers: join requests become generations planned for the world that joined, a lost lease
aborts the generation, and a restarted controller takes over the running one."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event, text

from pipetransformer.core import keys
from pipetransformer.core.planner import plan_layout
from pipetransformer.core.protocol import (
    EXIT_REFORM,
    Assignment,
    Finished,
    JoinRequest,
    WorkerExit,
    parse_event,
)
from pipetransformer.core.provenance import DATA_OPENED, describe_data, origin_of
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout, StageLayout
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.edge.manifest import build_manifest, manifest_checksum
from pipetransformer.orchestrator.controller import Controller, submit
from pipetransformer.orchestrator.etcd_server import EmbeddedEtcd
from pipetransformer.store import Store

REPO = Path(__file__).resolve().parents[1]


def _spec() -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "ft",
            "model": {"depth": 4, "dim": 32, "heads": 4},
            "training": {"epochs": 1, "global_batch_size": 64},
            "parallel": {"stages": 2, "replicas": 1, "microbatches": 4},
            "runtime": {"nodes": 2, "lease_ttl_s": 2},
        }
    )


@pytest.fixture
def ctrl(store: Store, etcd: EtcdClient, tmp_path: Path) -> Controller:
    c = Controller.create(store, etcd, _spec(), tmp_path, "job-ft")
    c.publish("job-ft-rdzv")
    return c


def _join(etcd: EtcdClient, world: int, nodes: list[str]) -> JoinRequest:
    request = JoinRequest(id=f"r-{time.monotonic_ns()}", world=world, nodes=nodes)
    etcd.put(keys.join("job-ft"), request.model_dump_json())
    return request


def _assignment(etcd: EtcdClient) -> Assignment:
    return Assignment.model_validate_json(etcd.get(keys.assignment("job-ft")))


def _register(etcd: EtcdClient, generation: int, rank: int, ttl: int = 2):
    lease = etcd.lease(ttl)
    etcd.put(keys.worker("job-ft", rank), json.dumps({"generation": generation}), lease=lease)
    return lease


def test_publish_prepares_a_launch(ctrl: Controller, etcd: EtcdClient, store: Store) -> None:
    assert json.loads(etcd.get(keys.launch("job-ft"))) == {"rdzv_id": "job-ft-rdzv"}
    assert etcd.get(keys.control("job-ft")) == "run"
    assert etcd.get(keys.assignment("job-ft")) is None  # generations start on a join request
    assert ctrl.answer_join() is None
    assert store.get_job("job-ft").message == "waiting for workers to join"


def test_join_starts_a_generation_and_is_answered_once(ctrl: Controller, etcd, store) -> None:
    request = _join(etcd, 2, ["a", "b"])
    a = ctrl.answer_join()
    assert a is not None and a.request == request.id and a.generation == 1
    assert a.layout.world_size == 2 and a.waiting is None and a.start.step == 0
    assert _assignment(etcd) == a
    assert ctrl.answer_join() is None  # the same request is not answered twice
    assert [g.state for g in store.generations("job-ft")] == ["running"]


def test_node_loss_shrinks_and_a_rejoin_widens(ctrl: Controller, etcd, store) -> None:
    _join(etcd, 2, ["a", "b"])
    first = ctrl.answer_join()
    _join(etcd, 1, ["a"])  # node b is gone: the survivors re-rendezvous as a world of one
    shrunk = ctrl.answer_join()
    assert shrunk.generation == 2 and shrunk.layout.world_size == 1
    assert shrunk.layout.version == first.layout.version + 1
    assert store.current_layout("job-ft") == shrunk.layout
    _join(etcd, 2, ["a", "c"])  # a new node joins
    widened = ctrl.answer_join()
    assert widened.generation == 3 and widened.layout.world_size == 2
    gens = store.generations("job-ft")
    assert [(g.world_size, g.state) for g in gens] == [
        (2, "aborted"),
        (1, "aborted"),
        (2, "running"),
    ]
    kinds = [e.kind for e in reversed(store.events("job-ft"))]
    assert kinds.count("generation_started") == 3
    assert "job_shrank" in kinds and "job_widened" in kinds
    joined = [e for e in store.events("job-ft") if e.kind == "worker_joined"]
    left = [e for e in store.events("job-ft") if e.kind == "worker_left"]
    assert [e.data["node"] for e in joined] == ["c"]
    assert sorted(e.data["node"] for e in left) == ["b"]


def test_no_layout_fits_so_the_job_waits_for_capacity(store, etcd, tmp_path) -> None:
    zbv = {"stages": 2, "microbatches": 4, "schedule": "zbv", "virtual_stages": 2}
    spec = JobSpec.model_validate(_spec().model_dump() | {"parallel": zbv})
    ctrl = Controller.create(store, etcd, spec, tmp_path, "job-ft")
    ctrl.publish("rdzv")
    _join(etcd, 3, ["a", "b", "c"])  # 4 blocks cannot make 3 ranks x 2 V-placed stages
    a = ctrl.answer_join()
    assert a.layout is None and "waiting for capacity" in a.waiting
    assert "waiting for capacity" in store.get_job("job-ft").message
    assert ctrl.check_workers() == []  # a waiting generation is never aborted
    assert "waiting_for_capacity" in [e.kind for e in store.events("job-ft")]


def test_a_lost_lease_aborts_the_generation(ctrl: Controller, etcd, store) -> None:
    _join(etcd, 2, ["a", "b"])
    a = ctrl.answer_join()
    leases = [_register(etcd, a.generation, r) for r in (0, 1)]
    _register(etcd, a.generation - 1, 5)  # a stale worker of an older generation is ignored
    assert ctrl.check_workers() == []
    leases[1].revoke()  # rank 1 dies (its lease is gone)
    assert ctrl.check_workers() == [1]
    assert etcd.get(keys.abort("job-ft")) == str(a.generation)
    assert store.generations("job-ft")[-1].state == "aborted"
    assert "generation_aborted" in [e.kind for e in store.events("job-ft")]


def test_a_final_report_racing_the_leases_is_not_an_abort(ctrl, etcd, store) -> None:
    _join(etcd, 2, ["a", "b"])
    a = ctrl.answer_join()
    leases = [_register(etcd, a.generation, r) for r in (0, 1)]
    ctrl.check_workers()
    done = Finished(kind="done", rank=0, generation=a.generation, outcome="done")
    etcd.put(keys.event("job-ft", a.generation, 0, 0), done.model_dump_json())
    for lease in leases:
        lease.revoke()
    assert ctrl.check_workers() == []
    assert etcd.get(keys.abort("job-ft")) is None


def _report(etcd: EtcdClient, generation: int, rank: int, kind: str, seq: int = 0, **data):
    event = parse_event(json.dumps({"kind": kind, "rank": rank, "generation": generation, **data}))
    etcd.put(keys.event("job-ft", generation, rank, seq), event.model_dump_json())


def _ends(store: Store) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for e in reversed(store.events("job-ft", limit=200)):
        if e.kind in ("worker_died", "worker_lost", "worker_failed", "peer_lost"):
            out.setdefault(e.kind, []).append(e.rank)
    return out


GONE = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:16110"


def test_the_dead_rank_is_named_not_the_peer_that_reported_first(ctrl, etcd, store) -> None:
    """Rank 0 reports the lost peer and leaves first; rank 1 (SIGKILLed, no fork server to
    report it) says nothing: once its lease lapses, the generation names rank 1."""
    request = JoinRequest(id="r1", world=2, nodes=["a:1", "b:2"], pids=[100, 101])
    etcd.put(keys.join("job-ft"), request.model_dump_json())
    a = ctrl.answer_join()
    leases = [_register(etcd, a.generation, r, ttl=1) for r in (0, 1)]
    ctrl.tick()
    _report(etcd, a.generation, 0, "peer_lost", error=GONE, phase="train")
    leases[0].revoke()
    ctrl.tick()  # aborted at once, with what is known
    gen = store.generations("job-ft")[-1]
    assert gen.state == "aborted"
    assert gen.reason == "rank 0 only lost its peer; the failed process is not identified yet"
    assert _ends(store) == {"peer_lost": [0]}
    deadline = time.monotonic() + 10  # rank 1's lease lapses within about its TTL
    while "worker_lost" not in _ends(store) and time.monotonic() < deadline:
        time.sleep(0.2)
        ctrl.tick()
    assert _ends(store) == {"peer_lost": [0], "worker_lost": [1]}
    reason = store.generations("job-ft")[-1].reason
    assert reason.startswith("rank 1 (pid 101 on b) vanished: its lease lapsed"), reason
    assert reason.endswith("rank 0 only lost its peer")
    assert not [e for e in store.events("job-ft") if e.kind == "worker_failed"]
    # the workers table says the same: rank 1 lost (lease lapsed), rank 0 a victim that let go
    w0, w1 = store.workers("job-ft")
    assert (w1.state, w1.lease, w1.pid, w1.host) == ("lost", "lapsed", 101, "b")
    assert "lease lapsed" in w1.detail and w1.exit_code is w1.signal is None
    assert (w0.state, w0.lease, w0.detail) == ("peer_lost", "released", GONE)


def test_an_exit_report_names_the_dead_rank_and_how(ctrl, etcd, store) -> None:
    request = JoinRequest(id="r1", world=2, nodes=["a:1", "b:2"], pids=[100, 101])
    etcd.put(keys.join("job-ft"), request.model_dump_json())
    a = ctrl.answer_join()
    _ = [_register(etcd, a.generation, r, ttl=5) for r in (0, 1)]
    ctrl.tick()
    died = WorkerExit(pid=101, host="b", rank=1, signal=signal.SIGKILL)
    etcd.put(keys.exit_report("job-ft", "b", 101), died.model_dump_json())
    ctrl.tick()  # rank 1's lease still holds, but its fork server saw it die: abort now
    assert etcd.get(keys.abort("job-ft")) == str(a.generation)
    assert etcd.get_prefix(keys.exits("job-ft")) == []  # drained
    gen = store.generations("job-ft")[-1]
    assert (gen.state, gen.reason) == (
        "aborted",
        "rank 1 (pid 101 on b) killed by signal 9 (SIGKILL)",
    )
    died_event = next(e for e in store.events("job-ft") if e.kind == "worker_died")
    assert died_event.rank == 1 and died_event.data["signal"] == signal.SIGKILL
    _report(etcd, a.generation, 0, "peer_lost", error=GONE)
    ctrl.tick()  # the victim's report arrives after the abort: the reason is completed
    reason = store.generations("job-ft")[-1].reason
    assert reason == "rank 1 (pid 101 on b) killed by signal 9 (SIGKILL); rank 0 only lost its peer"
    w0, w1 = store.workers("job-ft")
    assert (w1.state, w1.exit_code, w1.signal) == ("died", None, signal.SIGKILL)
    assert w1.detail == "killed by signal 9 (SIGKILL)"
    assert (w0.state, w0.detail) == ("peer_lost", GONE)


def test_every_rank_failing_alike_while_starting_fails_the_job(ctrl, etcd, store) -> None:
    """A spec or environment problem that every rank hits while building: the job fails after
    this generation instead of restarting runtime.max_restarts times."""
    _join(etcd, 2, ["a:1", "b:2"])
    a = ctrl.answer_join()
    error = "RuntimeError: DefaultCPUAllocator: not enough memory"
    _report(etcd, a.generation, 0, "failed", error=error, phase="build")
    ctrl.tick()
    assert ctrl.progress.outcome is None  # one rank may be a fluke
    _report(etcd, a.generation, 1, "failed", error=error, phase="build")
    ctrl.tick()
    fatal = _assignment(etcd)
    assert fatal.fatal and error in fatal.fatal and fatal.layout is None
    _join(etcd, 2, ["a:1", "b:2"])  # the agents restarted their workers: not a new generation
    assert ctrl.answer_join() is None
    assert ctrl.finish(0) == "failed"
    gens = store.generations("job-ft")
    assert [(g.number, g.state) for g in gens] == [(1, "failed")]
    assert error in gens[0].reason
    job = store.get_job("job-ft")
    assert job.state == "failed" and error in job.message
    assert "job_failed_at_start" in [e.kind for e in store.events("job-ft")]


@pytest.mark.parametrize("outcome", ["applied", "superseded", "rejected"])
def test_what_became_of_a_freeze_request_is_audited(ctrl, etcd, store, outcome) -> None:
    request = {"id": "q1", "layers": 4, "who": "ana@lab", "reason": "converged", "time": 0.0}
    etcd.put(keys.freeze_override("job-ft"), json.dumps(request))
    _join(etcd, 2, ["a:1", "b:2"])
    a = ctrl.answer_join()
    boundary = {"applied": 4, "superseded": 5, "rejected": 3}[outcome]
    why = f"layers=4 {outcome} (test)"
    _report(etcd, a.generation, 0, "freeze", step=46, previous=3, boundary=boundary,
            source="manual" if outcome == "applied" else "auto", reason="decision 2",
            request=request, outcome=outcome, outcome_reason=why)  # fmt: skip
    ctrl.tick()
    audit = [e for e in store.events("job-ft") if e.kind == f"freeze_{outcome}"]
    assert len(audit) == 1 and why in audit[0].message and "ana@lab" in audit[0].message
    assert audit[0].data["boundary"] == boundary
    assert etcd.get(keys.freeze_override("job-ft")) is None  # retired: never applied twice
    requested = [e for e in store.events("job-ft") if e.kind == "freeze_requested"]
    assert len(requested) == 1


def test_a_malformed_freeze_request_does_not_stop_the_controller(ctrl, etcd, store) -> None:
    etcd.put(keys.freeze_override("job-ft"), "{not json")
    ctrl.tick()
    requested = [e for e in store.events("job-ft") if e.kind == "freeze_requested"]
    assert len(requested) == 1 and requested[0].data["request"] == {"raw": "{not json"}


def test_a_restarted_controller_takes_over_the_running_generation(
    ctrl: Controller, etcd, store
) -> None:
    _join(etcd, 2, ["a", "b"])
    a = ctrl.answer_join()
    successor = Controller(store, etcd, "job-ft")
    assert successor.attach()
    assert successor.assignment == a and successor.generation == a.generation
    assert successor.answer_join() is None  # the running generation's request is answered
    assert [g.state for g in store.generations("job-ft")] == ["running"]
    assert "controller_attached" in [e.kind for e in store.events("job-ft")]
    # nothing to take over once the generation ended
    store.end_generation("job-ft", a.generation, "completed")
    assert not Controller(store, etcd, "job-ft").attach()


def test_abort_watch_exits_the_worker_at_once(etcd_server: EmbeddedEtcd, etcd) -> None:
    """A worker stuck anywhere (here: sleeping) leaves with EXIT_REFORM within a fraction of a
    second of the controller aborting its generation; another generation's abort is ignored."""
    script = textwrap.dedent(
        f"""
        import time
        from pipetransformer.edge.etcd_client import EtcdClient
        from pipetransformer.trainer.process import AbortWatch
        AbortWatch(EtcdClient({etcd_server.endpoint!r}), "job-ft", 7, every=0.05).start()
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        etcd.put(keys.abort("job-ft"), "6")
        time.sleep(0.5)
        assert proc.poll() is None
        etcd.put(keys.abort("job-ft"), "7")
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == EXIT_REFORM
        assert time.monotonic() - t0 < 2
    finally:
        proc.kill()


def _fake_checkpoint(store: Store, root: Path, step: int, boundary: int) -> Path:
    """A sealed checkpoint directory as far as the controller looks (manifest, checksum,
    meta), committed in the store."""
    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(step % 200, step % 200 + 32)))
    meta = {"step": step, "freeze": {"boundary": boundary}}
    (path / "meta.json").write_text(json.dumps(meta))
    manifest = build_manifest(path)
    (path / "manifest.json").write_text(json.dumps(manifest))
    store.commit_checkpoint(
        "job-ft",
        step=step,
        epoch=0,
        layout_version=1,
        path=str(path),
        size_bytes=sum(e["size"] for e in manifest.values()),
        checksum=manifest_checksum(manifest),
        samples_consumed=64 * step,
    )
    return path


def test_falling_back_to_an_older_checkpoint_takes_its_freeze_boundary_back(
    ctrl: Controller, etcd, store, tmp_path: Path
) -> None:
    """The newest committed checkpoint is torn (after commit): the next generation resumes
    from the previous one, with the freeze boundary that one was saved with, and the layout
    is planned again for it."""
    _join(etcd, 2, ["a", "b"])
    ctrl.answer_join()
    _fake_checkpoint(store, tmp_path / "ckpt", 4, boundary=0)
    newer = _fake_checkpoint(store, tmp_path / "ckpt", 8, boundary=2)
    frozen = plan_layout(
        ctrl.spec, world=2, boundary=2, current=ctrl.layout
    ).layout  # the re-layout at step 8
    store.record_layout("job-ft", frozen, reason="autofreeze")
    ctrl.layout = frozen
    (newer / "meta.json").write_text(json.dumps({"step": 8, "freeze": {"boundary": 3}}))

    a = ctrl.start_generation(_join(etcd, 2, ["a", "b"]))
    assert a.start.step == 4 and a.layout.freeze_boundary == 0
    assert a.start.checkpoint.endswith("step-00000004")
    assert a.layout.freeze_boundary == 0 and a.layout.version > frozen.version
    assert [c.step for c in store.checkpoints("job-ft")] == [4]
    assert store.checkpoints("job-ft", state="corrupt")[0].step == 8
    corrupt = [e for e in store.events("job-ft") if e.kind == "checkpoint_corrupt"]
    assert "meta.json" in corrupt[0].message
    newest = store.layouts("job-ft")[-1]
    assert newest.layout == a.layout and "freeze boundary 0" in newest.reason


def test_sigterm_starts_the_grace_timer_even_inside_a_collective(tmp_path: Path) -> None:
    """A worker blocked in a gloo receive (its peer will never send) runs no Python signal
    handler; its SIGTERM grace timer must start anyway, so it leaves with EXIT_REFORM."""
    script = textwrap.dedent(
        f"""
        import os, sys, time, datetime
        import torch, torch.distributed as dist
        rank = int(sys.argv[1])
        dist.init_process_group(
            "gloo", init_method="file://{tmp_path / "rdzv"}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=120),
        )
        if rank == 1:
            time.sleep(60)
        from pipetransformer.trainer.process import LeaveRequest
        LeaveRequest(grace_s=1.0).install()
        print("ready", flush=True)
        dist.recv(torch.zeros(1), src=1)
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    try:
        assert procs[0].stdout.readline().strip() == "ready"
        time.sleep(0.5)  # inside the receive by now
        procs[0].send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert procs[0].wait(timeout=20) == EXIT_REFORM
        assert time.monotonic() - t0 < 5
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize(
    "raw, field",
    [
        ('{"kind": "metrics", "rank": 0, "generation": 1, "epoch": 0}', "metrics.step"),
        ('{"kind": "teleported", "rank": 0}', "kind"),  # an event this controller does not know
        (  # a negative memory size: rejected, not a failed store write for the whole batch
            '{"kind": "metrics", "rank": 0, "generation": 1, "step": 1, "epoch": 0, '
            '"samples_consumed": 64, "loss": 2.3, "lr": 0.001, "samples_per_s": 10.0, '
            '"frozen": 0, "peak_memory_mib": [12.5, -1.0]}',
            "metrics.peak_memory_mib.1",
        ),
        ("not json at all", "(message)"),
    ],
)
def test_a_malformed_or_unknown_report_is_rejected_not_fatal(
    ctrl, etcd, store, caplog, raw: str, field: str
) -> None:
    """A bad report is logged and recorded once, dropped from the queue, and the reports
    around it are still applied."""
    _join(etcd, 2, ["a:1", "b:2"])
    a = ctrl.answer_join()
    _report(etcd, a.generation, 0, "first_step", seq=0, step=1)
    etcd.put(keys.event("job-ft", a.generation, 0, 1), raw)
    _report(etcd, a.generation, 0, "leaving", seq=2, ranks=[1], step=1)
    with caplog.at_level("WARNING", logger="pipetransformer.controller"):
        ctrl.tick()
        ctrl.tick()
    assert any("rejecting the malformed worker report" in r.message for r in caplog.records)
    rejected = [e for e in store.events("job-ft") if e.kind == "worker_report_rejected"]
    assert len(rejected) == 1 and rejected[0].data["error"].startswith(field)
    kinds = [e.kind for e in store.events("job-ft")]
    assert "generation_resumed" in kinds and "worker_leaving" in kinds
    assert etcd.get_prefix(keys.events("job-ft")) == []


def test_a_data_report_is_recorded_for_status_and_the_dashboard(ctrl, etcd, store) -> None:
    """Rank 0's DataOpened becomes a `data_opened` event whose data reads back as the report's
    origin (what `status`, the summary and the dashboard show)."""
    _join(etcd, 2, ["a:1", "b:2"])
    a = ctrl.answer_join()
    origin = describe_data(_spec().data, 1437, 360)
    _report(etcd, a.generation, 0, "data", origin=origin.model_dump(mode="json"))
    ctrl.tick()
    (opened,) = store.events("job-ft", kinds=[DATA_OPENED])
    assert origin_of(opened.data) == origin and opened.rank == 0
    assert opened.message == (
        f"generation {a.generation} opened the data: built-in digits: train 1,437 rows; "
        "held-out 360 rows"
    )


def test_a_freeze_signal_is_stored_for_the_freezing_view(ctrl, etcd, store) -> None:
    """Rank 0's FreezeSignal is drained into the store's `freeze_signals` (one row per decision
    point); replayed, it is stored once, and a recovery's retake of the decision point (a
    higher generation) replaces it."""
    _join(etcd, 2, ["a:1", "b:2"])
    g = ctrl.answer_join().generation
    read = {
        "step": 20,
        "decision": 2,
        "boundary": 1,
        "bound": 2,
        "policy": "output",
        "statistic": "output_rate",
        "signal": [0.05, 0.5, None, 0.25],
        "limits": [0.1, 0.1, 0.1, None],
        "probe_s": 0.25,
    }
    _report(etcd, g, 0, "freeze_signal", seq=0, **read)
    raw = etcd.get(keys.event("job-ft", g, 0, 0))
    ctrl.drain()
    assert etcd.get_prefix(keys.events("job-ft")) == []
    (row,) = store.freeze_signals("job-ft")
    assert row.model_dump(exclude={"time"}) == read | {
        "generation": g,
        "signal": (0.05, 0.5, None, 0.25),
        "limits": (0.1, 0.1, 0.1, None),
    }
    etcd.put(keys.event("job-ft", g, 0, 0), raw)  # drained again: a crash before the delete
    ctrl.drain()
    assert store.freeze_signals("job-ft") == [row]
    _report(etcd, g + 1, 0, "freeze_signal", seq=0, **(read | {"boundary": 2}))
    ctrl.drain()
    assert [(r.generation, r.boundary) for r in store.freeze_signals("job-ft")] == [(g + 1, 2)]


def test_a_request_filed_by_hand_without_its_fields_is_audited_and_rejected(
    ctrl, etcd, store
) -> None:
    """JSON that is not a FreezeRequest (here: no id, who or reason) is audited as unreadable;
    the decision point's report rejects it and the controller retires it."""
    raw = json.dumps({"layers": 4})
    etcd.put(keys.freeze_override("job-ft"), raw)
    _join(etcd, 2, ["a:1", "b:2"])
    a = ctrl.answer_join()
    _report(etcd, a.generation, 0, "freeze", step=46, previous=3, boundary=3, source="none",
            reason="decision 2", request={"raw": raw}, outcome="rejected",
            outcome_reason="layers must be an integer")  # fmt: skip
    ctrl.tick()
    requested = [e for e in store.events("job-ft") if e.kind == "freeze_requested"]
    assert len(requested) == 1 and requested[0].data["request"] == {"raw": raw}
    assert "unreadable request" in requested[0].message
    rejected = [e for e in store.events("job-ft") if e.kind == "freeze_rejected"]
    assert len(rejected) == 1 and "unreadable request" in rejected[0].message
    assert etcd.get(keys.freeze_override("job-ft")) is None


def test_a_malformed_join_request_is_rejected_not_fatal(ctrl, etcd, store, caplog) -> None:
    etcd.put(keys.join("job-ft"), json.dumps({"id": "x", "world": 0}))
    with caplog.at_level("WARNING", logger="pipetransformer.controller"):
        ctrl.tick()
        ctrl.tick()
    assert any("malformed join request" in r.message for r in caplog.records)
    rejected = [e for e in store.events("job-ft") if e.kind == "join_request_rejected"]
    assert len(rejected) == 1 and rejected[0].data["error"].startswith("world")
    _join(etcd, 2, ["a:1", "b:2"])  # a good one is answered as usual
    assert ctrl.answer_join() is not None


# -- the workers table -------------------------------------------------------------------------


def _rows(store: Store, *keys: str) -> list[tuple]:
    return [tuple(getattr(w, k) for k in keys) for w in store.workers("job-ft")]


def _started(etcd: EtcdClient, generation: int, rank: int, host: str, **extra) -> None:
    _report(etcd, generation, rank, "started", stages=[rank], replica=0, pid=100 + rank,
            host=host, node=f"{host}:1", total_steps=10, **extra)  # fmt: skip


def _metrics(etcd: EtcdClient, generation: int, rank: int, step: int, **extra) -> None:
    _report(etcd, generation, rank, "metrics", seq=step, step=step, epoch=0,
            samples_consumed=64 * step, loss=1.0, lr=1e-3, samples_per_s=10.0, frozen=0,
            **extra)  # fmt: skip


@contextlib.contextmanager
def _worker_updates(store: Store) -> Iterator[list[str]]:
    """The UPDATE statements on `workers` run inside the block."""
    seen: list[str] = []

    def watch(conn, cursor, statement: str, *args) -> None:
        if statement.lstrip().upper().startswith("UPDATE WORKERS"):
            seen.append(statement)

    event.listen(store._engine, "before_cursor_execute", watch)
    try:
        yield seen
    finally:
        event.remove(store._engine, "before_cursor_execute", watch)


def test_worker_rows_follow_a_generation_from_assignment_to_its_end(ctrl, etcd, store) -> None:
    request = JoinRequest(id="r1", world=2, nodes=["a:1", "b:2"], pids=[100, 101])
    etcd.put(keys.join("job-ft"), request.model_dump_json())
    a = ctrl.answer_join()
    g = a.generation
    assert _rows(store, "generation", "rank", "node", "host", "pid", "state", "lease") == [
        (g, 0, "a:1", "a", 100, "assigned", "unknown"),
        (g, 1, "b:2", "b", 101, "assigned", "unknown"),
    ]
    assert all(w.started_at is w.last_report_at is None for w in store.workers("job-ft"))

    leases = [_register(etcd, g, r, ttl=5) for r in (0, 1)]
    ctrl.tick()
    assert _rows(store, "lease") == [("held",), ("held",)]
    with _worker_updates(store) as watched:
        ctrl.tick()
        ctrl.tick()
    assert watched == []  # the leases are written once, not every tick

    _started(etcd, g, 0, "a", log="/w/workers-n0.log", time=1000.0)
    _started(etcd, g, 1, "b", time=1000.5)  # stdout not a file: no log
    ctrl.tick()
    assert _rows(store, "state", "host", "stages", "replica", "log", "started_at") == [
        ("running", "a", (0,), 0, "/w/workers-n0.log", 1000.0),
        ("running", "b", (1,), 0, None, 1000.5),
    ]
    assert _rows(store, "last_report_at") == [(1000.0,), (1000.5,)]

    # freezing re-lays the running processes out (2x1 -> 1x2): each rank's stage and replica
    # become its part in the layout in force
    packed = Layout(
        version=2,
        num_blocks=4,
        freeze_boundary=2,
        stages=[StageLayout(index=0, start=2, end=4, ranks=[0, 1])],
        replicas=2,
        microbatches=4,
    ).model_dump(mode="json")
    _report(etcd, g, 0, "layout", seq=5, layout=packed, reason="autofreeze", time=1000.7)
    ctrl.tick()
    assert _rows(store, "stages", "replica") == [((0,), 0), ((0,), 1)]

    # the loss-owning rank reports every step: its report time advances, in one statement per
    # drain however many reports it drains
    _metrics(etcd, g, 1, 1, time=1001.0, grad_norms=[0.0, 0.5, float("nan"), 2.0])
    _metrics(etcd, g, 1, 2, time=1003.0)  # a worker that does not report norms
    _metrics(etcd, g, 1, 3, time=1002.0, grad_norms=[0.0, 0.25, 1.0, 1.5])
    with _worker_updates(store) as watched:
        ctrl.drain()
    assert len(watched) == 1, watched
    assert _rows(store, "last_report_at") == [(1000.7,), (1003.0,)]
    assert [m.grad_norms for m in store.metrics("job-ft")] == [
        (0.0, 0.5, None, 2.0),
        None,
        (0.0, 0.25, 1.0, 1.5),
    ]

    _report(etcd, g, 0, "done", seq=1, outcome="done", time=1004.0)
    ctrl.tick()
    for lease in leases:
        lease.revoke()
    ctrl.tick()
    assert _rows(store, "state", "lease", "last_report_at") == [
        ("done", "released", 1004.0),
        ("done", "released", 1003.0),
    ]


def test_metrics_bring_mfu_and_peak_memory_to_the_store_and_the_progress(ctrl, etcd, store) -> None:
    _join(etcd, 2, ["a:1", "b:2"])
    g = ctrl.answer_join().generation
    _metrics(etcd, g, 1, 1, mfu=0.41, peak_memory_mib=[12288.0, 9216.5])  # a control point
    _metrics(etcd, g, 1, 2, mfu=0.43)  # between control points: no peaks
    ctrl.drain()
    assert [(m.mfu, m.peak_memory_mib) for m in store.metrics("job-ft")] == [
        (0.41, (12288.0, 9216.5)),
        (0.43, None),
    ]
    p = ctrl.progress
    assert (p.step, p.mfu, p.peak_memory_mib) == (2, 0.43, [12288.0, 9216.5])  # peaks kept

    _metrics(etcd, g, 1, 3, peak_memory_mib=[13000.0, None])  # no MFU (e.g. an unknown peak)
    _metrics(etcd, g, 1, 4)  # a worker that reports neither
    ctrl.drain()
    assert [(m.mfu, m.peak_memory_mib) for m in store.metrics("job-ft")][2:] == [
        (None, (13000.0, None)),
        (None, None),
    ]
    assert (p.step, p.mfu, p.peak_memory_mib) == (4, None, [13000.0, None])
    assert store.status("job-ft").peak_memory_mib == (13000.0, None)


def test_a_failed_rank_keeps_its_error_and_gets_its_exit_status(ctrl, etcd, store) -> None:
    request = JoinRequest(id="r1", world=2, nodes=["a:1", "b:2"], pids=[100, 101])
    etcd.put(keys.join("job-ft"), request.model_dump_json())
    g = ctrl.answer_join().generation
    _ = [_register(etcd, g, r, ttl=5) for r in (0, 1)]
    ctrl.tick()
    _report(etcd, g, 1, "failed", error="ValueError: bad batch", phase="train")
    ctrl.tick()
    etcd.put(
        keys.exit_report("job-ft", "b", 101),
        WorkerExit(pid=101, host="b", exit_code=1).model_dump_json(),
    )
    _report(etcd, g, 0, "aborted", seq=1, why="the controller aborted the generation")
    ctrl.tick()
    w0, w1 = store.workers("job-ft")
    assert (w1.state, w1.exit_code, w1.signal) == ("failed", 1, None)
    assert (w1.detail, w1.lease) == ("ValueError: bad batch", "released")
    assert (w0.state, w0.lease) == ("aborted", "released")
    assert w0.detail == "the controller aborted the generation"


def test_a_graceful_leave_ends_every_rank_as_left(ctrl, etcd, store) -> None:
    _join(etcd, 2, ["a:1", "b:2"])
    g = ctrl.answer_join().generation
    _report(etcd, g, 0, "leaving", ranks=[1], step=7)
    ctrl.tick()
    assert _rows(store, "state", "lease", "detail") == [
        ("left", "released", "re-formed without [1]; checkpointed at step 7"),
        ("left", "released", "asked to leave (SIGTERM); checkpointed at step 7"),
    ]
    assert _rows(store, "node", "pid") == [("a:1", None), ("b:2", None)]  # no pids named


def test_a_graceful_leave_is_a_re_formation_not_a_loss(ctrl, etcd, store) -> None:
    # the leavers' keys go with their leases; the agents re-form without rank 1
    _join(etcd, 2, ["a:1", "b:2"])
    g = ctrl.answer_join().generation
    leases = [_register(etcd, g, r, ttl=5) for r in (0, 1)]
    ctrl.tick()
    _report(etcd, g, 0, "leaving", ranks=[1], step=7)
    ctrl.tick()
    for lease in leases:
        lease.revoke()
    _join(etcd, 1, ["a:1"])
    assert ctrl.answer_join().generation == g + 1
    ctrl.tick()
    assert _ends(store) == {}  # nobody lost, nobody died
    first = store.generations("job-ft")[0]
    assert first.reason == "re-formed: rank(s) [1] asked to leave (step 7)"


def test_a_restarted_controller_keeps_the_worker_rows(ctrl, etcd, store) -> None:
    request = JoinRequest(id="r1", world=2, nodes=["a:1", "b:2"], pids=[100, 101])
    etcd.put(keys.join("job-ft"), request.model_dump_json())
    g = ctrl.answer_join().generation
    _ = [_register(etcd, g, r, ttl=5) for r in (0, 1)]
    ctrl.tick()
    _started(etcd, g, 0, "a", time=1000.0)
    ctrl.tick()
    before = store.workers("job-ft")
    successor = Controller(store, etcd, "job-ft")
    assert successor.attach()
    assert store.workers("job-ft") == before  # re-added rows are the same rows
    with _worker_updates(store) as watched:
        successor.check_workers()
    assert watched == []  # it knows what was written: leases already held
    _started(etcd, g, 1, "b", seq=0, time=1001.0)
    successor.tick()
    assert _rows(store, "state") == [("running",), ("running",)]

    # rows a controller did not get to write (e.g. it died first) are written on attach
    with store._engine.begin() as conn:
        conn.execute(text("DELETE FROM workers"))
    assert Controller(store, etcd, "job-ft").attach()
    assert _rows(store, "rank", "node", "pid", "state") == [
        (0, "a:1", 100, "assigned"),
        (1, "b:2", 101, "assigned"),
    ]


def test_a_worker_names_the_file_its_stdout_goes_to(tmp_path: Path) -> None:
    script = (
        "import sys; from trainer.process import stdout_log; print(stdout_log(), file=sys.stderr)"
    )
    log = tmp_path / "workers-n0.log"
    with log.open("w") as out:
        to_file = subprocess.run([sys.executable, "-c", script], cwd=REPO, stdout=out,
                                 stderr=subprocess.PIPE, text=True, check=True)  # fmt: skip
    to_pipe = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                             text=True, check=True)  # fmt: skip
    assert to_file.stderr.strip() == str(log)
    assert to_pipe.stderr.strip() == "None"


def test_a_refused_rendezvous_state_becomes_an_event(
    ctrl: Controller, etcd: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's rendezvous backend reports a state it refused (orchestrator/rendezvous/,
    "Trust"); the controller records it once, in the store, and drops the key."""
    from pipetransformer.core.protocol import RendezvousRefused
    from pipetransformer.orchestrator.controller import reports

    monkeypatch.setattr(reports, "ALERT_POLL_S", 0.0)  # every drain looks (1 s otherwise)

    alert = RendezvousRefused(
        run_id="job-ft-rdzv",
        key="/pipetransformer/rdzv/job-ft-rdzv/state",
        reason="not signed",
        host="node-a",
        pid=812,
    )
    etcd.put(keys.alert("job-ft", "node-a", 812), alert.model_dump_json())
    etcd.put(keys.alert("job-ft", "node-b", 9), "not json")
    ctrl.drain()
    ctrl.drain()
    (event,) = [e for e in ctrl.store.events("job-ft") if e.kind == "rendezvous_refused"]
    assert "pid 812 on node-a refused the rendezvous state" in event.message
    assert event.data["reason"] == "not signed"
    assert etcd.get_prefix(keys.alerts("job-ft")) == []


def test_etcd_not_answering_the_pods_count_is_ridden_out_while_supervising(
    store: Store, etcd_factory, tmp_path: Path
) -> None:
    """The controller role asks etcd how many trainer pods are present before every tick
    (`TrainerPods.poll`); etcd not answering within the client's retries (an overloaded or
    restarting etcd) is an outage the controller waits out and records, not the job's end; so
    is it while the controller waits for the pods' launchers to leave after the end."""
    import threading

    from pipetransformer.orchestrator.roles import TrainerPods

    server = etcd_factory()
    with EtcdClient(server.endpoint, retry_timeout=0.3, timeout=0.3) as etcd:
        ctrl = Controller.create(store, etcd, _spec(), tmp_path, "job-ft")
        ctrl.publish("job-ft-rdzv")
        # no pod ever comes: once etcd answers again, the pods are given up on (exit 1)
        pods = TrainerPods(ctrl, etcd, join_timeout=2.0)
        outcome: dict[str, object] = {}

        def supervise() -> None:
            try:
                outcome["code"] = ctrl.supervise(pods.poll, interval=0.05)
            except Exception as exc:  # what the controller process would die of
                outcome["error"] = exc

        server.stop()
        thread = threading.Thread(target=supervise, daemon=True)
        thread.start()
        time.sleep(3.0)  # several polls' retries spent
        assert thread.is_alive(), outcome
        server.start()
        thread.join(timeout=30)
        assert outcome == {"code": 1}
        # after the end, waiting for the launchers to leave outlives etcd not answering too
        server.stop()
        began = time.monotonic()
        pods.close()
        assert time.monotonic() - began < 10.0
    recovered = [e for e in store.events("job-ft") if e.kind == "control_plane_recovered"]
    assert recovered and "answered again after" in recovered[0].message


def _answered(
    etcd: EtcdClient,
    generation: int,
    request: dict,
    seq: int,
    step: int,
    previous: int,
    outcome: str,
) -> None:
    """Rank 0's report of a decision point at `step` that answered `request` (layers=2) with
    `outcome`: applied as a manual freeze, or superseded by the automatic decision."""
    _report(etcd, generation, 0, "freeze", seq=seq, step=step, previous=previous, boundary=2,
            source="manual" if outcome == "applied" else "auto", reason="decision",
            request=request, outcome=outcome, outcome_reason=f"layers=2 {outcome}")  # fmt: skip


def test_a_freeze_request_answered_before_the_controller_read_it_is_audited_first(
    ctrl: Controller, etcd: EtcdClient, store: Store
) -> None:
    """A request filed and answered between two of the controller's reads of its key (a busy
    controller: the live dashboard test saw its fate recorded and not its filing) is recorded
    as filed, then as applied, once."""
    request = {"id": "q3", "layers": 2, "who": "alice (dashboard)", "reason": "r", "time": 0.0}
    _join(etcd, 2, ["a:1", "b:2"])
    a = ctrl.answer_join()
    _answered(etcd, a.generation, request, seq=0, step=40, previous=0, outcome="applied")
    ctrl.tick()
    ctrl.tick()
    kinds = [e.kind for e in sorted(store.events("job-ft"), key=lambda e: e.id)]
    assert [k for k in kinds if k in ("freeze_requested", "freeze_applied")] == [
        "freeze_requested",
        "freeze_applied",
    ]
    (filed,) = store.events("job-ft", kinds=["freeze_requested"])
    assert filed.data["request"]["who"] == "alice (dashboard)"


def test_retiring_an_answered_request_leaves_a_newer_one_filed_since(
    ctrl: Controller, etcd: EtcdClient, store: Store
) -> None:
    """A second answer to a request (a decision point that read it again before it was retired)
    reaches the controller after a newer request was filed in the freed key: the newer one is
    not retired with it, unapplied and unaudited; it waits for the next decision point."""
    first = {"id": "q4", "layers": 2, "who": "ana@lab", "reason": "converged", "time": 0.0}
    newer = {"id": "q5", "layers": 3, "who": "bo@lab", "reason": "also", "time": 1.0}
    key = keys.freeze_override("job-ft")
    etcd.put(key, json.dumps(first))
    _join(etcd, 2, ["a:1", "b:2"])
    a = ctrl.answer_join()
    _answered(etcd, a.generation, first, seq=0, step=40, previous=0, outcome="applied")
    ctrl.tick()
    assert etcd.get(key) is None  # the answered request retired
    assert etcd.put_if_absent(key, json.dumps(newer))  # what `pipetransformer freeze` does
    _answered(etcd, a.generation, first, seq=1, step=50, previous=2, outcome="superseded")
    ctrl.tick()
    assert json.loads(etcd.get(key) or "{}")["id"] == "q5"
    filed = [e.data["request"]["id"] for e in store.events("job-ft", kinds=["freeze_requested"])]
    assert sorted(filed) == ["q4", "q5"]


def test_a_freeze_request_read_again_before_it_was_retired_keeps_its_first_answer(
    ctrl: Controller, etcd: EtcdClient, store: Store
) -> None:
    """A decision point that comes before the controller retired an applied request reads it
    again and finds the boundary already there: that second answer is not the request's fate."""
    request = {"id": "q2", "layers": 2, "who": "ana@lab", "reason": "converged", "time": 0.0}
    etcd.put(keys.freeze_override("job-ft"), json.dumps(request))
    _join(etcd, 2, ["a:1", "b:2"])
    a = ctrl.answer_join()
    for seq, (step, previous, outcome) in enumerate([(40, 0, "applied"), (50, 2, "superseded")]):
        _answered(etcd, a.generation, request, seq, step, previous, outcome)
    ctrl.tick()
    fates = [e.kind for e in store.events("job-ft") if e.kind.startswith("freeze_") and
             e.kind != "freeze_requested"]  # fmt: skip
    assert fates == ["freeze_applied"]
    assert etcd.get(keys.freeze_override("job-ft")) is None


# -- the submission: what a spec points at is resolved once per job ------------------------------


@pytest.fixture
def resolutions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the specs resolved (orchestrator/sources.py), one entry per resolution:
    `resolve_submission` starts each one with `resolve_pretrained`, whoever called it."""
    from pipetransformer.orchestrator import sources

    seen: list[str] = []
    real = sources.resolve_pretrained

    def counted(spec: JobSpec, cwd: Path) -> JobSpec:
        seen.append(spec.name)
        return real(spec, cwd)

    monkeypatch.setattr(sources, "resolve_pretrained", counted)
    return seen


def test_run_resolves_the_spec_once(
    resolutions: list[str], etcd: EtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pipetransformer run` resolves what the spec points at before admission sizes the model,
    and `Controller.create` stores that resolution as it is: a second one would read the
    checkpoints again (a fine-tuning checkpoint is hashed whole to pin it)."""
    from pipetransformer.orchestrator import cli
    from tests.fixtures_run import write_spec

    created: list[str] = []

    def no_workers(ctrl: Controller, *_: object) -> str:  # the job created, then ended at once
        created.append(ctrl.job_id)
        return ctrl.finish(0)

    monkeypatch.setattr(cli, "job_etcd", lambda *_, **__: contextlib.nullcontext(etcd))
    monkeypatch.setattr(cli, "train_here", no_workers)
    spec = write_spec(tmp_path / "spec.yaml")
    cli.main(["run", str(spec), "--workdir", str(tmp_path / "runs"), "--job-id", "once"])
    assert created == ["once"]
    assert resolutions == ["tiny"]


def test_the_controller_role_resolves_a_new_jobs_spec_once(
    resolutions: list[str], etcd: EtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchx controller role reads its spec unresolved (it may be continuing its job):
    `Controller.create` resolves a new job's, once; a restarted role finds the job and resolves
    nothing."""
    from pipetransformer.orchestrator import cli
    from tests.fixtures_run import write_spec

    class NoPods:  # trainer pods that never came
        def __init__(self, *_: object) -> None:
            pass

        def poll(self) -> int:
            return 1

        def detail(self, code: int | None) -> str:
            return ""

        def close(self) -> None:
            pass

    monkeypatch.setattr(cli, "job_etcd", lambda *_, **__: contextlib.nullcontext(etcd))
    monkeypatch.setattr(cli, "TrainerPods", NoPods)
    spec = write_spec(tmp_path / "spec.yaml")
    argv = ["controller", str(spec), "--workdir", str(tmp_path / "runs"), "--job-id", "role"]
    sigterm = signal.getsignal(signal.SIGTERM)  # the role installs its own handler
    try:
        for _ in range(2):  # a new job, then the role restarted
            cli.main(argv)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert resolutions == ["tiny"]


def test_create_resolves_only_what_is_not_resolved_yet(
    resolutions: list[str], store: Store, etcd: EtcdClient, tmp_path: Path
) -> None:
    """A spec handed to `Controller.create` as read is resolved there; a `Submission` was
    resolved when `submit` made it, and is stored as it is."""
    Controller.create(store, etcd, _spec(), tmp_path, "job-read")
    assert resolutions == ["ft"]
    submission = submit(_spec())
    assert submit(submission) is submission and resolutions == ["ft", "ft"]
    Controller.create(store, etcd, submission, tmp_path, "job-submitted")
    assert resolutions == ["ft", "ft"]
    assert store.get_job("job-submitted").spec == submission.spec
