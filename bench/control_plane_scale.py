"""Control plane at cluster size: N simulated torchrun agents + workers against one etcd and a
real controller, for N in --sizes (default 8, 16, 64, 256).

    .venv/bin/python bench/control_plane_scale.py [--sizes 8,16,64,256] [--seconds 20]
        [--hosts K] [--step-hz 2] [--metrics-from replica|loss-owner] [--store sqlite|postgresql]
        [--no-fsync] [--join-timeout 240] [--heartbeat-s 1] [--no-rejoin]

What runs, per size (a fresh embedded etcd, store and controller each time):

- **The controller**: a real `Controller` (`create`, `publish`, `acquire` with its lease), its
  own `supervise` loop (drain -> answer_join -> check_workers every 0.1 s), writing a real store
  (SQLite file, or a throwaway PostgreSQL with `--store postgresql`).
- **N participants**, each one torchrun agent with one worker (`--nproc-per-node 1`), simulated
  as threads: `--hosts` processes (spawned; default one per 128 participants, at least 4)
  each run N/hosts participants. 256 real
  torchrun agents plus 256 worker processes do not fit 2 cores (a process with torch imported
  is ~300 MB and seconds of CPU to start), but the control plane only sees their etcd traffic,
  and that is made by the project's own code:
    agent:  `orchestrator.rendezvous.create_etcd3_handler` with the project's torchrun settings
            (`orchestrator.launch`: N-1:N nodes, 1 s heartbeats, 3 missed); its
            `next_rendezvous()` and torchrun's own worker-rank assignment through the
            rendezvous store (`SimpleElasticAgent._assign_worker_ranks`); then, as torchrun's
            monitor loop does every `--monitor-interval` (0.2 s), `num_nodes_waiting()`; and the
            launcher's presence key (`keys.agents`, lease 10 s, as `pipetransformer workers`).
    worker: rank 0 files the `JoinRequest` and polls for the `Assignment` (as `process.join`);
            every rank holds its presence key (`process.hold_presence`, lease
            `runtime.lease_ttl_s`), polls `keys.abort` every 0.2 s (as `AbortWatch`), reports
            `Started` once through the worker's `Reporter`; the last stage of every replica
            (`--metrics-from replica`; `loss-owner`: only replica 0's, as the real worker does)
            reports `Metrics` at `--step-hz` steps/s.
  What is not simulated: the workers' gloo/TCPStore traffic (never touches etcd) and training.
  What is shared: a host's simulated agents use one etcd connection and its workers another
  (etcd sees every request a real node makes, over 2 connections per host instead of 2 per
  node), and 16 threads per host run every node's polls and reports: 1,024 nodes' gRPC
  channels and threads on 2 cores starve one another, which real nodes, each with its own
  CPU, do not.

Measured per size:

    rendezvous_s          first participant calling next_rendezvous() -> the last one back
                          (all in the same round, world N); ranks_assigned_s adds torchrun's
                          rank assignment; join_answer_s: JoinRequest -> Assignment (controller);
                          rdzv_progress: [s, participants, waiting, complete (1)] read
                          from etcd while it ran; rendezvous_etcd_requests (_per_agent),
                          _txns, _mb_in / _mb_out: what
                          it cost etcd; rendezvous_backend: the agents' backends' own counts
                          (requests, bytes, lease refreshes, state writes and the changes
                          they carried: orchestrator.rendezvous, "Scale")
    rerendezvous_s        after the steady window the last rank's agent is lost (its
                          heartbeats stop, as when its node dies) and the N-1 others call
                          next_rendezvous() at once, as torchrun does when their workers fail:
                          the loss -> the last survivor back in a new round of N-1 (this
                          includes noticing the loss: heartbeat interval x missed); the same
                          rerendezvous_* figures as the rendezvous's
    etcd_requests_per_s   gRPC requests etcd started (its /metrics, grpc_server_started_total)
                          per second over the steady window (--seconds, after --warmup), by
                          method; etcd_writes_per_s: raft proposals committed per second;
                          etcd_requests_per_agent_s: per participant (agent + worker), which
                          must stay flat as N grows; steady_backend_requests_per_agent_s: the
                          rendezvous backend's share (heartbeats, monitor reads)
    store_rows_per_s      rows the controller inserted/updated/deleted per second (SQLAlchemy
                          cursor row counts), with statements and commits per second
    drain_ms              how long one `Controller.drain()` takes (p50/p95/max) and report_age_s,
                          how old a report is when it lands in the store
    client_ms, achieved   per-participant call latency, and calls made / calls due (1.0: every
                          poll and report on time)
    cpu_cores             CPU used by etcd, the simulated agents and the controller's process,
                          and how busy the whole machine was (others share these cores)
    controller_rss_growth_mib  what the controller's process grew by from the controller's
                          creation to the steady window's end (its records of the run included:
                          an upper bound on what the controller needs at N)
    problems, degraded    what failed (a rendezvous that timed out, an unanswered join, a
                          lapsed lease, an aborted generation, rendezvous heartbeats that failed,
                          nodes dropped from the round, etcd errors, controller errors) and what
                          degraded (polls late, reports older than 1 s, controller busy > 80 %)

Every wait is bounded; a size that fails records where and why, and the run goes on. A size
whose rendezvous fails (`--join-timeout`) is still measured in steady state with ranks handed
out by the benchmark (`failed_phase: "rendezvous"`; no torchrun heartbeats or monitor polls
then, so its etcd figures lack the agents' share), so the controller's side at that size is
known too. The rendezvous heartbeat is the project's for N nodes (orchestrator/launch.py: 1 s
up to 64 nodes, torch's 5 s beyond); `--heartbeat-s S` sets it for every size; `--no-rejoin` skips the re-rendezvous (and runs the
rendezvous with min = max = N nodes). Progress lines while it runs; the last line is one
JSON object (`breaks_first` and a sentence saying what broke first); the plot is
bench/out/control_plane_scale.png (figures vs participants, log x, and the rendezvous's
progress over time), the JSON also bench/out/control_plane_scale.json.

How to read it: everything shares 2 slow cores with etcd itself (and with other work), so the
absolute rates are what this machine sustains, not etcd's ceiling; `cpu_cores` and `achieved`
say whether the simulators, the controller or etcd ran out first. The load per participant is
fixed, so requests/s should grow linearly with N (per agent: flat). The rendezvous state is one
pickled blob of O(N) bytes; heartbeats are leases, changes are combined into few writes of it
and nodes follow it by deltas (orchestrator/rendezvous/, "Scale"), but every node still reads
the O(N) ones: the write that moves a whole wait list into a round, and the one with the ranks.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, environment, out_dir, progress  # noqa: E402
from control_plane.config import DEFAULT_SIZES, Config  # noqa: E402

# read from here by tests/test_control_plane_scale.py (cps._total, cps._by)
from control_plane.etcd_metrics import _by, _total  # noqa: E402, F401
from control_plane.judge import _breaks_first  # noqa: E402
from control_plane.measure import measure_size  # noqa: E402
from control_plane.plot import _plot  # noqa: E402
from control_plane.sql_store import _Postgres  # noqa: E402


def run(conf: Config, png: Path | None = None) -> dict[str, Any]:
    """Every size in turn; the result object (the JSON line)."""
    rows = []
    pg = _Postgres() if conf.store == "postgresql" else None
    try:
        for n in conf.sizes:
            t = time.monotonic()
            progress(f"N={n}: starting etcd, store ({conf.store}), controller")
            row = measure_size(n, conf, pg)
            row["seconds_total"] = round(time.monotonic() - t, 1)
            rows.append(row)
            if row.get("steady_measured"):
                progress(
                    f"N={n}: etcd {row['etcd_requests_per_s']} req/s, "
                    f"{row['etcd_writes_per_s']} writes/s; store {row['store_rows_per_s']} rows/s;"
                    f" drain p95 {row['drain_ms']['p95']} ms; problems "
                    f"{[p['kind'] for p in row['problems']] or 'none'}; degraded "
                    f"{[d['kind'] for d in row['degraded']] or 'none'} ({row['seconds_total']}s)"
                )
    finally:
        if pg is not None:
            pg.close()
    first, sentence = _breaks_first(rows)
    progress(sentence)

    def col(key: str, sub: str | None = None) -> list[Any]:
        out = []
        for r in rows:
            v = r.get(key)
            out.append(v.get(sub) if isinstance(v, dict) and sub else v)
        return out

    result: dict[str, Any] = {
        "benchmark": "control_plane_scale",
        "sizes": [r["participants"] for r in rows],
        "ok": col("ok"),
        "rendezvous_s": col("rendezvous_s"),
        "rerendezvous_s": col("rerendezvous_s"),
        "rendezvous_etcd_requests_per_agent": col("rendezvous_etcd_requests_per_agent"),
        "rerendezvous_etcd_requests_per_agent": col("rerendezvous_etcd_requests_per_agent"),
        "join_answer_s": col("join_answer_s"),
        "etcd_requests_per_s": col("etcd_requests_per_s"),
        "etcd_requests_per_agent_s": col("etcd_requests_per_agent_s"),
        "steady_backend_requests_per_agent_s": col("steady_backend_requests_per_agent_s"),
        "etcd_writes_per_s": col("etcd_writes_per_s"),
        "store_rows_per_s": col("store_rows_per_s"),
        "drain_ms_p95": col("drain_ms", "p95"),
        "controller_rss_growth_mib": col("controller_rss_growth_mib"),
        "report_age_s_p95": col("report_age_s", "p95"),
        "breaks_first": first,
        "breaks_first_sentence": sentence,
        "config": asdict(conf),
        "rows": rows,
    }
    if png is not None:
        try:
            _plot(rows, png, conf)
            result["png"] = str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) else str(png)
            progress(f"plot: {png}")
        except Exception as exc:  # a plot must not cost the measurement
            result["png_error"] = f"{type(exc).__name__}: {exc}"
    result["environment"] = environment()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="host processes (default: one per 128 participants, at least 4)",
    )
    parser.add_argument("--seconds", type=float, default=Config.seconds, help="steady window")
    parser.add_argument("--warmup", type=float, default=Config.warmup)
    parser.add_argument("--step-hz", type=float, default=Config.step_hz)
    parser.add_argument(
        "--metrics-from", choices=("replica", "loss-owner"), default=Config.metrics_from
    )
    parser.add_argument("--lease-ttl", type=int, default=Config.lease_ttl_s)
    parser.add_argument("--join-timeout", type=int, default=Config.join_timeout)
    parser.add_argument("--store", choices=("sqlite", "postgresql"), default=Config.store)
    parser.add_argument("--no-fsync", action="store_true", help="etcd without WAL fsync")
    parser.add_argument(
        "--heartbeat-s",
        type=int,
        default=Config.heartbeat_s,
        help="rendezvous keep_alive_interval (default: the project's for N, orchestrator.launch)",
    )
    parser.add_argument(
        "--no-rejoin",
        action="store_true",
        help="no re-rendezvous after one agent is lost (and min = max = N nodes)",
    )
    parser.add_argument("--rejoin-timeout", type=int, default=Config.rejoin_timeout)
    parser.add_argument(
        "--tag", default="", help="bench/out/control_plane_scale-TAG.json/.png (default: none)"
    )
    parser.add_argument(
        "--no-steady-without-rendezvous",
        action="store_true",
        help="a size whose rendezvous fails ends there",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 2:
        parser.error("--sizes: comma-separated participant counts, each at least 2")
    conf = Config(
        sizes=sizes,
        hosts=args.hosts,
        seconds=args.seconds,
        warmup=args.warmup,
        step_hz=args.step_hz,
        metrics_from=args.metrics_from,
        lease_ttl_s=args.lease_ttl,
        join_timeout=args.join_timeout,
        fsync=not args.no_fsync,
        store=args.store,
        heartbeat_s=args.heartbeat_s,
        steady_without_rendezvous=not args.no_steady_without_rendezvous,
        rejoin=not args.no_rejoin,
        rejoin_timeout=args.rejoin_timeout,
    )
    name = "control_plane_scale" + (f"-{args.tag}" if args.tag else "")
    result = run(conf, out_dir() / f"{name}.png")
    emit(result, save_as=f"{name}.json")


if __name__ == "__main__":
    main()
