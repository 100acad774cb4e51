"""A worker process's life around its training loop: reporting to the controller, joining a
generation, holding a lease, leaving on SIGTERM, and leaving at once when the controller aborts
the generation. The training itself is in `trainer.trainer`; `trainer.worker` wires the two.

Everything here talks to etcd or handles signals; none of it touches the model.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable

import torch.distributed as dist

from pipetransformer.core import keys
from pipetransformer.core.protocol import EXIT_REFORM, Assignment, JoinRequest, WorkerEvent
from pipetransformer.core.spec import JobSpec
from pipetransformer.edge.etcd_client import EtcdClient, EtcdError, KeepAlive
from pipetransformer.trainer.collective import from_rank0

log = logging.getLogger("pipetransformer.worker")


class Reporter:
    """Puts this rank's WorkerEvents into the job's etcd event queue (the controller drains it
    into the store; workers never write SQL)."""

    def __init__(self, etcd: EtcdClient, job_id: str, generation: int, rank: int):
        self.etcd, self.job_id, self.generation, self.rank = etcd, job_id, generation, rank
        self.seq = 0
        # a last word may come from the abort watch or the SIGTERM timer thread
        self._lock = threading.Lock()

    def emit(self, event_type: type[WorkerEvent], **fields: object) -> None:
        """Report one event, e.g. `emit(Metrics, step=3, ...)`; who and when are filled in."""
        event = event_type(rank=self.rank, generation=self.generation, **fields)
        with self._lock:
            key = keys.event(self.job_id, self.generation, self.rank, self.seq)
            self.etcd.put(key, event.model_dump_json())
            self.seq += 1

    def last_word(self, event_type: type[WorkerEvent], **fields: object) -> None:
        """A final report on the way out (the process exits right after): best effort, so that
        the controller can tell this rank's end from a death; an etcd that does not answer
        within a second costs nothing but the report."""
        done = threading.Event()

        def put() -> None:
            try:
                self.emit(event_type, **fields)
            except Exception:  # leaving anyway: the report is best effort
                pass
            finally:
                done.set()

        threading.Thread(target=put, name="last-word", daemon=True).start()
        done.wait(1.0)


def read_spec(etcd: EtcdClient, job_id: str, timeout: float = 60.0) -> JobSpec:
    """Wait for the controller to publish the spec (a torchx launch may start workers before
    the controller has written it)."""
    deadline = time.monotonic() + timeout
    while (raw := etcd.get(keys.spec(job_id))) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id!r} has no spec in etcd after {timeout}s")
        time.sleep(0.2)
    return JobSpec.model_validate_json(raw)


def node_id() -> str:
    """This worker's node: its torchrun agent, as "host:agent-pid" (host names alone repeat on
    one machine). A worker forked by the node's fork server is told its agent's pid."""
    agent = os.environ.get(keys.AGENT_PID_ENV) or str(os.getppid())
    return f"{socket.gethostname()}:{agent}"


def stdout_log() -> str | None:
    """The path of the file this process's stdout is written to, when that is a regular file
    (the worker's log, for the dashboard); None for a pipe, a terminal, or off Linux."""
    try:
        if not stat.S_ISREG(os.fstat(1).st_mode):
            return None
        path = os.readlink("/proc/self/fd/1")
    except OSError:  # stdout closed, or no /proc (not Linux)
        return None
    # "/x (deleted)" or an anonymous file is no path anyone can open
    return path if os.path.isabs(path) and os.path.exists(path) else None


def join(etcd: EtcdClient, job_id: str, rank: int, world: int) -> Assignment:
    """This rendezvous round asks the controller for its generation: rank 0 files a join
    request naming the round's world and nodes and waits for the assignment answering it (a
    controller being restarted answers when it is back); every rank gets the same answer."""
    me = [None] * world
    dist.all_gather_object(me, (node_id(), os.getpid()))

    def ask() -> Assignment:
        request = JoinRequest(
            id=uuid.uuid4().hex, world=world, nodes=[n for n, _ in me], pids=[p for _, p in me]
        )
        etcd.put(keys.join(job_id), request.model_dump_json())
        asked = time.monotonic()
        while True:
            raw = etcd.get(keys.assignment(job_id))
            if raw is not None:
                assignment = Assignment.model_validate_json(raw)
                if assignment.request == request.id or assignment.fatal:
                    return assignment
            if time.monotonic() - asked > 10:
                log.info("waiting for the controller to answer join request %s", request.id)
                asked = time.monotonic()
            time.sleep(0.05)

    return from_rank0(rank, ask)


def hold_presence(etcd: EtcdClient, job_id: str, rank: int, generation: int, ttl: int) -> KeepAlive:
    """Put this rank's presence key on a lease and keep it alive: the controller reads a lease
    that lapses without a final report as this rank's death."""
    lease = etcd.lease(ttl)
    presence = {"generation": generation, "pid": os.getpid(), "host": socket.gethostname()}
    etcd.put(keys.worker(job_id, rank), json.dumps(presence), lease=lease)
    return etcd.keep_alive(lease)


class AbortWatch:
    """Watches `keys.abort`: when the controller aborts this generation (a peer was lost), the
    process leaves at once with EXIT_REFORM, even from inside a collective that would otherwise
    wait for the dead peer until the collective timeout; its agent re-rendezvous. Polls (cheap,
    and immune to watch streams lost across an etcd restart). `before_exit` says its last word
    (so the controller knows this rank left as told rather than died)."""

    def __init__(
        self,
        etcd: EtcdClient,
        job_id: str,
        generation: int,
        every: float = 0.2,
        before_exit: Callable[[], None] | None = None,
    ):
        self.etcd, self.key, self.generation, self.every = (
            etcd,
            keys.abort(job_id),
            generation,
            every,
        )
        self.before_exit = before_exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abort-watch", daemon=True)

    def start(self) -> AbortWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                value = self.etcd.get(self.key)
            except EtcdError:
                continue  # etcd restarting: the lease outlives it, keep watching
            if value == str(self.generation):
                log.warning("generation %d aborted by the controller: leaving", self.generation)
                if self.before_exit is not None:
                    self.before_exit()
                logging.shutdown()
                os._exit(EXIT_REFORM)

    def stop(self) -> None:
        self._stop.set()


class LeaveRequest:
    """SIGTERM asks the worker to leave gracefully: finish the step, checkpoint with everyone,
    exit (EXIT_REFORM). If that cannot happen within `grace_s` (e.g. a peer is gone and a
    collective blocks), it exits anyway."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.requested = False
        self._lock = threading.Lock()
        # the last word before the grace runs out (set once the worker can report)
        self.before_exit: Callable[[], None] | None = None

    def install(self) -> LeaveRequest:
        """From the main thread. Python runs signal handlers only between the main thread's
        bytecodes, so a worker blocked in a collective or an RPC would not even start its grace
        timer; the C-level handler also writes the signal number to a wakeup fd, and a thread
        reading it starts the timer at once."""
        signal.signal(signal.SIGTERM, lambda signum, frame: self.request())
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="leave", daemon=True).start()
        return self

    def _watch(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):
            if signal.SIGTERM in data:
                self.request()

    def request(self) -> None:
        with self._lock:
            if self.requested:
                return
            self.requested = True
        timer = threading.Timer(self.grace_s, self._expire)
        timer.daemon = True
        timer.start()

    def _expire(self) -> None:
        if self.before_exit is not None:
            self.before_exit()
        os._exit(EXIT_REFORM)


def hold(assignment: Assignment, leave: LeaveRequest) -> int:
    """No layout fits this world: keep the lease and wait until the agents re-rendezvous (a
    node joined: they stop us) or we are told to leave."""
    log.warning("%s", assignment.waiting)
    while not leave.requested:
        time.sleep(0.2)
    return EXIT_REFORM
