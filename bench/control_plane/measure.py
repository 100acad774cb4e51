"""One size, phase by phase: a fresh embedded etcd, store and controller, the host processes
started, the rendezvous, the join answered, the steady window measured (etcd, store, controller,
clients, CPU), the end, and a re-rendezvous after one agent is lost. `measure_size` returns the
size's row and never raises for a failed phase: the row says where and why."""

from __future__ import annotations

import os
import queue
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from _common import process_memory, progress

from pipetransformer.core.state import Layout
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.orchestrator.controller import Controller
from pipetransformer.orchestrator.etcd_server import EmbeddedEtcd
from pipetransformer.orchestrator.launch import HEARTBEATS_MISSED
from pipetransformer.store import Store, sqlite_url

from .config import JOB, Config, PhaseFailed, job_spec
from .controller_loop import ControllerLoop
from .etcd_metrics import _etcd_window, scrape
from .figures import _backend_figures, _client_figures, _rendezvous_figures
from .hosts import Hosts
from .judge import _client_problems, _judge, _round_problem
from .rdzv_watch import RdzvWatch
from .sql_store import StoreCounter, _Postgres


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            parts = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
    return sum(parts) - idle, sum(parts)


def measure_size(n: int, conf: Config, pg: _Postgres | None = None) -> dict[str, Any]:
    """One size: returns its row (figures, problems); never raises for a failed phase."""
    row: dict[str, Any] = {
        "participants": n,
        "hosts": conf.hosts_for(n),
        "ok": False,
        "failed_phase": None,
        "error": None,
        "steady_measured": False,
        "problems": [],
        "degraded": [],
    }
    run_id = f"cps-{n}-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="cps-") as tmp_name:
        tmp = Path(tmp_name)
        etcd = EmbeddedEtcd(tmp / "etcd", unsafe_no_fsync=not conf.fsync).start()
        client = EtcdClient(etcd.endpoint)
        store = Store.open(pg.url() if pg else sqlite_url(tmp / "store.db"))
        counter = StoreCounter(store)
        # before the controller: what it adds at N is measured from here
        rss0 = process_memory("self").get("rss")
        ctrl = Controller.create(store, client, job_spec(n, conf.lease_ttl_s), tmp, JOB)
        loop = ControllerLoop(ctrl, run_id).start()
        hosts: Hosts | None = None
        rdzv_watch: RdzvWatch | None = None

        def watch() -> None:
            if loop.error:
                raise PhaseFailed("controller", loop.error)

        try:
            phase_t = time.monotonic()
            hosts = Hosts(n, conf, etcd.endpoint, run_id)
            hosts.collect("ready", conf.startup_timeout, watch=watch)
            progress(
                f"N={n}: {len(hosts.procs)} host processes ready "
                f"({time.monotonic() - phase_t:.1f}s); rendezvous..."
            )
            rdzv_watch = RdzvWatch(etcd.endpoint, run_id).start()
            m0 = scrape(etcd.client_url)
            go = time.time()
            said = [go]

            def rdzv_progress() -> None:
                watch()
                last = rdzv_watch.last() if rdzv_watch else None
                if last is not None and time.time() - said[0] >= 30:
                    said[0] = time.time()
                    progress(
                        f"N={n}: rendezvous running {time.time() - go:.0f}s: {last[1]} "
                        f"participants, {last[2]} waiting in round {last[3]}"
                    )

            hosts.send(("go",))
            got = hosts.collect("rdzv", conf.join_timeout + 60, watch=rdzv_progress)
            m1 = scrape(etcd.client_url)
            rdzv = {h: got[h]["parts"] for h in got}
            parts = [r for host in sorted(rdzv) for r in rdzv[host]]
            _rendezvous_figures(row, "rendezvous", parts, n, m0, m1, client, run_id)
            _backend_figures(row, "rendezvous", [got[h]["backend"] for h in got], n)
            row["rdzv_progress"] = rdzv_watch.progression(go, time.time())
            row["rdzv_joined_max"] = max((p[1] for p in row["rdzv_progress"]), default=0)
            sizes = [smp[5] for smp in rdzv_watch.samples]
            row["rendezvous_state_bytes_max"] = max(sizes, default=None)
            progress(
                f"N={n}: rendezvous {row.get('rendezvous_s')}s "
                f"(ranks assigned {row.get('ranks_assigned_s')}s, state "
                f"{row.get('rendezvous_state_bytes')} B, {row.get('rendezvous_etcd_requests')} "
                f"etcd requests, {row['rendezvous_etcd_mb_in']} MB into etcd)"
            )
            worlds = Counter(p.get("world") for p in parts if "world" in p)
            row["rendezvous_worlds"] = {str(w): c for w, c in sorted(worlds.items())}
            why = _round_problem(parts, n, row["rdzv_joined_max"])
            host_ranks: list[list[int] | None] = [None] * len(hosts.procs)
            if why is not None:
                row["rendezvous_completed"] = False
                if not conf.steady_without_rendezvous:
                    raise PhaseFailed("rendezvous", why)
                row["failed_phase"], row["error"] = "rendezvous", f"rendezvous: {why}"
                progress(
                    f"N={n}: RENDEZVOUS FAILED ({why[:200]}); measuring the controller's side "
                    "anyway, ranks handed out by the benchmark"
                )
                next_rank = iter(range(n))
                for h in sorted(rdzv):
                    host_ranks[h] = [next(next_rank) for _ in rdzv[h]]
                    for p, rank in zip(rdzv[h], host_ranks[h], strict=True):
                        p["rank"] = rank

            # rank 0's host files the join request; every host learns the generation
            by_rank = sorted(parts, key=lambda p: p["rank"])
            rank0_host = next(h for h in rdzv for p in rdzv[h] if p["rank"] == 0)
            for i in range(len(hosts.procs)):
                if i == rank0_host:
                    nodes, pids = [p["node"] for p in by_rank], [p["pid"] for p in by_rank]
                    hosts.send(("join", nodes, pids, host_ranks[i]), [i])
                else:
                    hosts.send(("join", None, None, host_ranks[i]), [i])
            joined = hosts.collect("joined", conf.phase_timeout, [rank0_host], watch=watch)
            answer = joined[rank0_host]
            if answer is None:
                raise PhaseFailed("join", f"no assignment within {conf.phase_timeout:.0f}s")
            if answer["layout"] is None:
                raise PhaseFailed("join", f"the controller answered: {answer['waiting']}")
            row["join_answer_s"] = round(answer["seconds"], 3)
            layout = Layout.model_validate_json(answer["layout"])
            row["layout"] = f"{layout.pipeline_ranks} x {layout.replicas}"
            hosts.send(("steady", answer["generation"], answer["layout"]))
            hosts.collect("steady", conf.phase_timeout, watch=watch)
            steady = time.time()
            deadline = time.monotonic() + conf.phase_timeout
            while loop.kinds["started"] < n and time.monotonic() < deadline:
                watch()
                time.sleep(0.2)
            if loop.kinds["started"] < n:
                row["problems"].append(
                    {
                        "kind": "started_not_drained",
                        "count": n - loop.kinds["started"],
                        "detail": f"{loop.kinds['started']}/{n} Started reports reached the store",
                    }
                )
            progress(
                f"N={n}: generation {answer['generation']} ({row['layout']}), join answered in "
                f"{row['join_answer_s']}s; steady, measuring {conf.seconds:.0f}s..."
            )
            time.sleep(conf.warmup)
            t0 = time.time()
            e0, s0, c0 = scrape(etcd.client_url), counter.snapshot(), _cpu_times()
            p0 = time.process_time()
            end = time.monotonic() + conf.seconds
            while time.monotonic() < end:
                watch()
                try:  # a host that failed says so now rather than at the end
                    msg = hosts.res_q.get(timeout=min(1.0, max(0.01, end - time.monotonic())))
                    if msg[0] == "error":
                        raise PhaseFailed("steady", f"host {msg[1]}: {msg[2]}")
                except queue.Empty:
                    pass
            t1 = time.time()
            e1, s1, c1 = scrape(etcd.client_url), counter.snapshot(), _cpu_times()
            p1 = time.process_time()
            rdzv_watch.stop()
            if row["rendezvous_completed"]:  # else the state is what the failed nodes left
                row.update(rdzv_watch.figures(steady, t0, t1))
            dropped = n - (row.get("rdzv_participants_min") or n)
            if dropped:
                row["problems"].append(
                    {
                        "kind": "rdzv_nodes_dropped",
                        "count": dropped,
                        "detail": f"the round lost {dropped} live node(s): no heartbeat for "
                        f"{conf.heartbeat(n) * HEARTBEATS_MISSED}s (at most "
                        f"{row.get('rdzv_unleased_max')} participants without a live lease "
                        f"seen); {row['rdzv_participants_end']}/{n} participants left",
                    }
                )
            span = t1 - t0
            row["window_s"] = round(span, 2)
            row.update(_etcd_window(e0, e1, span))
            # per participant (one agent and its worker): flat as N grows is what scales
            row["etcd_requests_per_agent_s"] = round(row["etcd_requests_per_s"] / n, 3)
            row["store_rows_per_s"] = round((s1[0] - s0[0]) / span, 1)
            row["store_statements_per_s"] = round((s1[1] - s0[1]) / span, 1)
            row["store_commits_per_s"] = round((s1[2] - s0[2]) / span, 1)
            row["store_rows_written"] = s1[0] - s0[0]
            row.update(loop.window(t0, t1))
            row["events_drained_per_s"] = round(row["events_drained"] / span, 1)
            row["store_metric_rows"] = len(store.metrics(JOB))
            cores = os.cpu_count() or 1
            busy = (c1[0] - c0[0]) / (c1[1] - c0[1]) * cores if c1[1] > c0[1] else None
            cpu = {
                "etcd": row.pop("etcd_cpu_cores"),
                "controller_process": round((p1 - p0) / span, 3),
                "controller_thread": row.pop("controller_cpu_cores"),
                "machine_busy": None if busy is None else round(busy, 2),
                "machine_cores": cores,
            }
            hosts.send(("stop", t0, t1, True))
            stats = hosts.collect("stats", conf.phase_timeout, watch=watch)
            _client_figures(row, stats, n, layout, conf, span, cpu)
            _client_problems(row, stats)
            if row["rendezvous_completed"]:  # the agents' backends while steady, per agent
                seconds = max(s["backend_s"] for s in stats.values())
                _backend_figures(row, "steady", [s["backend"] for s in stats.values()], n, seconds)
            row["cpu_cores"] = cpu
            # the controller runs in this process: what the process grew by since the controller
            # was created, with the benchmark's own records of the run (an upper bound)
            rss1 = process_memory("self").get("rss")
            row["controller_rss_growth_mib"] = (
                None if rss0 is None or rss1 is None else round(rss1 - rss0, 1)
            )
            # the end as the controller sees it: rank 0 reported done before the leases went
            deadline = time.monotonic() + conf.phase_timeout
            while ctrl.progress.outcome is None and time.monotonic() < deadline:
                watch()
                time.sleep(0.1)
            # every lease gone: not a figure, a teardown that on a starved machine took over
            # 90 s (each host joins its keep-alive threads, some mid-retry), and failing on it
            # lost the re-rendezvous's measurement
            hosts.collect("ended", conf.phase_timeout * 3, watch=watch)
            row["ok"] = row["failed_phase"] is None
            row["steady_measured"] = True
            if conf.rejoin and row["rendezvous_completed"] and n > 2:
                _rejoin(row, n, conf, hosts, etcd, client, run_id)
                row["ok"] = row["ok"] and bool(row.get("rerendezvous_completed"))
        except PhaseFailed as exc:
            row["failed_phase"], row["error"] = exc.phase, str(exc)[:2000]
            progress(f"N={n}: FAILED in {exc.phase}: {str(exc).splitlines()[0][:300]}")
        except Exception as exc:  # anything else still ends this size only
            row["failed_phase"], row["error"] = "benchmark", f"{type(exc).__name__}: {exc}"[:2000]
            progress(f"N={n}: FAILED: {row['error'][:300]}")
        finally:
            if rdzv_watch is not None:
                rdzv_watch.stop()
            if hosts is not None:
                hosts.close()
            loop.stop(timeout=conf.phase_timeout)
            if loop.error:
                row["problems"].append(
                    {"kind": "controller_error", "count": 1, "detail": loop.error}
                )
            if loop.thread.is_alive():  # `Controller.run` has not finished the job in time
                row["problems"].append(
                    {"kind": "controller_finish_failed", "count": 1, "detail": "still running"}
                )
            aborted = [e for e in store.events(JOB, limit=10_000) if e.kind == "generation_aborted"]
            if aborted:
                row["problems"].append(
                    {
                        "kind": "generation_aborted",
                        "count": len(aborted),
                        "detail": aborted[-1].message,
                    }
                )
            store.close()
            client.close()
            if not etcd.is_running():  # it died under the load: say how
                row["problems"].append(
                    {"kind": "etcd_died", "count": 1, "detail": _log_tail(etcd.log_path)}
                )
            etcd.stop()
    _judge(row, conf)
    return row


