"""Control plane at cluster size: N simulated torchrun agents + workers against one etcd and a
real controller, for N in --sizes (default 8, 16, 64, 256).

    .venv/bin/python bench/control_plane_scale.py [--sizes 8,16,64,256] [--seconds 20]
        [--hosts 4] [--step-hz 2] [--metrics-from replica|loss-owner] [--store sqlite|postgresql]
        [--no-fsync] [--join-timeout 240] [--heartbeat-s 1]

What runs, per size (a fresh embedded etcd, store and controller each time):

- **The controller**: a real `Controller` (`create`, `publish`, `acquire` with its lease), its
  own `supervise` loop (drain -> answer_join -> check_workers every 0.1 s), writing a real store
  (SQLite file, or a throwaway PostgreSQL with `--store postgresql`).
- **N participants**, each one torchrun agent with one worker (`--nproc-per-node 1`), simulated
  as threads: `--hosts` processes (default 4, spawned) each run N/hosts participants. 256 real
  torchrun agents plus 256 worker processes do not fit 2 cores (a process with torch imported
  is ~300 MB and seconds of CPU to start), but the control plane only sees their etcd traffic,
  and that is made by the project's own code:
    agent:  `orchestrator.rendezvous.create_etcd3_handler` with the project's torchrun settings
            (`orchestrator.launch`: min = max = N nodes, 1 s heartbeats, 3 missed); its
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

Measured per size:

    rendezvous_s          first participant calling next_rendezvous() -> the last one back
                          (all in the same round, world N); ranks_assigned_s adds torchrun's
                          rank assignment; join_answer_s: JoinRequest -> Assignment (controller);
                          rdzv_progress: [s, participants, waiting] read from the state in etcd
                          while it ran; rendezvous_etcd_txns / _mb_in: what it cost etcd
    etcd_requests_per_s   gRPC requests etcd started (its /metrics, grpc_server_started_total)
                          per second over the steady window (--seconds, after --warmup), by
                          method; etcd_writes_per_s: raft proposals committed per second
    store_rows_per_s      rows the controller inserted/updated/deleted per second (SQLAlchemy
                          cursor row counts), with statements and commits per second
    drain_ms              how long one `Controller.drain()` takes (p50/p95/max) and report_age_s,
                          how old a report is when it lands in the store
    client_ms, achieved   per-participant call latency, and calls made / calls due (1.0: every
                          poll and report on time)
    cpu_cores             CPU used by etcd, the simulated agents and the controller's process,
                          and how busy the whole machine was (others share these cores)
    problems, degraded    what failed (a rendezvous that timed out, an unanswered join, a
                          lapsed lease, an aborted generation, rendezvous heartbeats that failed,
                          nodes dropped from the round, etcd errors, controller errors) and what
                          degraded (polls late, reports older than 1 s, controller busy > 80 %)

Every wait is bounded; a size that fails records where and why, and the run goes on. A size
whose rendezvous fails (`--join-timeout`) is still measured in steady state with ranks handed
out by the benchmark (`failed_phase: "rendezvous"`; no torchrun heartbeats or monitor polls
then, so its etcd figures lack the agents' share), so the controller's side at that size is
known too. `--heartbeat-s 5` runs the rendezvous with torch's default heartbeat instead of the
project's 1 s (orchestrator/launch.py). Progress lines while it runs; the last line is one
JSON object (`breaks_first` and a sentence saying what broke first); the plot is
bench/out/control_plane_scale.png (figures vs participants, log x, and the rendezvous's
progress over time), the JSON also bench/out/control_plane_scale.json.

How to read it: everything shares 2 slow cores with etcd itself (and with other work), so the
absolute rates are what this machine sustains, not etcd's ceiling; `cpu_cores` and `achieved`
say whether the simulators, the controller or etcd ran out first. The load per participant is
fixed, so requests/s should grow linearly with N; the rendezvous state is one pickled blob of
O(N) bytes rewritten by compare-and-swap on every join and heartbeat, so its cost grows ~N^2.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue
import re
import socket
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, environment, out_dir, progress  # noqa: E402

from core import keys  # noqa: E402
from core.etcd_client import EtcdClient  # noqa: E402
from core.protocol import Assignment, JoinRequest, Metrics, Started  # noqa: E402
from core.spec import JobSpec  # noqa: E402
from core.state import Layout  # noqa: E402
from orchestrator.controller import Controller  # noqa: E402
from orchestrator.etcd_server import EmbeddedEtcd  # noqa: E402
from orchestrator.launch import HEARTBEAT_S, HEARTBEATS_MISSED, LAST_CALL_S  # noqa: E402
from store import Store, sqlite_url  # noqa: E402

JOB = "cps"
MONITOR_S = 0.2  # torchrun --monitor-interval in orchestrator.launch.torchrun_command
ABORT_POLL_S = 0.2  # trainer.process.AbortWatch's default
JOIN_POLL_S = 0.05  # trainer.process.join's assignment poll
AGENT_LEASE_S = 10  # `pipetransformer workers` launcher presence (orchestrator.cli.cmd_workers)
CONTROLLER_TICK_S = 0.1  # Controller.supervise's default interval
STALE_REPORT_S = 1.0  # a report older than this when stored counts as the controller lagging
DEFAULT_SIZES = (8, 16, 64, 256)


@dataclass
class Config:
    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    hosts: int = 4  # processes the participants are spread over (capped at N)
    seconds: float = 20.0  # steady window measured
    warmup: float = 3.0  # steady seconds before the window opens
    step_hz: float = 2.0  # Metrics reports per second per reporting rank
    metrics_from: str = "replica"  # "replica" (each replica's last stage) or "loss-owner"
    lease_ttl_s: int = 5  # runtime.lease_ttl_s (the spec's default)
    join_timeout: int = 240  # torch's rendezvous join timeout (s)
    startup_timeout: float = 180.0  # spawning the host processes (torch imports)
    phase_timeout: float = 90.0  # join answer, steady start, stop
    fsync: bool = True  # etcd fsyncs its WAL (as `pipetransformer run`'s embedded etcd)
    store: str = "sqlite"  # or "postgresql" (a throwaway server from tests/fixtures_postgres)
    heartbeat_s: int = HEARTBEAT_S  # rendezvous keep_alive_interval (orchestrator.launch)
    # a rendezvous that fails: measure the steady state anyway, ranks handed out by the benchmark
    # (no torchrun heartbeats or monitor polls then), so the controller's side is still seen
    steady_without_rendezvous: bool = True


# -- small helpers -----------------------------------------------------------------------------


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


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            parts = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
    return sum(parts) - idle, sum(parts)


def job_spec(world: int, lease_ttl_s: int) -> JobSpec:
    """A small job whose re-formed layout is 2 pipeline ranks x world/2 replicas."""
    return JobSpec.model_validate(
        {
            "name": "cps",
            "model": {"depth": 4, "dim": 32, "heads": 4},
            "training": {"epochs": 1, "global_batch_size": 16 * max(world, 2)},
            "parallel": {"stages": 2, "replicas": 1, "microbatches": 4},
            "runtime": {"lease_ttl_s": lease_ttl_s},
        }
    )


class PhaseFailed(RuntimeError):
    def __init__(self, phase: str, message: str) -> None:
        super().__init__(f"{phase}: {message}")
        self.phase = phase


# -- simulated agents (one host process runs many participants as threads) --------------------


class _WarningCounter(logging.Handler):
    """Counts the warnings torch's rendezvous and our etcd client log (heartbeats that failed,
    lease refreshes that failed or found the lease gone), and keeps them off stderr."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[tuple[float, str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "keep-alive heartbeat" in msg:
            kind = "rdzv_heartbeat_failed"
        elif "expired" in msg and "lease" in msg:
            kind = "lease_expired"
        elif "refresh failed" in msg:
            kind = "lease_refresh_failed"
        else:
            kind = "other_warning"
        self.seen.append((record.created, kind, msg[:300]))


