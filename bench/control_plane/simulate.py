"""The simulated participants: one torchrun agent and its one worker as threads of a host process
(`_Participant`), making the etcd traffic the real ones make, with the project's own code. The
agent: the etcd3 rendezvous handler, torchrun's rank assignment, its monitor loop's
`num_nodes_waiting()`, the launcher's presence key; the worker: its presence lease, abort polls,
`Started` and `Metrics` reports through the worker's `Reporter`. `_summarise` counts what a host's
participants did in the steady window."""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipetransformer.core import keys
from pipetransformer.core.protocol import Metrics, Started
from pipetransformer.core.state import Layout
from pipetransformer.edge.etcd_client import EtcdClient

from .config import ABORT_POLL_S, AGENT_LEASE_S, MONITOR_S, Config


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

    @property
    def agent_etcd(self) -> EtcdClient:
        return self.handler._state_holder._backend._wire.client

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
        state = p.handler._state_holder.state
        p.result.update(rank=info.rank, world=info.world_size, round=state.round)
        odd = _view_apart(p.handler._state_holder._backend, state)
        if odd:
            p.result["view_apart"] = odd
        # what torchrun's agent does next with the rendezvous store (no `self` needed)
        workers = SimpleElasticAgent._assign_worker_ranks(
            None, info.store, info.rank, info.world_size, _OneWorkerSpec
        )
        p.result["t_assigned"] = time.time()
        p.result["global_rank"] = workers[0].global_rank
    except Exception as exc:
        p.result["error"] = f"{type(exc).__name__}: {exc}".rstrip(": ")[:500]


def _view_apart(backend: Any, state: Any) -> str | None:
    """Why the round this node finished with is not the one stored, or None: the participants
    torch's `_sanitize` took out of its view (a heartbeat past its window: here a node whose
    alive key this node did not hold), each with what this node knew of it."""
    stored = backend._follower.stored() if getattr(backend, "bound", False) else None
    if stored is None or stored.round != state.round:
        return None
    gone = [n for n in stored.participants if n not in state.participants]
    if not gone:
        return None
    now = datetime.now(UTC)
    known = {entry[0] for entry in backend._leases.keys.values()}
    said = [
        f"{n.addr}:{n.pid}:{n.local_id} (alive key {'held' if n in known else 'not held'}, "
        f"stored beat {(now - stored.last_heartbeats[n]).total_seconds():.1f}s old)"
        if n in stored.last_heartbeats
        else f"{n.addr}:{n.pid}:{n.local_id} (no stored beat)"
        for n in gone[:3]
    ]
    return (
        f"stored {len(stored.participants)}, view {len(state.participants)}, knew "
        f"{len(backend._leases.alive)} alive; not in its view: {', '.join(said)}"
    )


def _where(thread: threading.Thread) -> str:
    """The innermost calls of `thread`, as one line."""
    frames = sys._current_frames()
    stack = traceback.extract_stack(frames[thread.ident]) if thread.ident in frames else []
    return " < ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in stack[::-1][:6])


# The last participants of a host still in next_rendezvous() 1 s after the rest came back
# say where they are (`late_at`): the slowest node sets the figure.
_LATE_SHARE, _LATE_AFTER_S = 0.02, 1.0


def _rendezvous_all(parts: list[_Participant], target: Any, timeout: float) -> None:
    """`target(p)` for every participant at once (agents started together), within `timeout`."""
    threads = [threading.Thread(target=target, args=(p,), daemon=True) for p in parts]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    late_since: float | None = None
    while time.monotonic() < deadline:
        running = [(p, t) for p, t in zip(parts, threads, strict=True) if t.is_alive()]
        if not running:
            break
        # (back from next_rendezvous(), a thread goes on to torchrun's rank assignment)
        late = [(p, t) for p, t in running if "t_rdzv" not in p.result]
        if late and len(late) <= max(1, int(_LATE_SHARE * len(parts))):
            late_since = late_since or time.monotonic()
            if time.monotonic() - late_since >= _LATE_AFTER_S:
                for p, t in late:
                    p.result.setdefault("late_at", (time.time(), _where(t)))
        running[0][1].join(0.1)
    for p, t in zip(parts, threads, strict=True):
        if "t_rdzv" not in p.result and "error" not in p.result:
            p.result["error"] = f"next_rendezvous() did not return in time; at {_where(t)}"


