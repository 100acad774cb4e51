"""bench/control_plane_scale.py kept from rotting: four simulated torchrun agents (two host
processes) rendezvous through the etcd3 backend, hold their leases and report to a real
controller for a few seconds, and the benchmark's result carries every figure with sane values.
Timings are not asserted (2 shared cores); only that things happened and were counted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import control_plane_scale as cps  # noqa: E402


@pytest.mark.slow
def test_four_participants_rendezvous_report_and_reach_the_store(tmp_path: Path) -> None:
    conf = cps.Config(
        sizes=[4],
        hosts=2,
        seconds=3.0,
        warmup=1.0,
        join_timeout=60,
        startup_timeout=120.0,
        phase_timeout=60.0,
    )
    png = tmp_path / "control_plane_scale.png"
    result = cps.run(conf, png)
    line = json.loads(json.dumps(result))  # what `emit` prints as the last line
    assert line["benchmark"] == "control_plane_scale" and line["sizes"] == [4]
    for key in ("rendezvous_s", "etcd_requests_per_s", "store_rows_per_s", "drain_ms_p95"):
        assert len(line[key]) == 1, key
    assert isinstance(line["breaks_first_sentence"], str) and line["breaks_first_sentence"]
    assert line["environment"]["cpus"] >= 1
    assert png.stat().st_size > 0

    (row,) = line["rows"]
    assert row["ok"] and row["failed_phase"] is None, row["error"]
    assert row["problems"] == [], row["problems"]  # no lapsed lease, abort, dropped node ...
    # the rendezvous completed: one round, every rank, and the controller answered the join
    assert row["rendezvous_completed"] and row["rendezvous_rounds"] == [0]
    assert row["rendezvous_joined"] == 4 and row["rdzv_participants_end"] == 4
    assert row["rendezvous_s"] > 0 and row["ranks_assigned_s"] >= row["rendezvous_s"]
    assert row["rendezvous_etcd_txns"] > 0 and row["rendezvous_state_bytes"] > 0
    # what the hosts' garbage collector took of it (a host runs many nodes in one heap)
    assert row["rendezvous_backend"]["host_gc_ms"] >= 0
    assert row["rendezvous_backend"]["host_gc_full"] >= 0
    assert row["join_answer_s"] > 0 and row["layout"] == "2 x 2"
    # etcd served the steady state: polls, reports, deletes, keep-alives
    assert row["etcd_requests_per_s"] > 0 and row["etcd_writes_per_s"] > 0
    # reads and report puts. Not asserted: the drain's Txn (a 3 s window may hold no drain),
    # and LeaseKeepAlive, which etcd counts once per stream and a shared stream lives 30 s
    assert {"Range", "Put"} <= set(row["etcd_requests_by_method"])
    # every simulated call kind happened
    assert set(row["achieved"]) == {"abort_poll", "monitor", "heartbeat", "report"}
    assert all(v > 0 for v in row["achieved"].values()), row["achieved"]
    # the controller drained reports into the store
    assert row["drains"] > 0 and row["drain_ms"]["p95"] is not None
    assert row["events_drained"] > 0 and row["report_age_s"]["max"] is not None
    assert row["store_rows_written"] > 0 and row["store_rows_per_s"] > 0
    assert row["store_metric_rows"] > 0
    assert row["cpu_cores"]["etcd"] is not None and row["cpu_cores"]["agents"] is not None
    # the controller's memory at N: what its process grew by (Linux's /proc)
    assert isinstance(row["controller_rss_growth_mib"], float)
    assert line["controller_rss_growth_mib"] == [row["controller_rss_growth_mib"]]


def test_what_breaks_first_is_the_first_size_with_a_problem() -> None:
    def row(n: int, **kw: object) -> dict:
        return (
            {"participants": n, "failed_phase": None, "error": None, "problems": []}
            | {"degraded": []}
            | kw
        )

    rows = [
        row(8),
        row(16, degraded=[{"kind": "calls_late", "detail": "late"}]),
        row(64, problems=[{"kind": "presence_lease_expired", "count": 2, "detail": "lapsed"}]),
        row(256, failed_phase="rendezvous", error="rendezvous: timed out"),
    ]
    first, sentence = cps._breaks_first(rows)
    assert first == {"participants": 64, "what": ["presence_lease_expired"], "error": None}
    assert "N=64" in sentence and "N=16" in sentence  # the degradation came earlier
    assert cps._breaks_first([row(8)]) == (None, "Nothing failed up to N=8.")


def test_prometheus_counters_are_summed_by_label() -> None:
    m = {
        'grpc_server_started_total{grpc_method="Range",grpc_type="unary"}': 10.0,
        'grpc_server_started_total{grpc_method="Txn",grpc_type="unary"}': 4.0,
        'grpc_server_handled_total{grpc_code="OK",grpc_method="Range"}': 9.0,
        "process_cpu_seconds_total": 1.5,
    }
    assert cps._total(m, "grpc_server_started_total") == 14.0
    assert cps._by(m, "grpc_server_started_total", "grpc_method") == {"Range": 10.0, "Txn": 4.0}
    assert cps._total(m, "process_cpu_seconds_total") == 1.5


def test_host_processes_grow_with_the_participants_unless_set() -> None:
    """One host process per 128 simulated nodes, at least 4 and at most one per node: 256
    nodes' threads behind one interpreter lock starved a live node's lease past its TTL."""
    conf = cps.Config()
    assert [conf.hosts_for(n) for n in (2, 8, 512, 1024, 2048)] == [2, 4, 4, 8, 16]
    assert cps.Config(hosts=3).hosts_for(1024) == 3 and cps.Config(hosts=3).hosts_for(2) == 2


def test_a_node_whose_view_dropped_participants_is_named_with_what_it_knew() -> None:
    """A node that finishes a round with fewer participants than stored (torch's `_sanitize`
    took out nodes whose alive keys it did not hold) makes the inconsistency say which nodes and
    why, not only that the worlds differ."""
    from datetime import UTC, datetime, timedelta

    from control_plane.judge import _round_problem
    from control_plane.simulate import _view_apart
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousSettings,
        RendezvousTimeout,
        _NodeDesc,
        _RendezvousState,
    )

    from pipetransformer.orchestrator.rendezvous import (
        EtcdRendezvousBackend,
        encode_state,
        sign_state,
    )

    nodes = [_NodeDesc("10.0.0.1", 100, i) for i in range(3)]
    stored = _RendezvousState()
    stored.participants = {n: i for i, n in enumerate(nodes)}
    stored.last_heartbeats = dict.fromkeys(nodes, datetime.now(UTC) - timedelta(seconds=40))
    stored.complete = True
    secret = b"s" * 32
    backend = EtcdRendezvousBackend(None, "run", secret)  # fed by hand: no etcd
    settings = RendezvousSettings("run", 3, 3, RendezvousTimeout(), timedelta(seconds=5), 3)
    backend.bind(nodes[0], settings)
    backend._follower.set_stored(sign_state(secret, backend.key, encode_state(stored)), 5, 1)
    backend._leases.alive = {nodes[0], nodes[1]}
    view = backend._follower.overlaid(backend._follower.stored())
    assert _view_apart(backend, view) is None  # the same round: nothing to say

    del view.participants[nodes[2]]  # what the sanitize of this view does
    said = _view_apart(backend, view)
    assert said is not None and said.startswith("stored 3, view 2, knew 2 alive")
    assert "10.0.0.1:100:2 (alive key not held, stored beat 40" in said
    parts = [
        {"rank": 0, "world": 2, "round": 0, "view_apart": said},
        {"rank": 1, "world": 3, "round": 0},
        {"rank": 2, "world": 3, "round": 0},
    ]
    problem = _round_problem(parts, 3, 3)
    assert problem is not None and "1 saw 2, 2 saw 3" in problem and said in problem
    assert _round_problem([{**p, "world": 3} for p in parts], 3, 3) is None


def test_a_hosts_garbage_collector_is_timed_and_its_full_collections_counted() -> None:
    import gc

    from control_plane.hosts import _GcClock

    clock = _GcClock()
    try:
        mark = clock.mark()
        gc.collect()  # a full collection
        gc.collect(0)  # a young one: timed, not counted as full
        spent = clock.since(mark)
        assert spent["host_gc_full"] == 1
        assert spent["host_gc_ms"] >= 0 and clock.ms > mark[0]
    finally:
        gc.callbacks.remove(clock._note)