class _Participant:
    """One torchrun agent and its one worker, as threads."""

    def __init__(self, handler: Any, worker_etcd: EtcdClient) -> None:
        self.handler = handler
        self.wc = worker_etcd
        node = handler._this_node  # torch's (addr, pid, local_id) of this agent
        self.node = f"{socket.gethostname()}:{node.pid}.{node.local_id}"
        self.calls: list[tuple[float, str, float, bool]] = []  # (start, op, seconds, ok)
        self.errors: list[tuple[float, str, str]] = []
        self.views: list[tuple[float, int, int, int]] = []  # (t, waiting, participants, round)
        self.result: dict[str, Any] = {"node": self.node}
        self.presence: Any = None
        self.agent_keepalive: Any = None
        self.aborted_at: float | None = None
        self.reporter: Any = None
        self.rendezvoused = True  # False: its rendezvous failed, no agent polls to simulate
        self.threads: list[threading.Thread] = []

    @property
    def agent_etcd(self) -> EtcdClient:
        return self.handler._state_holder._backend._client

    def call(self, op: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        p0 = time.perf_counter()
        try:
            value = fn(*args, **kwargs)
        except Exception as exc:
            self.calls.append((t0, op, time.perf_counter() - p0, False))
            self.errors.append((t0, op, f"{type(exc).__name__}: {exc}"[:300]))
            return None
        self.calls.append((t0, op, time.perf_counter() - p0, True))
        return value


def _time_heartbeats(p: _Participant) -> None:
    """Record every rendezvous heartbeat (torch's timer calls `handler._keep_alive()`)."""
    original = p.handler._keep_alive

    def timed() -> None:
        t0, p0 = time.time(), time.perf_counter()
        original()
        p.calls.append((t0, "heartbeat", time.perf_counter() - p0, True))

    p.handler._keep_alive = timed


class _OneWorkerSpec:
    role = "trainer"
    local_world_size = 1


def _rendezvous(p: _Participant) -> None:
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    p.result["t0"] = time.time()
    try:
        info = p.handler.next_rendezvous()
        p.result["t_rdzv"] = time.time()
        p.result.update(
            rank=info.rank, world=info.world_size, round=p.handler._state_holder.state.round
        )
        # what torchrun's agent does next with the rendezvous store (no `self` needed)
        workers = SimpleElasticAgent._assign_worker_ranks(
            None, info.store, info.rank, info.world_size, _OneWorkerSpec
        )
        p.result["t_assigned"] = time.time()
        p.result["global_rank"] = workers[0].global_rank
    except Exception as exc:
        p.result["error"] = f"{type(exc).__name__}: {exc}".rstrip(": ")[:500]


def _periodic(stop: threading.Event, tasks: list[list[Any]]) -> None:
    """Run each [next_due, period, fn] at its period (late calls run once, no catch-up burst)."""
    while not stop.is_set():
        now = time.monotonic()
        task = min(tasks, key=lambda t: t[0])
        if task[0] > now:
            stop.wait(task[0] - now)
            continue
        task[2]()
        task[0] = max(task[0] + task[1], time.monotonic())


def _agent_loop(p: _Participant, stop: threading.Event, job: str) -> None:
    lease = p.call("agent_lease", p.agent_etcd.lease, AGENT_LEASE_S)
    if lease is not None:
        key = f"{keys.agents(job)}{p.node.replace(':', '-')}"
        p.call("agent_put", p.agent_etcd.put, key, "", lease)
        p.agent_keepalive = p.agent_etcd.keep_alive(lease)

    if not p.rendezvoused:
        return

    def monitor() -> None:  # torchrun's monitor loop asks whether nodes wait to join
        waiting = p.call("monitor", p.handler.num_nodes_waiting)
        state = p.handler._state_holder.state
        if waiting is not None:
            p.views.append((time.time(), waiting, len(state.participants), state.round))

    _periodic(stop, [[time.monotonic(), MONITOR_S, monitor]])


def _worker_loop(
    p: _Participant,
    stop: threading.Event,
    ready: threading.Barrier,
    job: str,
    generation: int,
    layout: Layout,
    conf: Config,
) -> None:
    from trainer.process import Reporter, hold_presence

    rank = p.result["rank"]
    pipe = layout.pipeline_ranks
    try:
        p.presence = p.call(
            "presence", hold_presence, p.wc, job, rank, generation, conf.lease_ttl_s
        )
        p.reporter = Reporter(p.wc, job, generation, rank)
        stages = [s.index for s in layout.stages if rank in s.ranks]
        p.call(
            "report",
            p.reporter.emit,
            Started,
            stages=stages,
            replica=rank // pipe,
            pid=os.getpid(),
            host=socket.gethostname(),
            node=p.node,
            total_steps=10**6,
        )
    finally:
        try:
            ready.wait(timeout=conf.phase_timeout)
        except threading.BrokenBarrierError:
            pass
    abort_key = keys.abort(job)

    def abort_watch() -> None:
        value = p.call("abort_poll", p.wc.get, abort_key)
        if value == str(generation) and p.aborted_at is None:
            p.aborted_at = time.time()

    tasks = [[time.monotonic(), ABORT_POLL_S, abort_watch]]
    reports = rank % pipe == pipe - 1 and (conf.metrics_from == "replica" or rank < pipe)
    if reports and conf.step_hz > 0:
        step = [0]
        batch = 16 * layout.world_size
        norms = [0.5] * layout.num_blocks

        def train_step() -> None:
            step[0] += 1
            k = step[0]
            p.call(
                "report",
                p.reporter.emit,
                Metrics,
                step=k,
                epoch=0,
                samples_consumed=k * batch,
                loss=2.3 / (1 + 0.01 * k),
                lr=1e-3,
                samples_per_s=batch * conf.step_hz,
                frozen=0,
                grad_norms=norms,
            )

        tasks.append([time.monotonic() + 1.0 / conf.step_hz, 1.0 / conf.step_hz, train_step])
    _periodic(stop, tasks)


def _summarise(parts: list[_Participant], t0: float, t1: float) -> dict[str, Any]:
    ops: dict[str, dict[str, Any]] = {}
    errors: Counter[str] = Counter()
    samples: list[str] = []
    for p in parts:
        for start, op, secs, ok in p.calls:
            if t0 <= start < t1:
                o = ops.setdefault(op, {"count": 0, "ok": 0, "lat": []})
                o["count"] += 1
                o["ok"] += ok
                o["lat"].append(round(secs, 6))
        for _when, op, msg in p.errors:
            errors[op] += 1  # anywhere in the steady phase, not only the window
            if len(samples) < 3:
                samples.append(f"{op}: {msg}")
    views = [v for p in parts for v in p.views if t0 <= v[0] < t1]
    all_views = [v for p in parts for v in p.views]
    return {
        "ops": ops,
        "errors": dict(errors),
        "error_samples": samples,
        "max_waiting": max((v[1] for v in all_views), default=0),
        "min_participants": min((v[2] for v in all_views), default=None),
        "rounds": sorted({v[3] for v in all_views}),
        "window_views": len(views),
        "presence_expired": sum(bool(p.presence and p.presence.expired.is_set()) for p in parts),
        "agent_lease_expired": sum(
            bool(p.agent_keepalive and p.agent_keepalive.expired.is_set()) for p in parts
        ),
        "aborted": sum(p.aborted_at is not None for p in parts),
    }


def _expect(cmd_q: Any, name: str, timeout: float) -> tuple:
    try:
        msg = cmd_q.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"no '{name}' from the benchmark within {timeout:.0f}s") from None
    if msg[0] == "quit":
        raise SystemExit(0)
    if msg[0] != name:
        raise RuntimeError(f"expected '{name}', got '{msg[0]}'")
    return msg