def _backend_stats(parts: list[_Participant]) -> Counter[str]:
    """The agents' rendezvous backends' own counts (requests, bytes, heartbeats, combines ...;
    orchestrator.rendezvous.EtcdRendezvousBackend.stats), summed; maxima are left out."""
    total: Counter[str] = Counter()
    for p in parts:
        stats = getattr(p.handler._state_holder._backend, "stats", None) or {}
        total.update({k: v for k, v in stats.items() if not k.endswith("_max_ms")})
    return total


def _backend_maxima(parts: list[_Participant]) -> dict[str, int]:
    """The largest of each of the backends' maxima (the longest gap between two refreshes
    of a node's lease ...)."""
    top: dict[str, int] = {}
    for p in parts:
        stats = getattr(p.handler._state_holder._backend, "stats", None) or {}
        for k, v in stats.items():
            if k.endswith("_max_ms"):
                top[k] = max(top.get(k, 0), v)
    return top


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


def run_periodic(
    stop: threading.Event, tasks: list[list[Any]], threads: int
) -> list[threading.Thread]:
    """Run `tasks` ([next_due, period, fn] each) on `threads` threads, each taking every
    threads-th task: a host's simulated nodes share a few scheduling threads instead of two
    each (1,024 nodes' threads on 2 cores starve each other, which real nodes do not)."""
    started = []
    for i in range(max(1, min(threads, len(tasks)))):
        share = tasks[i::threads]
        t = threading.Thread(target=_periodic, args=(stop, share), daemon=True)
        t.start()
        started.append(t)
    return started


def _agent_tasks(p: _Participant, job: str) -> list[list[Any]]:
    """What a torchrun agent does while its workers run: the launcher's presence key, and the
    monitor loop's poll (as periodic tasks)."""
    lease = p.call("agent_lease", p.agent_etcd.lease, AGENT_LEASE_S)
    if lease is not None:
        key = f"{keys.agents(job)}{p.node.replace(':', '-')}"
        p.call("agent_put", p.agent_etcd.put, key, "", lease)
        p.agent_keepalive = p.agent_etcd.keep_alive(lease)

    if not p.rendezvoused:
        return []

    def monitor() -> None:  # torchrun's monitor loop asks whether nodes wait to join
        waiting = p.call("monitor", p.handler.num_nodes_waiting)
        state = p.handler._state_holder.state
        if waiting is not None:
            p.views.append((time.time(), waiting, len(state.participants), state.round))

    return [[time.monotonic() + random.uniform(0, MONITOR_S), MONITOR_S, monitor]]


def _worker_tasks(
    p: _Participant, job: str, generation: int, layout: Layout, conf: Config
) -> list[list[Any]]:
    """A worker's start (presence lease, `Started`), then what it does while it trains: abort
    polls and, where it reports, `Metrics` (as periodic tasks)."""
    from pipetransformer.trainer.process import Reporter, hold_presence

    rank = p.result["rank"]
    pipe = layout.pipeline_ranks
    p.presence = p.call("presence", hold_presence, p.wc, job, rank, generation, conf.lease_ttl_s)
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
    abort_key = keys.abort(job)

    def abort_watch() -> None:
        value = p.call("abort_poll", p.wc.get, abort_key)
        if value == str(generation) and p.aborted_at is None:
            p.aborted_at = time.time()

    tasks = [[time.monotonic() + random.uniform(0, ABORT_POLL_S), ABORT_POLL_S, abort_watch]]
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

        period = 1.0 / conf.step_hz
        tasks.append([time.monotonic() + random.uniform(0, period), period, train_step])
    return tasks


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
