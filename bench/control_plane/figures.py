"""Samples into a row's figures: percentiles (`_dist`), the calls a size should make in its window
(`_expected_calls`), the rendezvous's figures from the participants' timestamps and two etcd
scrapes (`_rendezvous_figures`), and the clients' figures from what the host processes counted:
latency per call kind, calls made / due, their CPU (`_client_figures`)."""

from __future__ import annotations

from typing import Any

from pipetransformer.core.state import Layout
from pipetransformer.edge.etcd_client import EtcdClient

from .config import ABORT_POLL_S, MONITOR_S, Config
from .etcd_metrics import _by, _total


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _dist(values: list[float], scale: float = 1.0, digits: int = 2) -> dict[str, float | None]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v * scale, digits)

    return {
        "p50": r(_pct(values, 0.5)),
        "p95": r(_pct(values, 0.95)),
        "max": r(max(values) if values else None),
    }


def _expected_calls(
    n: int, layout: Layout, conf: Config, span: float, agents: bool = True
) -> dict[str, float]:
    reporters = layout.replicas if conf.metrics_from == "replica" else 1
    return {
        "abort_poll": n * span / ABORT_POLL_S,
        "monitor": n * span / MONITOR_S if agents else 0.0,
        "heartbeat": n * span / conf.heartbeat(n) if agents else 0.0,
        "report": reporters * span * conf.step_hz,
    }


def _rendezvous_figures(
    row: dict[str, Any],
    prefix: str,
    parts: list[dict[str, Any]],
    n: int,
    m0: dict[str, float],
    m1: dict[str, float],
    client: EtcdClient,
    run_id: str,
) -> None:
    """A rendezvous phase's figures under `prefix` ("rendezvous", "rerendezvous"): `n` nodes
    expected back, each part's t0 (start) and t_rdzv / t_assigned (back, ranks assigned)."""
    from pipetransformer.orchestrator.rendezvous import state_key

    start = min(p["t0"] for p in parts)
    done = [p for p in parts if "t_rdzv" in p]
    assigned = [p for p in parts if "t_assigned" in p]
    complete = len(done) == n
    row[f"{prefix}_completed"] = complete and len(assigned) == n
    row[f"{prefix}_s"] = round(max(p["t_rdzv"] for p in done) - start, 3) if complete else None
    ranks_key = "ranks_assigned_s" if prefix == "rendezvous" else f"{prefix}_ranks_assigned_s"
    row[ranks_key] = (
        round(max(p["t_assigned"] for p in assigned) - start, 3) if len(assigned) == n else None
    )
    row[f"{prefix}_participant_s"] = _dist([p["t_rdzv"] - p["t0"] for p in done], 1.0, 3)
    # the slowest back, and where the last of each host were while the others were back
    row[f"{prefix}_last"] = [
        {
            "rank": p.get("rank"),
            "s": round(p["t_rdzv"] - p["t0"], 3),
            "late_at": p["late_at"][1] if "late_at" in p else None,
            "late_for_s": round(p["t_rdzv"] - p["late_at"][0], 3) if "late_at" in p else None,
        }
        for p in sorted(done, key=lambda p: p["t_rdzv"])[-3:]
    ]
    row[f"{prefix}_rounds"] = sorted({p["round"] for p in done})
    row[f"{prefix}_joined"] = len(done)
    txn0 = _by(m0, "grpc_server_started_total", "grpc_method").get("Txn", 0.0)
    txn1 = _by(m1, "grpc_server_started_total", "grpc_method").get("Txn", 0.0)
    requests = int(
        _total(m1, "grpc_server_started_total") - _total(m0, "grpc_server_started_total")
    )
    row[f"{prefix}_etcd_requests"] = requests
    row[f"{prefix}_etcd_requests_per_agent"] = round(requests / max(n, 1), 1)
    row[f"{prefix}_etcd_txns"] = int(txn1 - txn0)
    received = "etcd_network_client_grpc_received_bytes_total"
    sent = "etcd_network_client_grpc_sent_bytes_total"
    row[f"{prefix}_etcd_mb_in"] = round((_total(m1, received) - _total(m0, received)) / 1e6, 2)
    row[f"{prefix}_etcd_mb_out"] = round((_total(m1, sent) - _total(m0, sent)) / 1e6, 2)
    try:
        blob = client.get(state_key(run_id))
        row[f"{prefix}_state_bytes"] = None if blob is None else len(blob) * 3 // 4
    except Exception:
        row[f"{prefix}_state_bytes"] = None


def _backend_figures(
    row: dict[str, Any],
    prefix: str,
    counts: list[dict[str, int]],
    n: int,
    seconds: float | None = None,
) -> None:
    """The agents' rendezvous backends' own counts for a phase (requests, bytes, heartbeats,
    state writes and the changes they carried ...), summed, and per agent (per second); a
    maximum (`..._max_ms`, since the host started) is the largest of the hosts'."""
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            merge = max if k.endswith("_max_ms") else int.__add__
            total[k] = merge(total.get(k, 0), int(v))
    row[f"{prefix}_backend"] = dict(sorted(total.items()))
    per = float(max(n, 1)) * (seconds if seconds else 1.0)
    suffix = "_per_agent_s" if seconds else "_per_agent"
    row[f"{prefix}_backend_requests{suffix}"] = round(total.get("requests", 0) / per, 3)
    row[f"{prefix}_backend_kb{suffix}"] = round(
        (total.get("bytes_in", 0) + total.get("bytes_out", 0)) / 1e3 / per, 2
    )


def _client_figures(
    row: dict[str, Any],
    stats: dict[int, dict[str, Any]],
    n: int,
    layout: Layout,
    conf: Config,
    span: float,
    cpu: dict[str, Any],
) -> None:
    ops: dict[str, dict[str, Any]] = {}
    for s in stats.values():
        for op, o in s["ops"].items():
            m = ops.setdefault(op, {"count": 0, "ok": 0, "lat": []})
            m["count"] += o["count"]
            m["ok"] += o["ok"]
            m["lat"].extend(o["lat"])
    expected = _expected_calls(n, layout, conf, span, row["rendezvous_completed"])
    row["client_ms"] = {op: _dist(ops[op]["lat"], 1e3) for op in expected if op in ops}
    row["achieved"] = {
        op: round(ops.get(op, {"count": 0})["count"] / due, 3)
        for op, due in expected.items()
        if due
    }
    row["reports_per_s"] = round(ops.get("report", {"count": 0})["count"] / span, 1)
    least = [s["min_participants"] for s in stats.values() if s["min_participants"] is not None]
    # the participants' own synced views (torch prunes stale heartbeats locally on every sync)
    row["rdzv_view_participants_min"] = min(least) if least else None
    secs = [s["cpu_s"] / s["cpu_window_s"] for s in stats.values() if s.get("cpu_s") is not None]
    cpu["agents"] = round(sum(secs), 3) if secs else None
    row["host_threads"] = [s["threads"] for s in stats.values()]