def _orphan_watch(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def host_main(
    index: int,
    count: int,
    world: int,
    endpoint: str,
    run_id: str,
    conf: Config,
    cmd_q: Any,
    res_q: Any,
    parent: int,
) -> None:
    """A host process: `count` participants of a world of `world`, driven by the benchmark."""
    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    code = 0
    try:
        _host(index, count, world, endpoint, run_id, conf, cmd_q, res_q)
    except SystemExit:
        pass
    except BaseException as exc:
        code = 1
        res_q.put(("error", index, f"{type(exc).__name__}: {exc}", traceback.format_exc()[-3000:]))
    res_q.close()
    res_q.join_thread()
    os._exit(code)  # threads blocked in etcd calls must not keep a failed host alive


def _host(
    index: int,
    count: int,
    world: int,
    endpoint: str,
    run_id: str,
    conf: Config,
    cmd_q: Any,
    res_q: Any,
) -> None:
    warnings = _WarningCounter()
    logging.getLogger().addHandler(warnings)
    logging.getLogger().setLevel(logging.WARNING)
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from orchestrator.rendezvous import create_etcd3_handler
    from trainer.process import Reporter  # noqa: F401  (imported once here, not in a thread)

    rdzv_conf = {
        "join_timeout": conf.join_timeout,
        "last_call_timeout": LAST_CALL_S,
        "keep_alive_interval": conf.heartbeat_s,
        "keep_alive_max_attempt": HEARTBEATS_MISSED,
        "read_timeout": conf.join_timeout,
    }
    params = RendezvousParameters(
        backend="etcd3",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=world,
        max_nodes=world,
        local_addr="127.0.0.1",
        **rdzv_conf,
    )
    parts = [_Participant(create_etcd3_handler(params), EtcdClient(endpoint)) for _ in range(count)]
    for p in parts:
        _time_heartbeats(p)
    cpu: list[tuple[float, float]] = []
    stop_cpu = threading.Event()

    def sample_cpu() -> None:
        while not stop_cpu.wait(0.5):
            cpu.append((time.time(), time.process_time()))

    threading.Thread(target=sample_cpu, daemon=True).start()
    res_q.put(("ready", index, {"pid": os.getpid(), "participants": count}))

    # rendezvous: all participants at once, as agents started together
    _expect(cmd_q, "go", conf.startup_timeout + conf.phase_timeout)
    threads = [threading.Thread(target=_rendezvous, args=(p,), daemon=True) for p in parts]
    for t in threads:
        t.start()
    deadline = time.monotonic() + conf.join_timeout + 30
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for p in parts:
        if "t_rdzv" not in p.result and "error" not in p.result:
            p.result["error"] = "next_rendezvous() did not return in time"
    res_q.put(("rdzv", index, [dict(p.result, pid=os.getpid()) for p in parts]))

    # the round's rank 0 asks the controller for a generation (trainer.process.join)
    msg = _expect(cmd_q, "join", conf.join_timeout + conf.phase_timeout)
    if msg[3] is not None:  # the rendezvous failed: the benchmark hands out the ranks
        for p, rank in zip(parts, msg[3], strict=True):
            p.result["rank"] = rank
            p.rendezvoused = False
            p.handler._stop_heartbeats()  # those that did return: no agents in this steady state
    if msg[1] is not None:
        nodes, pids = msg[1], msg[2]
        rank0 = next(p for p in parts if p.result.get("rank") == 0)
        request = JoinRequest(id=uuid.uuid4().hex, world=world, nodes=nodes, pids=pids)
        asked = time.time()
        rank0.wc.put(keys.join(JOB), request.model_dump_json())
        answer = None
        while time.time() - asked < conf.phase_timeout:
            raw = rank0.wc.get(keys.assignment(JOB))
            if raw is not None and Assignment.model_validate_json(raw).request == request.id:
                answer = Assignment.model_validate_json(raw)
                break
            time.sleep(JOIN_POLL_S)
        res_q.put(
            (
                "joined",
                index,
                None
                if answer is None
                else {
                    "generation": answer.generation,
                    "layout": answer.layout.model_dump_json() if answer.layout else None,
                    "waiting": answer.waiting,
                    "seconds": time.time() - asked,
                },
            )
        )

    # steady state: presence, reports, polls
    msg = _expect(cmd_q, "steady", conf.phase_timeout * 2)
    generation, layout = msg[1], Layout.model_validate_json(msg[2])
    steady = time.time()
    stop = threading.Event()
    ready = threading.Barrier(count + 1)
    for p in parts:
        for target, args in (
            (_agent_loop, (p, stop, JOB)),
            (_worker_loop, (p, stop, ready, JOB, generation, layout, conf)),
        ):
            t = threading.Thread(target=target, args=args, daemon=True)
            p.threads.append(t)
            t.start()
    try:
        ready.wait(timeout=conf.phase_timeout)
    except threading.BrokenBarrierError:
        pass
    res_q.put(("steady", index, {"threads": threading.active_count()}))

    msg = _expect(cmd_q, "stop", 1e6)  # the benchmark bounds the steady phase
    t0, t1 = msg[1], msg[2]
    stop.set()
    for p in parts:
        for t in p.threads:
            t.join(timeout=5.0)
    summary = _summarise(parts, t0, t1)
    summary["threads"] = threading.active_count()
    inside = [c for c in cpu if t0 <= c[0] <= t1]
    summary["cpu_s"] = inside[-1][1] - inside[0][1] if len(inside) > 1 else None
    summary["cpu_window_s"] = inside[-1][0] - inside[0][0] if len(inside) > 1 else None
    stop_cpu.set()
    # how it ends for the controller: rank 0 reports the end, then every lease goes
    rank0 = [p for p in parts if p.result.get("rank") == 0 and p.reporter is not None]
    if msg[3] and rank0:
        from core.protocol import Finished

        rank0[0].call("report", rank0[0].reporter.emit, Finished, kind="done", outcome="done")
    for p in parts:
        for keepalive in (p.presence, p.agent_keepalive):
            if keepalive is not None:
                try:
                    keepalive.stop(revoke=True)
                except Exception:
                    pass
        p.handler._stop_heartbeats()
    # while steady (what the rendezvous logged before is in its own figures)
    seen = [w for w in warnings.seen if w[0] >= steady]
    summary["warnings"] = dict(Counter(kind for _, kind, _ in seen))
    summary["warnings_in_window"] = dict(Counter(k for when, k, _ in seen if t0 <= when < t1))
    summary["warning_samples"] = [m for _, _, m in seen[:3]]
    res_q.put(("stats", index, summary))
    for p in parts:
        p.wc.close()
        p.agent_etcd.close()
    _expect(cmd_q, "quit", conf.phase_timeout)


# -- the benchmark's side: etcd, store, controller, hosts --------------------------------------


class StoreCounter:
    """Rows and statements the store's engine wrote, and its commits (SQLAlchemy events)."""

    def __init__(self, store: Store) -> None:
        from sqlalchemy import event

        self.rows = self.statements = self.commits = 0
        engine = store._engine  # the store's one engine (a benchmark may look inside)
        event.listen(engine, "after_cursor_execute", self._executed)
        event.listen(engine, "commit", self._committed)

    def _executed(self, conn, cursor, statement, parameters, context, executemany) -> None:
        verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else ""
        if verb in ("INSERT", "UPDATE", "DELETE"):
            self.statements += 1
            self.rows += max(int(cursor.rowcount or 0), 0)

    def _committed(self, conn) -> None:
        self.commits += 1

    def snapshot(self) -> tuple[int, int, int]:
        return self.rows, self.statements, self.commits


class ControllerLoop:
    """`Controller.run` in a thread, every tick and drain timed. It is also the `Workers` the
    controller supervises: the simulated agents run until `stop`."""

    def __init__(self, ctrl: Controller, rdzv_id: str) -> None:
        self.ctrl, self.rdzv_id = ctrl, rdzv_id
        self.ticks: list[tuple[float, float]] = []  # (end wall time, seconds)
        self.drains: list[tuple[float, float, int]] = []  # (end, seconds, events)
        self.ages: list[tuple[float, float]] = []  # (drained at, age of the report)
        self.kinds: Counter[str] = Counter()
        self.error: str | None = None
        self.cpu: list[tuple[float, float]] = []  # (wall, this thread's CPU seconds)
        self._stop = threading.Event()
        self._published = threading.Event()
        drain, tick = ctrl.drain, ctrl.tick

        def timed_drain() -> list:
            p0 = time.perf_counter()
            events = drain()
            now = time.time()
            self.drains.append((now, time.perf_counter() - p0, len(events)))
            for e in events:
                self.ages.append((now, now - e.time))
                self.kinds[e.kind] += 1
            return events

        def timed_tick() -> None:
            p0 = time.perf_counter()
            tick()
            self.ticks.append((time.time(), time.perf_counter() - p0))
            self.cpu.append((time.time(), time.thread_time()))

        ctrl.drain = timed_drain  # supervise/tick call self.drain(): the instance's wins
        ctrl.tick = timed_tick
        self.thread = threading.Thread(target=self._run, name="controller", daemon=True)

    def poll(self) -> int | None:
        # what `pipetransformer controller` asks etcd besides its tick (orchestrator/roles.py)
        self.ctrl.workers_alive()
        self.ctrl.etcd.count_prefix(keys.agents(self.ctrl.job_id))
        return 0 if self._stop.is_set() else None

    def detail(self, code: int | None) -> str:
        return ""

    def close(self) -> None:
        pass

    def _launch(self, attached: bool) -> ControllerLoop:
        self._published.set()  # the job is in etcd: the agents may start
        return self

    def _run(self) -> None:
        try:
            self.ctrl.run(self.rdzv_id, self._launch, interval=CONTROLLER_TICK_S)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:500]
            logging.getLogger(__name__).exception("controller loop failed")
        finally:
            self._published.set()  # never leave start() waiting on a controller that failed

    def start(self) -> ControllerLoop:
        self.thread.start()
        self._published.wait()
        return self

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self.thread.join(timeout)

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        drains = [d for d in self.drains if t0 <= d[0] < t1]
        ticks = [t for t in self.ticks if t0 <= t[0] < t1]
        ages = [a for when, a in self.ages if t0 <= when < t1]
        cpu = [c for c in self.cpu if t0 <= c[0] <= t1]
        span = t1 - t0
        return {
            "drains": len(drains),
            "drain_ms": _dist([d[1] for d in drains], 1e3),
            "events_drained": sum(d[2] for d in drains),
            "events_per_drain_max": max((d[2] for d in drains), default=0),
            "tick_ms": _dist([t[1] for t in ticks], 1e3),
            "ticks_per_s": round(len(ticks) / span, 2),
            "controller_busy": round(sum(t[1] for t in ticks) / span, 3),
            "controller_cpu_cores": round((cpu[-1][1] - cpu[0][1]) / (cpu[-1][0] - cpu[0][0]), 3)
            if len(cpu) > 1 and cpu[-1][0] > cpu[0][0]
            else None,
            "report_age_s": _dist(ages, 1.0, 3),
        }


