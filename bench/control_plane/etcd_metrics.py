"""etcd's Prometheus metrics: `scrape` reads /metrics on its client URL, `_total` and `_by` sum a
counter (by a label), and `_etcd_window` turns two scrapes into the steady window's etcd figures:
requests/s by method, raft writes/s, MVCC operations, error codes, CPU, network, fsync, db size."""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from typing import Any

_LABEL = re.compile(r'(\w+)="([^"]*)"')


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    """etcd's Prometheus text (`/metrics` on its client URL) as {'name{labels}': value}."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def _series(m: dict[str, float], name: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for key, value in m.items():
        base, _, labels = key.partition("{")
        if base == name:
            out.append((dict(_LABEL.findall(labels)), value))
    return out


def _total(m: dict[str, float], name: str) -> float:
    return sum(v for _, v in _series(m, name))


def _by(m: dict[str, float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for labels, value in _series(m, name):
        out[labels.get(label, "")] += value
    return dict(out)


def _etcd_window(m0: dict[str, float], m1: dict[str, float], span: float) -> dict[str, Any]:
    def rate(name: str) -> float:
        return round((_total(m1, name) - _total(m0, name)) / span, 1)

    started0 = _by(m0, "grpc_server_started_total", "grpc_method")
    started1 = _by(m1, "grpc_server_started_total", "grpc_method")
    by_method = {
        k: round((v - started0.get(k, 0.0)) / span, 1)
        for k, v in sorted(started1.items(), key=lambda kv: -kv[1])
        if v - started0.get(k, 0.0) > 0
    }
    codes0 = _by(m0, "grpc_server_handled_total", "grpc_code")
    codes1 = _by(m1, "grpc_server_handled_total", "grpc_code")
    errors = {
        k: int(v - codes0.get(k, 0.0))
        for k, v in codes1.items()
        if k != "OK" and v - codes0.get(k, 0.0) > 0
    }
    fsyncs = _total(m1, "etcd_disk_wal_fsync_duration_seconds_count") - _total(
        m0, "etcd_disk_wal_fsync_duration_seconds_count"
    )
    fsync_s = _total(m1, "etcd_disk_wal_fsync_duration_seconds_sum") - _total(
        m0, "etcd_disk_wal_fsync_duration_seconds_sum"
    )
    mb = 1e6
    return {
        "etcd_requests_per_s": rate("grpc_server_started_total"),
        "etcd_requests_by_method": by_method,
        "etcd_writes_per_s": rate("etcd_server_proposals_committed_total"),
        "etcd_mvcc_per_s": {
            op: rate(f"etcd_mvcc_{op}_total") for op in ("range", "put", "txn", "delete")
        },
        "etcd_error_codes": errors,
        "etcd_cpu_cores": round(
            (_total(m1, "process_cpu_seconds_total") - _total(m0, "process_cpu_seconds_total"))
            / span,
            3,
        ),
        "etcd_rx_mb_per_s": round(rate("etcd_network_client_grpc_received_bytes_total") / mb, 3),
        "etcd_tx_mb_per_s": round(rate("etcd_network_client_grpc_sent_bytes_total") / mb, 3),
        "etcd_fsync_ms_mean": round(1e3 * fsync_s / fsyncs, 3) if fsyncs else None,
        "etcd_slow_applies": int(
            _total(m1, "etcd_server_slow_apply_total") - _total(m0, "etcd_server_slow_apply_total")
        ),
        "etcd_db_mb": round(_total(m1, "etcd_mvcc_db_total_size_in_bytes") / mb, 2),
    }
