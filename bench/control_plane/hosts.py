"""The host processes, each running many simulated participants as threads. `host_main` is what
one runs: the spawn target, so it stays importable as `control_plane.hosts.host_main`. It is
driven phase by phase over its command queue (go, join, steady, stop, rejoin, quit) and answers
on the shared result queue (ready, rdzv, joined, steady, stats, rejoined, or error). `Hosts` is
the benchmark's side: it starts them, sends commands and collects one answer from each within a
deadline."""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipetransformer.core import keys
from pipetransformer.core.protocol import Assignment, JoinRequest
from pipetransformer.core.state import Layout
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.orchestrator.launch import FIRST_CALL_S, HEARTBEATS_MISSED, LAST_CALL_S

from .config import JOB, JOIN_POLL_S, SCHEDULING_THREADS, Config, PhaseFailed
from .simulate import (
    _agent_tasks,
    _backend_maxima,
    _backend_stats,
    _Participant,
    _rendezvous,
    _rendezvous_all,
    _summarise,
    _time_heartbeats,
    _WarningCounter,
    _worker_tasks,
    run_periodic,
)


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


class _GcClock:
    """Time this host's interpreter spends in the cyclic garbage collector, and its full
    collections (each walks every object of every simulated node in the process)."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.full = 0
        self._t0 = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        self.ms += 1e3 * (time.perf_counter() - self._t0)
        self.full += info.get("generation") == 2

    def mark(self) -> tuple[float, int]:
        return self.ms, self.full

    def since(self, mark: tuple[float, int]) -> dict[str, int]:
        """What the collector took since `mark` (summed over the hosts by the benchmark)."""
        return {"host_gc_ms": int(self.ms - mark[0]), "host_gc_full": self.full - mark[1]}


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


def _die(p: _Participant) -> None:
    """A simulated node stops: torch's heartbeats and its backend's lease refresher."""
    p.handler._stop_heartbeats()
    p.handler._state_holder._backend.close()


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

    from pipetransformer.orchestrator.rendezvous import create_etcd3_handler
    from pipetransformer.trainer.process import Reporter  # noqa: F401  (imported once here, not in a thread)

    rdzv_conf = {
        "join_timeout": conf.join_timeout,
        "last_call_timeout": LAST_CALL_S,
        "first_call_timeout": FIRST_CALL_S,
        "keep_alive_interval": conf.heartbeat(world),
        "keep_alive_max_attempt": HEARTBEATS_MISSED,
        "read_timeout": conf.join_timeout,
    }
    params = RendezvousParameters(
        backend="etcd3",
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=conf.min_nodes(world),
        max_nodes=world,
        local_addr="127.0.0.1",
        **rdzv_conf,
    )
    # The host's simulated agents share one etcd connection, and its workers another: etcd
    # sees every request a real node makes, over 2 connections per host rather than 2 per node
    # (a gRPC channel and its threads per simulated node starve 2 cores at 1,024 nodes).
    agents_etcd = EtcdClient(endpoint, retry_timeout=conf.join_timeout)
    workers_etcd = EtcdClient(endpoint)
    parts = [
        _Participant(create_etcd3_handler(params, agents_etcd), workers_etcd) for _ in range(count)
    ]
    for p in parts:
        _time_heartbeats(p)
    gc_clock = _GcClock()
    cpu: list[tuple[float, float]] = []
    stop_cpu = threading.Event()

    def sample_cpu() -> None:
        while not stop_cpu.wait(0.5):
            cpu.append((time.time(), time.process_time()))

    threading.Thread(target=sample_cpu, daemon=True).start()
    res_q.put(("ready", index, {"pid": os.getpid(), "participants": count}))

    # rendezvous: all participants at once, as agents started together
    _expect(cmd_q, "go", conf.startup_timeout + conf.phase_timeout)
    before, gc_mark = _backend_stats(parts), gc_clock.mark()
    _rendezvous_all(parts, _rendezvous, conf.join_timeout + 30)
    results = [dict(p.result, pid=os.getpid()) for p in parts]
    spent = {**(_backend_stats(parts) - before), **gc_clock.since(gc_mark)}
    backend = {**spent, **_backend_maxima(parts)}
    res_q.put(("rdzv", index, {"parts": results, "backend": backend}))

    # the round's rank 0 asks the controller for a generation (trainer.process.join)
    msg = _expect(cmd_q, "join", conf.join_timeout + conf.phase_timeout)
    if msg[3] is not None:  # the rendezvous failed: the benchmark hands out the ranks
        for p, rank in zip(parts, msg[3], strict=True):
            p.result["rank"] = rank
            p.rendezvoused = False
            _die(p)  # those that did return: no agents in this steady state
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
    steady_backend = _backend_stats(parts)
    stop = threading.Event()

    def start(p: _Participant) -> list[list[Any]]:
        return _agent_tasks(p, JOB) + _worker_tasks(p, JOB, generation, layout, conf)

    # every participant's agent and worker start at once (a pool, as the nodes start in
    # parallel), then a few threads run all their periodic polls and reports
    with ThreadPoolExecutor(max_workers=min(64, count)) as pool:
        tasks = [t for ts in pool.map(start, parts) for t in ts]
    loops = run_periodic(stop, tasks, SCHEDULING_THREADS)
    res_q.put(("steady", index, {"threads": threading.active_count()}))

    msg = _expect(cmd_q, "stop", 1e6)  # the benchmark bounds the steady phase
    t0, t1 = msg[1], msg[2]
    stop.set()
    for t in loops:
        t.join(timeout=5.0)
    summary = _summarise(parts, t0, t1)
    summary["threads"] = threading.active_count()
    # what the agents' rendezvous backends cost while steady (heartbeats, monitor reads)
    summary["backend"] = dict(_backend_stats(parts) - steady_backend)
    summary["backend_s"] = time.time() - steady
    inside = [c for c in cpu if t0 <= c[0] <= t1]
    summary["cpu_s"] = inside[-1][1] - inside[0][1] if len(inside) > 1 else None
    summary["cpu_window_s"] = inside[-1][0] - inside[0][0] if len(inside) > 1 else None
    stop_cpu.set()
    # how it ends for the controller: rank 0 reports the end, then every lease goes
    rank0 = [p for p in parts if p.result.get("rank") == 0 and p.reporter is not None]
    if msg[3] and rank0:
        from pipetransformer.core.protocol import Finished

        rank0[0].call("report", rank0[0].reporter.emit, Finished, kind="done", outcome="done")
    # while steady (what the rendezvous logged before is in its own figures)
    seen = [w for w in warnings.seen if w[0] >= steady]
    summary["warnings"] = dict(Counter(kind for _, kind, _ in seen))
    summary["warnings_in_window"] = dict(Counter(k for when, k, _ in seen if t0 <= when < t1))
    summary["warning_samples"] = [m for _, _, m in seen[:3]]
    res_q.put(("stats", index, summary))  # first: ending a thousand leases takes a while

    def end(keepalive: Any) -> None:
        try:
            keepalive.stop(revoke=True)
        except Exception:
            pass

    # each lease revoked and its thread joined: in parallel, as the nodes end in parallel
    leases = [k for p in parts for k in (p.presence, p.agent_keepalive) if k is not None]
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(leases)))) as pool:
        list(pool.map(end, leases))
    res_q.put(("ended", index, None))

    # one agent is lost (its heartbeats stop, as when its node dies); the others meet again, as
    # torchrun does when its workers fail with the lost node's (they all notice within seconds)
    msg = cmd_q.get(timeout=conf.phase_timeout * 3)  # the controller's end is awaited first
    if msg[0] == "rejoin":
        victim = msg[1]
        lost = [p for p in parts if p.result.get("rank") == victim]
        for p in lost:
            _die(p)
        survivors = [p for p in parts if p not in lost]
        for p in survivors:
            p.result = {"node": p.node}
        before, gc_mark = _backend_stats(parts), gc_clock.mark()
        _rendezvous_all(survivors, _rendezvous, conf.rejoin_timeout)
        results = [dict(p.result, pid=os.getpid()) for p in survivors]
        spent = {**(_backend_stats(parts) - before), **gc_clock.since(gc_mark)}
        res_q.put(
            ("rejoined", index, {"parts": results, "backend": {**spent, **_backend_maxima(parts)}})
        )
        msg = cmd_q.get(timeout=conf.phase_timeout)
    for p in parts:
        _die(p)
        p.wc.close()
        p.agent_etcd.close()
    if msg[0] != "quit":
        raise RuntimeError(f"expected 'quit', got '{msg[0]}'")


class Hosts:
    """The host processes of one size and their queues."""

    def __init__(self, n: int, conf: Config, endpoint: str, run_id: str) -> None:
        ctx = mp.get_context("spawn")
        k = conf.hosts_for(n)
        self.counts = [n // k + (1 if i < n % k else 0) for i in range(k)]
        self.res_q = ctx.Queue()
        self._early: list[Any] = []  # messages read while collecting another kind
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
        """One `kind` message from each of `hosts` (default all) within `timeout` seconds (a
        message of another kind that arrives meanwhile is kept for its own `collect`)."""
        want = set(range(len(self.procs)) if hosts is None else hosts)
        got: dict[int, Any] = {}
        for msg in [m for m in self._early if m[0] == kind and m[1] in want]:
            self._early.remove(msg)
            got[msg[1]] = msg[2]
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
            if msg[0] == kind and msg[1] in want:
                got[msg[1]] = msg[2]
            else:
                self._early.append(msg)
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
