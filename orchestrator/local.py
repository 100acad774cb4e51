"""`pipetransformer run` and `resume` on one machine: every node of the job as a local torchrun
agent with its own fork server, the job's own embedded etcd, and the checks that the machine can
seat the job (memory, one GPU per worker on CUDA) before anything is created.

The controller's lifecycle is `Controller.run`'s; this module only launches and watches the
local processes it supervises (`Agents`, a `Workers`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from pipetransformer.core import keys
from pipetransformer.core.spec import JobSpec, gpu_shortfall, local_device_type
from pipetransformer.edge import proctitle
from pipetransformer.edge.etcd_client import EtcdClient, EtcdUnavailable
from pipetransformer.edge.overrides import endpoint_file
from pipetransformer.orchestrator import admission, forkserver
from pipetransformer.orchestrator.controller import Controller, job_dir
from pipetransformer.orchestrator.errors import UsageError
from pipetransformer.orchestrator.etcd_server import EmbeddedEtcd
from pipetransformer.orchestrator.gpus import cuda_device_count
from pipetransformer.orchestrator.launch import job_secret_file, torchrun_command, worker_env
from pipetransformer.orchestrator.procs import tied_to_parent
from pipetransformer.orchestrator.progress import ProgressView

# -- the job's etcd ------------------------------------------------------------------------------


@contextlib.contextmanager
def job_etcd(
    endpoint: str | None, workdir: str | Path, job_id: str, port: int | None = None
) -> Iterator[EtcdClient]:
    """The etcd to coordinate through: `endpoint` (an external one, `--etcd`) if given, else an
    embedded server (on `port`, or a free one) whose data lives with the job, so `resume` finds
    the same keyspace."""
    if endpoint:
        client = EtcdClient(endpoint)
        try:
            client.wait_ready(10)
        except EtcdUnavailable as exc:
            raise UsageError(f"--etcd {endpoint}: {exc}") from None
        with client:
            yield client
        return
    server = EmbeddedEtcd(job_dir(workdir, job_id) / "etcd", client_port=port or None)
    found_at = endpoint_file(workdir, job_id)
    # the embedded etcd is plaintext on loopback: no TLS, whatever the environment asks
    with server, EtcdClient(server.endpoint, tls=None) as client:
        found_at.write_text(server.endpoint)  # how `freeze` and the dashboard find a running job
        try:
            yield client
        finally:
            found_at.unlink(missing_ok=True)


# -- can this machine seat the job? ----------------------------------------------------------------


def gpu_memory(spec: JobSpec) -> int | None:
    """The smallest GPU's memory when this machine's workers will compute on CUDA, else None."""
    gpus = cuda_device_count()
    if not gpus or local_device_type(spec.runtime.device, spec.parallel.world_size, gpus) != "cuda":
        return None
    import torch  # imported by cuda_device_count already

    return min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))


def machine_gpu_shortfall(spec: JobSpec) -> str | None:
    """Why this machine cannot give each of a node's workers its own GPU when the spec asks for
    CUDA (`run` puts every node on this machine)."""
    return gpu_shortfall(spec.runtime.device, spec.parallel.world_size, cuda_device_count())


def admission_problems(spec: JobSpec, here: bool) -> list[tuple[str, str]]:
    """Why the job cannot run, as (field, problem) pairs. `here` (`run`): every worker runs on
    this machine, so they must fit its memory together (or each its GPU). Otherwise (the
    controller role) the workers run on pods whose memory is not known here, so only what needs
    no machine is checked (the batch against the data set)."""
    capacity, gpu = (admission.host_memory_bytes(), None) if here else (None, None)
    if here and (gpu := gpu_memory(spec)) is not None:
        capacity = gpu  # each worker on a GPU of its own: checked against the smallest
    problems = admission.admit(
        spec, capacity, per_worker=gpu is not None, where="each GPU" if gpu else "this machine"
    )
    if here and (shortfall := machine_gpu_shortfall(spec)):
        problems.append(("runtime.device", shortfall))
    return problems


# -- the agents ------------------------------------------------------------------------------------


def node_gpus(node: int, per_node: int, visible: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for simulated node `node` of `per_node` workers: its slice of this
    machine's visible GPUs (of $CUDA_VISIBLE_DEVICES when set), so that worker k of each node,
    on cuda:k, has a GPU of its own."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    ids = ids or [str(i) for i in range(cuda_device_count())]
    return ",".join(ids[node * per_node : (node + 1) * per_node])


def node_devices(spec: JobSpec, nodes: int) -> list[dict[str, str]]:
    """Per local node, the CUDA_VISIBLE_DEVICES its workers get. All nodes of `run` share this
    machine: on CUDA each gets its own slice of the GPUs (worker k of a node computes on its
    cuda:k); when `runtime.device: auto` comes out as the CPU for the machine as a whole, the GPUs
    are hidden, so that no node decides otherwise on its own."""
    gpus = cuda_device_count()
    if not gpus:
        return [{} for _ in range(nodes)]
    if local_device_type(spec.runtime.device, spec.parallel.world_size, gpus) == "cpu":
        return [{"CUDA_VISIBLE_DEVICES": ""} for _ in range(nodes)]
    per_node = spec.parallel.world_size // nodes
    return [{"CUDA_VISIBLE_DEVICES": node_gpus(k, per_node)} for k in range(nodes)]


def agent_command(
    spec: JobSpec, job_id: str, etcd: str, rdzv_id: str
) -> Callable[[str | None], list[str]]:
    """The torchrun agent command of each of `runtime.nodes` nodes (given the node's fork
    server), each running its share of the spec's workers; elastic between `runtime.min_nodes`
    and `runtime.nodes` when there is more than one."""
    rt = spec.runtime
    nnodes = f"{rt.min_nodes or 1}:{rt.nodes}" if rt.nodes > 1 else "1"
    per_node = spec.parallel.world_size // rt.nodes
    return lambda server: torchrun_command(
        etcd, job_id, rdzv_id, per_node, nnodes, rt.max_restarts, forkserver=server
    )


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Agents:
    """The local torchrun agents of one launch, one per node, each with the node's fork server
    (workers start without importing torch again). Each runs in its own session (a terminal
    Ctrl-C reaches only us; the first one stops the workers gracefully through `on_interrupt`,
    a second kills them), tied to this process (they die with it), and logs to its own file.
    The processes of node k are titled with `job_id` and node k (edge/proctitle.py)."""

    def __init__(
        self,
        command: Callable[[str | None], list[str]],
        logs: list[Path],
        env: dict[str, str],
        node_env: list[dict[str, str]] | None = None,
        on_interrupt: Callable[[], None] | None = None,
        job_id: str | None = None,
    ):
        self.logs = logs
        self.procs: list[subprocess.Popen] = []
        self.servers: list[subprocess.Popen] = []
        self._interrupts = 0
        self._on_interrupt = on_interrupt
        self._previous = signal.signal(signal.SIGINT, self._interrupt) if on_interrupt else None
        for k, path in enumerate(logs):
            env_k = env | (node_env[k] if node_env else {}) | {proctitle.NODE_ENV: str(k)}
            name = None
            if forkserver.available():
                server, name = forkserver.start(env_k, path, new_session=True, job_id=job_id)
                self.servers.append(server)
            with open(path, "ab") as log:
                self.procs.append(
                    subprocess.Popen(
                        tied_to_parent(command(name)),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env_k,
                        start_new_session=True,
                    )
                )

    def _interrupt(self, signum: int, frame: object) -> None:
        self._interrupts += 1
        if self._interrupts == 1 and self._on_interrupt is not None:
            self._on_interrupt()
        else:
            self.kill()

    def poll(self) -> int | None:
        """None while any agent runs; then the first non-zero exit code (or 0)."""
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c), 0)

    def detail(self, code: int | None) -> str:
        """The last lines of every agent's log when they failed."""
        if code == 0:
            return ""
        return "\n".join(f"last lines of {path}:\n{_tail(path)}" for path in self.logs)

    def kill(self) -> None:
        for p in self.procs + self.servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

    def close(self) -> None:
        """Give Ctrl-C back, and stop the fork servers once the agents are done (their workers
        have exited)."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        for p in self.servers:
            p.terminate()
            p.wait()


def train_here(ctrl: Controller, etcd: EtcdClient, console: Console, err: Console) -> str:
    """Run the job's controller over torchrun agents on this machine, one per node, to the end:
    every rendezvous round they form becomes a generation (re-formed after a failure, widened
    when a node is back). Returns the job's state."""
    rdzv_id = f"{ctrl.job_id}-{uuid.uuid4().hex[:6]}"
    spec = ctrl.spec
    command = agent_command(spec, ctrl.job_id, etcd.endpoint, rdzv_id)
    jdir = job_dir(ctrl.job.workdir, ctrl.job_id)
    logs = [jdir / f"workers-{rdzv_id}-n{i}.log" for i in range(spec.runtime.nodes)]
    launched: list[Agents] = []

    def stop() -> None:
        console.print("[yellow]stopping: workers checkpoint and exit (Ctrl-C again to kill)")
        ctrl.request_stop("interrupted by user (Ctrl-C)")

    def launch(attached: bool) -> Agents:
        start = ctrl.resume_point().state
        if start.checkpoint:
            console.print(
                f"resuming from [bold]{start.checkpoint}[/] (epoch {start.epoch}, step {start.step})"
            )
        console.print(f"workers: {len(logs)} x {' '.join(command(None)[2:9])} ... (log: {logs[0]})")
        env = worker_env(spec.runtime.threads_per_worker)
        env[keys.RDZV_SECRET_FILE_ENV] = str(job_secret_file(ctrl.job.workdir, ctrl.job_id))
        env.pop(keys.RDZV_SECRET_ENV, None)  # the job's own secret, not one from the shell
        devices = node_devices(spec, len(logs))
        launched.append(Agents(command, logs, env, devices, stop, job_id=ctrl.job_id))
        return launched[-1]

    with ProgressView(console, ctrl.layout) as view:
        state = ctrl.run(rdzv_id, launch, on_tick=view.update)
    code_detail = launched[-1].detail(launched[-1].poll()) if launched else ""
    if code_detail and ctrl.progress.outcome != "stopped":
        err.print(escape(code_detail))
    return state