def _rejoin(
    row: dict[str, Any],
    n: int,
    conf: Config,
    hosts: Hosts,
    etcd: EmbeddedEtcd,
    client: EtcdClient,
    run_id: str,
) -> None:
    """The last rank's agent is lost (its heartbeats stop); the other N-1 call next_rendezvous()
    at once and must meet in a new round of N-1 without it (torchrun --nnodes N-1:N)."""
    progress(f"N={n}: losing the agent of rank {n - 1}; {n - 1} survivors meet again...")
    watch = RdzvWatch(etcd.endpoint, run_id).start()
    m0 = scrape(etcd.client_url)
    lost = time.time()
    hosts.send(("rejoin", n - 1))
    try:
        got = hosts.collect("rejoined", conf.rejoin_timeout + 60)
    except PhaseFailed as exc:
        row["rerendezvous_completed"] = False
        row["problems"].append({"kind": "rerendezvous_failed", "count": 1, "detail": str(exc)})
        watch.stop()
        return
    m1 = scrape(etcd.client_url)
    watch.stop()
    parts = [r for h in sorted(got) for r in got[h]["parts"]]
    for p in parts:
        p["t0"] = lost  # from the loss, not from each survivor's call
    _rendezvous_figures(row, "rerendezvous", parts, n - 1, m0, m1, client, run_id)
    _backend_figures(row, "rerendezvous", [got[h]["backend"] for h in got], n - 1)
    row["rerdzv_progress"] = watch.progression(lost, time.time())
    joined = max((p[1] for p in row["rerdzv_progress"]), default=0)
    why = _round_problem(parts, n - 1, joined)
    row["rerendezvous_completed"] = why is None and bool(row.get("rerendezvous_completed"))
    if why is not None:
        row["problems"].append({"kind": "rerendezvous_failed", "count": 1, "detail": why})
    progress(
        f"N={n}: re-rendezvous of {n - 1} {row.get('rerendezvous_s')}s after the loss "
        f"({row.get('rerendezvous_etcd_requests')} etcd requests, "
        f"{row.get('rerendezvous_etcd_mb_in')} MB into etcd){'' if why is None else ': ' + why}"
    )


def _log_tail(path: Path, size: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - size))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