class RdzvWatch:
    """Reads the rendezvous state blob every `every` s while steady: how many participants the
    round still has, and how old the oldest heartbeat in it is (torch drops a node whose
    heartbeat is older than keep_alive_interval x keep_alive_max_attempt)."""

    def __init__(self, endpoint: str, run_id: str, every: float = 0.5) -> None:
        from orchestrator.rendezvous import state_key

        self.client = EtcdClient(endpoint)
        self.key = state_key(run_id)
        self.every = every
        # (time, participants, waiting, round, oldest heartbeat age, state bytes)
        self.samples: list[tuple[float, int, int, int, float, int]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rdzv-watch", daemon=True)

    def _run(self) -> None:
        import base64
        import pickle
        from datetime import UTC, datetime

        while not self._stop.wait(self.every):
            try:
                raw = self.client.get(self.key)
                if raw is None:
                    continue
                state = pickle.loads(base64.b64decode(raw))  # torch's own pickled state
                now = datetime.now(UTC)
                beats = state.last_heartbeats.values()
                age = max(((now - hb).total_seconds() for hb in beats), default=0.0)
                self.samples.append(
                    (
                        time.time(),
                        len(state.participants),
                        len(state.wait_list),
                        state.round,
                        age,
                        len(raw) * 3 // 4,
                    )
                )
            except Exception as exc:  # keep watching; say what went wrong once
                self.error = self.error or f"{type(exc).__name__}: {exc}"[:300]

    def start(self) -> RdzvWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.client.close()

    def last(self) -> tuple[float, int, int, int, float, int] | None:
        return self.samples[-1] if self.samples else None

    def progression(self, start: float, end: float, points: int = 40) -> list[list[float]]:
        """[seconds since start, participants, waiting] while the rendezvous ran (<= points)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        step = max(1, len(inside) // points)
        picked = inside[::step] + ([inside[-1]] if inside and (len(inside) - 1) % step else [])
        return [[round(s[0] - start, 1), s[1], s[2]] for s in picked]

    def figures(self, steady: float, t0: float, t1: float) -> dict[str, Any]:
        """The steady phase (from `steady`), heartbeat ages inside the window [t0, t1)."""
        after = [s for s in self.samples if s[0] >= steady]
        inside = [s for s in after if t0 <= s[0] < t1]
        return {
            "rdzv_heartbeat_age_s": _dist([s[4] for s in inside], 1.0, 3),
            "rdzv_participants_min": min((s[1] for s in after), default=None),
            "rdzv_participants_end": after[-1][1] if after else None,
            "rdzv_waiting_max": max((s[2] for s in after), default=None),
            "rdzv_rounds_seen": sorted({s[3] for s in after}),
        }


class _Postgres:
    """A throwaway PostgreSQL server (tests/fixtures_postgres.py), one database per size."""

    def __init__(self) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.fixtures_postgres import PostgresServer, find_postgres_bin, missing_postgres

        why = missing_postgres()
        if why:
            raise RuntimeError(f"--store postgresql: {why}")
        self.server = PostgresServer(find_postgres_bin())
        self.server.start()

    def url(self) -> str:
        return self.server.create_database()

    def close(self) -> None:
        self.server.stop()
        self.server.cleanup()


class Hosts:
    """The host processes of one size and their queues."""

    def __init__(self, n: int, conf: Config, endpoint: str, run_id: str) -> None:
        ctx = mp.get_context("spawn")
        k = max(1, min(conf.hosts, n))
        self.counts = [n // k + (1 if i < n % k else 0) for i in range(k)]
        self.res_q = ctx.Queue()
        self.cmd_qs = [ctx.Queue() for _ in range(k)]
        self.procs = [
            ctx.Process(
                target=host_main,
                args=(i, c, n, endpoint, run_id, conf, self.cmd_qs[i], self.res_q, os.getpid()),
                name=f"cps-host-{i}",
                daemon=True,
            )
            for i, c in enumerate(self.counts)
        ]
        for p in self.procs:
            p.start()

    def send(self, msg: tuple, to: list[int] | None = None) -> None:
        for i in range(len(self.procs)) if to is None else to:
            self.cmd_qs[i].put(msg)

    def collect(
        self, kind: str, timeout: float, hosts: list[int] | None = None, watch: Any = None
    ) -> dict[int, Any]:
        """One `kind` message from each of `hosts` (default all) within `timeout` seconds."""
        want = set(range(len(self.procs)) if hosts is None else hosts)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while want - set(got):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(want - set(got))
                raise PhaseFailed(kind, f"no answer from host(s) {missing} within {timeout:.0f}s")
            if watch is not None:
                watch()
            try:
                msg = self.res_q.get(timeout=min(1.0, remaining))
            except queue.Empty:
                dead = [i for i in want - set(got) if not self.procs[i].is_alive()]
                if dead:
                    raise PhaseFailed(kind, f"host process(es) {dead} exited") from None
                continue
            if msg[0] == "error":
                raise PhaseFailed(kind, f"host {msg[1]}: {msg[2]}\n{msg[3]}")
            if msg[0] == kind:
                got[msg[1]] = msg[2]
        return got

    def close(self) -> None:
        self.send(("quit",))
        deadline = time.monotonic() + 15
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


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


def _expected_calls(
    n: int, layout: Layout, conf: Config, span: float, agents: bool = True
) -> dict[str, float]:
    reporters = layout.replicas if conf.metrics_from == "replica" else 1
    return {
        "abort_poll": n * span / ABORT_POLL_S,
        "monitor": n * span / MONITOR_S if agents else 0.0,
        "heartbeat": n * span / conf.heartbeat_s if agents else 0.0,
        "report": reporters * span * conf.step_hz,
    }


def measure_size(n: int, conf: Config, pg: _Postgres | None = None) -> dict[str, Any]:
    """One size: returns its row (figures, problems); never raises for a failed phase."""
    row: dict[str, Any] = {
        "participants": n,
        "hosts": max(1, min(conf.hosts, n)),
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
            rdzv = hosts.collect("rdzv", conf.join_timeout + 60, watch=rdzv_progress)
            m1 = scrape(etcd.client_url)
            parts = [r for host in sorted(rdzv) for r in rdzv[host]]
            _rendezvous_figures(row, parts, n, m0, m1, client, run_id)
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
            failed = [p for p in parts if "error" in p]
            ranks = sorted(p.get("rank", -1) for p in parts)
            rounds = {p.get("round") for p in parts}
            worlds = Counter(p.get("world") for p in parts if "world" in p)
            row["rendezvous_worlds"] = {str(w): c for w, c in sorted(worlds.items())}
            why = None
            if failed:
                why = (
                    f"{len(failed)}/{n} participants failed: {failed[0]['error']} (at most "
                    f"{row['rdzv_joined_max']}/{n} nodes were ever in the round)"
                )
            elif ranks != list(range(n)) or len(rounds) != 1 or set(worlds) != {n}:
                seen = ", ".join(f"{c} saw {w}" for w, c in sorted(worlds.items()))
                why = (
                    f"inconsistent result: world sizes ({seen}), rounds {sorted(rounds)}, "
                    f"ranks {'0..' + str(n - 1) if ranks == list(range(n)) else ranks}"
                )
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
                        "detail": f"the round lost {dropped} live node(s): their heartbeat was "
                        f"older than {conf.heartbeat_s * HEARTBEATS_MISSED}s (oldest seen "
                        f"{row['rdzv_heartbeat_age_s']['max']}s); {row['rdzv_participants_end']}"
                        f"/{n} participants left in the state",
                    }
                )
            span = t1 - t0
            row["window_s"] = round(span, 2)
            row.update(_etcd_window(e0, e1, span))
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
            row["cpu_cores"] = cpu
            # the end as the controller sees it: rank 0 reported done before the leases went
            deadline = time.monotonic() + conf.phase_timeout
            while ctrl.progress.outcome is None and time.monotonic() < deadline:
                watch()
                time.sleep(0.1)
            row["ok"] = row["failed_phase"] is None
            row["steady_measured"] = True
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
            etcd.stop()
    _judge(row, conf)
    return row


def _rendezvous_figures(
    row: dict[str, Any],
    parts: list[dict[str, Any]],
    n: int,
    m0: dict[str, float],
    m1: dict[str, float],
    client: EtcdClient,
    run_id: str,
) -> None:
    from orchestrator.rendezvous import state_key

    start = min(p["t0"] for p in parts)
    done = [p for p in parts if "t_rdzv" in p]
    assigned = [p for p in parts if "t_assigned" in p]
    complete = len(done) == n
    row["rendezvous_completed"] = complete and len(assigned) == n
    row["rendezvous_s"] = round(max(p["t_rdzv"] for p in done) - start, 3) if complete else None
    row["ranks_assigned_s"] = (
        round(max(p["t_assigned"] for p in assigned) - start, 3) if len(assigned) == n else None
    )
    row["rendezvous_participant_s"] = _dist([p["t_rdzv"] - p["t0"] for p in done], 1.0, 3)
    row["rendezvous_rounds"] = sorted({p["round"] for p in done})
    row["rendezvous_joined"] = len(done)
    txn0 = _by(m0, "grpc_server_started_total", "grpc_method").get("Txn", 0.0)
    txn1 = _by(m1, "grpc_server_started_total", "grpc_method").get("Txn", 0.0)
    row["rendezvous_etcd_requests"] = int(
        _total(m1, "grpc_server_started_total") - _total(m0, "grpc_server_started_total")
    )
    row["rendezvous_etcd_txns"] = int(txn1 - txn0)
    received = "etcd_network_client_grpc_received_bytes_total"
    row["rendezvous_etcd_mb_in"] = round((_total(m1, received) - _total(m0, received)) / 1e6, 2)
    try:
        blob = client.get(state_key(run_id))
        row["rendezvous_state_bytes"] = None if blob is None else len(blob) * 3 // 4
    except Exception:
        row["rendezvous_state_bytes"] = None


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
    errors: Counter[str] = Counter()
    warnings: Counter[str] = Counter()
    samples: list[str] = []
    for s in stats.values():
        for op, o in s["ops"].items():
            m = ops.setdefault(op, {"count": 0, "ok": 0, "lat": []})
            m["count"] += o["count"]
            m["ok"] += o["ok"]
            m["lat"].extend(o["lat"])
        errors.update(s["errors"])
        warnings.update(s["warnings"])
        samples.extend(s["error_samples"] + s["warning_samples"])
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
    problems = row["problems"]

    def problem(kind: str, count: int, detail: str) -> None:
        if count:
            problems.append({"kind": kind, "count": int(count), "detail": detail})

    problem(
        "etcd_client_errors",
        sum(errors.values()),
        f"{dict(errors)}; e.g. {samples[0] if samples else ''}",
    )
    problem(
        "rdzv_heartbeat_failed",
        warnings["rdzv_heartbeat_failed"],
        "torchrun rendezvous heartbeats that did not get through (a node missing 3 in a row is "
        "dropped from the round)",
    )
    problem(
        "lease_refresh_failed", warnings["lease_refresh_failed"], "lease keep-alives that failed"
    )
    problem(
        "presence_lease_expired",
        sum(s["presence_expired"] for s in stats.values()),
        "workers' presence leases expired (the controller reads that as a dead worker)",
    )
    problem(
        "agent_lease_expired",
        sum(s["agent_lease_expired"] for s in stats.values()),
        "launchers' presence leases expired",
    )
    problem(
        "abort_seen",
        sum(s["aborted"] for s in stats.values()),
        "workers saw the controller abort their generation",
    )
    waiting = max((s["max_waiting"] for s in stats.values()), default=0)
    problem(
        "rdzv_nodes_waiting",
        waiting,
        "num_nodes_waiting() > 0: torchrun would restart the worker group",
    )
    rounds = sorted({r for s in stats.values() for r in s["rounds"]})
    if len(rounds) > 1:
        problem("rdzv_new_round", len(rounds) - 1, f"rounds seen while steady: {rounds}")


def _judge(row: dict[str, Any], conf: Config) -> None:
    """What degraded (the size still ran): late polls, stale reports, a saturated controller."""
    slow = {op: r for op, r in row.get("achieved", {}).items() if r < 0.9}
    if slow:
        row["degraded"].append(
            {"kind": "calls_late", "detail": f"calls made / due below 0.9: {slow}"}
        )
    age = (row.get("report_age_s") or {}).get("p95")
    if age is not None and age > STALE_REPORT_S:
        row["degraded"].append(
            {"kind": "reports_stale", "detail": f"report age p95 {age}s > {STALE_REPORT_S}s"}
        )
    busy = row.get("controller_busy")
    if busy is not None and busy > 0.8:
        row["degraded"].append(
            {"kind": "controller_saturated", "detail": f"controller ticking {busy:.0%} of the time"}
        )


def _breaks_first(rows: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
    broke = next((r for r in rows if r["failed_phase"] or r["problems"]), None)
    slow = next((r for r in rows if r["degraded"]), None)
    first: dict[str, Any] | None = None
    parts = []
    if broke is not None:
        what = ([f"failed in {broke['failed_phase']}"] if broke["failed_phase"] else []) + [
            p["kind"] for p in broke["problems"]
        ]
        first = {"participants": broke["participants"], "what": what, "error": broke["error"]}
        detail = broke["error"] or "; ".join(p["detail"] for p in broke["problems"])
        parts.append(
            f"First failure at N={broke['participants']}: {', '.join(what)} "
            f"({detail.splitlines()[0][:240]})."
        )
    else:
        parts.append(f"Nothing failed up to N={max(r['participants'] for r in rows)}.")
    if slow is not None and (broke is None or slow["participants"] <= broke["participants"]):
        kinds = ", ".join(d["detail"] for d in slow["degraded"])
        parts.append(f"First degradation at N={slow['participants']}: {kinds}.")
        if first is None:
            first = {
                "participants": slow["participants"],
                "what": [d["kind"] for d in slow["degraded"]],
                "error": None,
            }
    busy = [r for r in rows if (r.get("cpu_cores") or {}).get("machine_busy")]
    if busy:
        r = max(busy, key=lambda r: r["participants"])
        c = r["cpu_cores"]
        parts.append(
            f"At N={r['participants']} the machine was {c['machine_busy']:.1f}/{c['machine_cores']}"
            f" cores busy (etcd {c['etcd']}, simulated agents {c.get('agents')}, controller "
            f"process {c['controller_process']})."
        )
    return first, " ".join(parts)


def _plot(rows: list[dict[str, Any]], path: Path, conf: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    sizes = [r["participants"] for r in rows]

    def get(*path: str) -> Any:
        def read(r: dict[str, Any]) -> Any:
            v: Any = r
            for k in path:
                v = v.get(k) if isinstance(v, dict) else None
            return v

        return read

    def line(ax: Any, key: Any, label: str, **kw: Any) -> None:
        xs, ys = [], []
        for r in rows:
            v = key(r)
            if v is not None and v > 0:
                xs.append(r["participants"])
                ys.append(v)
        if xs:
            ax.plot(xs, ys, marker="o", label=label, **kw)

    ax = axes[0][0]
    line(ax, get("rendezvous_s"), "rendezvous (all N in one round)")
    line(ax, get("ranks_assigned_s"), "+ torchrun rank assignment")
    line(ax, get("join_answer_s"), "join request -> assignment")
    failed = [r for r in rows if r.get("rendezvous_completed") is False]
    if failed:
        ax.plot(
            [r["participants"] for r in failed],
            [r.get("rendezvous_s") or conf.join_timeout for r in failed],
            "rx",
            markersize=12,
            label=f"rendezvous failed (timed out: at the {conf.join_timeout}s join timeout)",
        )
    ax.set_ylabel("seconds")
    ax.set_title("Rendezvous")

    ax = axes[0][1]
    for r in rows:
        prog = r.get("rdzv_progress") or []
        if prog:
            ax.plot(
                [p[0] for p in prog],
                [p[1] / r["participants"] for p in prog],
                label=f"N={r['participants']}",
            )
    ax.set_xlabel("seconds since the participants started")
    ax.set_ylabel("participants in the round / N")
    ax.set_title("Rendezvous progress (etcd state, sampled)")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=8)

    ax = axes[0][2]
    line(ax, get("etcd_requests_per_s"), "etcd requests/s")
    line(ax, get("etcd_writes_per_s"), "etcd writes/s (raft proposals)")
    line(ax, get("reports_per_s"), "worker reports/s")
    ax.set_ylabel("per second")
    ax.set_title("etcd load (steady window)")

    ax = axes[1][0]
    line(ax, get("store_rows_per_s"), "store rows written/s")
    line(ax, get("store_commits_per_s"), "store commits/s")
    line(ax, get("events_drained_per_s"), "reports drained/s")
    ax.set_ylabel("per second")
    ax.set_title("Controller -> store")

    ax = axes[1][1]
    line(ax, get("drain_ms", "p50"), "drain p50")
    line(ax, get("drain_ms", "p95"), "drain p95")
    line(ax, lambda r: (get("report_age_s", "p95")(r) or 0) * 1e3, "report age p95")
    line(ax, get("client_ms", "abort_poll", "p95"), "worker etcd get p95", linestyle="--")
    line(ax, get("client_ms", "heartbeat", "p95"), "rdzv heartbeat p95", linestyle="--")
    ax.set_ylabel("milliseconds")
    ax.set_title("Latency")

    ax = axes[1][2]
    line(ax, get("cpu_cores", "etcd"), "etcd")
    line(ax, get("cpu_cores", "agents"), "simulated agents + workers")
    line(ax, get("cpu_cores", "controller_process"), "controller process")
    line(ax, get("cpu_cores", "machine_busy"), "whole machine", linestyle=":")
    ax.set_ylabel("CPU cores")
    ax.set_title("CPU (steady window)")

    for ax in [a for a in axes.flat if a is not axes[0][1]]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("participants (torchrun agents, one worker each)")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        for r in rows:
            if r["failed_phase"] or r["problems"]:
                ax.axvline(r["participants"], color="red", alpha=0.3, linestyle=":")
    failed = [str(r["participants"]) for r in rows if r["failed_phase"] or r["problems"]]
    note = f"; red dotted: problems at N={', '.join(failed)}" if failed else ""
    fig.suptitle(
        "Control plane vs participants: etcd v3 rendezvous, worker leases and reports, "
        f"controller + {conf.store} store{note}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
        "join_answer_s": col("join_answer_s"),
        "etcd_requests_per_s": col("etcd_requests_per_s"),
        "etcd_writes_per_s": col("etcd_writes_per_s"),
        "store_rows_per_s": col("store_rows_per_s"),
        "drain_ms_p95": col("drain_ms", "p95"),
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
    parser.add_argument("--hosts", type=int, default=Config.hosts, help="host processes")
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
        help="rendezvous keep_alive_interval (torch's default is 5)",
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
    )
    result = run(conf, out_dir() / "control_plane_scale.png")
    emit(result, save_as="control_plane_scale.json")


if __name__ == "__main__":
    main()
