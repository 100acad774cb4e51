"""The two roles of a torchx launch, each its own process (a pod on Kubernetes): the controller,
which supervises trainer pods it cannot see except through etcd, and a trainer pod's node,
which waits for the job's launch in etcd and then runs torchrun with the etcd3 rendezvous.
"""

from __future__ import annotations

import json
import os
import socket
import time

from pipetransformer.core import keys
from pipetransformer.core.protocol import TrainerRefused
from pipetransformer.core.spec import JobSpec, gpu_shortfall
from pipetransformer.edge import proctitle
from pipetransformer.edge.etcd_client import EtcdClient, EtcdUnavailable
from pipetransformer.orchestrator import forkserver
from pipetransformer.orchestrator.controller import Controller
from pipetransformer.orchestrator.errors import UsageError
from pipetransformer.orchestrator.gpus import cuda_device_count
from pipetransformer.orchestrator.launch import torchrun_command, with_job_secret, worker_env
from pipetransformer.orchestrator.procs import call_forwarding_signals

# how long a refusing trainer waits for the controller to count its refusal before it exits
REFUSAL_ACK_TIMEOUT = 30.0


class TrainerPods:
    """The trainer pods of a job, as the controller role sees them through etcd (a `Workers`):
    running while any worker holds its lease or any pod's launcher is present; done when the
    workers reported the job's end; given up on when none came, or all went without a word,
    within `join_timeout` seconds."""

    def __init__(self, ctrl: Controller, etcd: EtcdClient, join_timeout: float) -> None:
        self.ctrl, self.etcd, self.join_timeout = ctrl, etcd, join_timeout
        self._seen_until = time.monotonic() + join_timeout
        self._ended = False

    def _launchers(self) -> int:
        return self.etcd.count_prefix(keys.agents(self.ctrl.job_id))

    def poll(self) -> int | None:
        code = self._poll()
        self._ended = code is not None
        return code

    def _poll(self) -> int | None:
        if self.ctrl.progress.outcome:
            return 0
        if self.ctrl.workers_alive() or self._launchers():
            self._seen_until = time.monotonic() + 3 * self.ctrl.spec.runtime.lease_ttl_s
        elif time.monotonic() > self._seen_until:
            return 1  # workers never came, or all of them are gone without a word
        return None

    def detail(self, code: int | None) -> str:
        return ""  # their logs are the pods'

    def close(self) -> None:
        """The trainers' torchrun agents still use etcd after the last report (exit barrier,
        closing the rendezvous, revoking leases): an embedded etcd must outlive them, so wait
        (up to `join_timeout`) until every launcher has left."""
        if not self._ended:
            return  # an error: nothing to wait for
        gone = time.monotonic() + self.join_timeout
        while time.monotonic() < gone:
            try:
                if not self._launchers():
                    return
            except EtcdUnavailable:
                pass  # the job's end is recorded: waiting is all that is left to do
            time.sleep(0.2)


def serve_node(
    etcd: str,
    job_id: str,
    nproc_per_node: int,
    nnodes: str,
    max_restarts: int | None,
    join_timeout: float,
    workdir: str = "./runs",
) -> int:
    """A trainer pod's node: wait for the job's launch in etcd, then run torchrun (etcd3
    rendezvous) for it, its workers forked from this node's fork server, while a lease tells
    the controller this launcher is present. Returns torchrun's exit code."""
    client = EtcdClient(etcd, retry_timeout=join_timeout)
    deadline = time.monotonic() + join_timeout
    while (raw := client.get(keys.launch(job_id))) is None:
        if time.monotonic() > deadline:
            raise UsageError(f"job {job_id} has not been launched in etcd {etcd}")
        time.sleep(0.5)
    rdzv_id = json.loads(raw)["rdzv_id"]
    spec = JobSpec.model_validate_json(client.get(keys.spec(job_id)) or "{}")
    if problem := gpu_shortfall(spec.runtime.device, nproc_per_node, cuda_device_count()):
        # before torchrun: one clear line in the pod's log, not a traceback per worker; and the
        # controller hears it (it fails the job once refusals spend its restart budget)
        host, pid = socket.gethostname(), os.getpid()
        refused = TrainerRefused(reason=problem, host=host, pid=pid)
        key = keys.refusal(job_id, host, pid)
        client.put(key, refused.model_dump_json())
        # exit once the controller has counted it (it takes the key): each pod failure Volcano
        # counts against maxRetry is then one the controller counted first, so the controller
        # ends the job with the reason before Volcano's own retry limit can end it without one
        counted = time.monotonic() + min(join_timeout, REFUSAL_ACK_TIMEOUT)
        while client.get(key) is not None and time.monotonic() < counted:
            time.sleep(0.2)
        raise UsageError(problem)
    env = with_job_secret(worker_env(1), workdir, job_id)  # a node joining a local job
    env[proctitle.NODE_ENV] = socket.gethostname()  # the node its processes' titles name
    server, name = None, None
    if forkserver.available():  # this node's workers are forked from it, torch imported once
        server, name = forkserver.start(env, job_id=job_id)
    cmd = torchrun_command(
        etcd,
        job_id,
        rdzv_id,
        nproc_per_node,
        nnodes=nnodes,
        max_restarts=spec.runtime.max_restarts if max_restarts is None else max_restarts,
        forkserver=name,
    )
    # presence for the controller, which keeps its embedded etcd up until every launcher left
    lease = client.lease(ttl=10)
    client.put(f"{keys.agents(job_id)}{socket.gethostname()}-{os.getpid()}", "", lease=lease)
    keepalive = client.keep_alive(lease)
    try:
        # this is PID 1 of a trainer pod: a pod's stop must reach torchrun and the workers
        return call_forwarding_signals(cmd, env)
    finally:
        keepalive.stop(revoke=True)
        if server is not None:
            server.terminate()
            server.wait()
