"""`pipetransformer`: run, resume, inspect and watch elastic pipeline training jobs.

Every command takes the same `--workdir` (default ./runs: the SQLite store, each job's embedded
etcd data and its checkpoints) and `--db URL` / `--etcd HOST:PORT` to use external services, so
`status`, `resume` and `dashboard` find what `run` wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy.engine import make_url

from core import keys
from core.etcd_client import EtcdClient, EtcdUnavailable
from core.overrides import (
    OverrideError,
    endpoint_file,
    file_freeze_request,
    live_etcd_endpoint,
)
from core.readings import mfu_text, peak_memory_text
from core.spec import (
    JobSpec,
    SpecError,
    gpu_shortfall,
    load_spec,
    local_device_type,
    spec_from_text,
)
from orchestrator import forkserver
from orchestrator.controller import (
    Controller,
    ControllerError,
    check_job_id,
    job_dir,
    new_job_id,
)
from orchestrator.etcd_server import EmbeddedEtcd
from orchestrator.launch import torchrun_command, worker_env
from orchestrator.pretrained import resolve_init
from orchestrator.procs import tied_to_parent
from orchestrator.progress import ProgressView
from orchestrator.summary import (
    bought_line,
    cache_line,
    history_from_store,
    history_table,
)
from store import DB_ENV, Store, UnknownJob, sqlite_url

# Logs and pipes get a wide console: rich's 80-column default would cut paths in the summary.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False)


class UsageError(Exception):
    """Bad input from the user: printed without a traceback, exit code 2."""


# -- shared plumbing ---------------------------------------------------------------------------


def local_store_url(args: argparse.Namespace) -> str:
    """The default store: SQLite in --workdir."""
    return sqlite_url(Path(args.workdir).resolve() / "store.db")


def db_url(args: argparse.Namespace) -> str:
    """--db, else $PIPETRANSFORMER_DB (from a Secret in a pod), else SQLite in --workdir."""
    return args.db or os.environ.get(DB_ENV) or local_store_url(args)


def shown_url(url: str) -> str:
    """A store URL fit for output and logs: its password masked (a pod's URL comes from a
    Secret, and pod logs are read by many)."""
    return make_url(url).render_as_string(hide_password=True)


def open_store(args: argparse.Namespace, create: bool = False) -> Store:
    url = db_url(args)
    if (
        not create
        and url == local_store_url(args)
        and not (Path(args.workdir) / "store.db").exists()
    ):
        raise UsageError(
            f"no store at {Path(args.workdir).resolve() / 'store.db'}; "
            f"run a job first or pass the --workdir/--db (or ${DB_ENV}) that `run` used"
        )
    return Store.open(url)


@contextlib.contextmanager
def etcd_for(
    args: argparse.Namespace, job_id: str, port: int | None = None
) -> Iterator[EtcdClient]:
    """The etcd to coordinate through: `--etcd` if given, else an embedded server (on `port`, or
    a free one) whose data lives with the job, so `resume` finds the same keyspace."""
    if args.etcd:
        client = EtcdClient(args.etcd)
        try:
            client.wait_ready(10)
        except EtcdUnavailable as exc:
            raise UsageError(f"--etcd {args.etcd}: {exc}") from None
        with client:
            yield client
        return
    server = EmbeddedEtcd(job_dir(args.workdir, job_id) / "etcd", client_port=port or None)
    found_at = endpoint_file(args.workdir, job_id)
    with server, EtcdClient(server.endpoint) as client:
        found_at.write_text(server.endpoint)  # how `freeze` and the dashboard find a running job
        try:
            yield client
        finally:
            found_at.unlink(missing_ok=True)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- run / resume ------------------------------------------------------------------------------


def _agent_command(ctrl: Controller, etcd: str, rdzv_id: str) -> Callable[[str | None], list[str]]:
    """The torchrun agent command of each of `runtime.nodes` nodes (given the node's fork
    server), each running its share of the spec's workers; elastic between `runtime.min_nodes`
    and `runtime.nodes` when there is more than one."""
    rt = ctrl.spec.runtime
    nnodes = f"{rt.min_nodes or 1}:{rt.nodes}" if rt.nodes > 1 else "1"
    per_node = ctrl.spec.parallel.world_size // rt.nodes
    return lambda server: torchrun_command(
        etcd, ctrl.job_id, rdzv_id, per_node, nnodes, rt.max_restarts, forkserver=server
    )


def node_gpus(node: int, per_node: int, visible: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for simulated node `node` of `per_node` workers: its slice of this
    machine's visible GPUs (of $CUDA_VISIBLE_DEVICES when set), so that worker k of each node,
    on cuda:k, has a GPU of its own."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    import torch

    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else None
    ids = ids or [str(i) for i in range(torch.cuda.device_count())]
    return ",".join(ids[node * per_node : (node + 1) * per_node])


class Agents:
    """The local torchrun agents of one launch, one per node, each with the node's fork server
    (workers start without importing torch again). Each runs in its own session (a terminal
    Ctrl-C reaches only us; we stop the workers gracefully), tied to this process (they die with
    it), and logs to its own file."""

    def __init__(
        self,
        command: Callable[[str | None], list[str]],
        logs: list[Path],
        env: dict[str, str],
        node_env: list[dict[str, str]] | None = None,
    ):
        self.logs = logs
        self.procs: list[subprocess.Popen] = []
        self.servers: list[subprocess.Popen] = []
        for k, path in enumerate(logs):
            env_k = env | (node_env[k] if node_env else {})
            name = None
            if forkserver.available():
                server, name = forkserver.start(env_k, path, new_session=True)
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

    def poll(self) -> int | None:
        """None while any agent runs; then the first non-zero exit code (or 0)."""
        codes = [p.poll() for p in self.procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c), 0)

    def kill(self) -> None:
        for p in self.procs + self.servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

    def close(self) -> None:
        """Stop the fork servers once the agents are done (their workers have exited)."""
        for p in self.servers:
            p.terminate()
            p.wait()


def _train_generation(store: Store, etcd: EtcdClient, ctrl: Controller) -> str:
    """Launch the job's torchrun agents and supervise them to the end: every rendezvous round
    they form becomes a generation (re-formed after a failure, widened when a node is back)."""
    ctrl.acquire()
    try:
        rdzv_id = f"{ctrl.job_id}-{uuid.uuid4().hex[:6]}"
        ctrl.publish(rdzv_id)
        command = _agent_command(ctrl, etcd.endpoint, rdzv_id)
        jdir = job_dir(ctrl.job.workdir, ctrl.job_id)
        logs = [jdir / f"workers-{rdzv_id}-n{i}.log" for i in range(ctrl.spec.runtime.nodes)]
        start = ctrl.resume_point().state
        if start.checkpoint:
            console.print(
                f"resuming from [bold]{start.checkpoint}[/] (epoch {start.epoch}, step {start.step})"
            )
        console.print(f"workers: {len(logs)} x {' '.join(command(None)[2:9])} ... (log: {logs[0]})")
        with ProgressView(console, ctrl.layout) as view:
            env = worker_env(ctrl.spec.runtime.threads_per_worker)
            agents = Agents(command, logs, env, _node_devices(ctrl.spec, len(logs)))
            interrupts = 0

            def on_sigint(signum: int, frame: object) -> None:
                nonlocal interrupts
                interrupts += 1
                if interrupts == 1:
                    console.print(
                        "[yellow]stopping: workers checkpoint and exit (Ctrl-C again to kill)"
                    )
                    ctrl.request_stop("interrupted by user (Ctrl-C)")
                else:
                    agents.kill()

            previous = signal.signal(signal.SIGINT, on_sigint)
            try:
                code = ctrl.supervise(agents.poll, view.update)
            finally:
                signal.signal(signal.SIGINT, previous)
                agents.close()
        detail = (
            "" if code == 0 else "\n".join(f"last lines of {path}:\n{_tail(path)}" for path in logs)
        )
        if detail and ctrl.progress.outcome != "stopped":
            err.print(escape(detail))
        return ctrl.finish(code, detail)
    finally:
        ctrl.release()


def _summary(store: Store, ctrl: Controller, args: argparse.Namespace, started: float) -> int:
    job = store.get_job(ctrl.job_id)
    ckpt = store.latest_checkpoint(ctrl.job_id)
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_row("job", f"{job.id} ({job.state})")
    if job.message:
        table.add_row("message", escape(job.message))
    acc = f"{job.accuracy:.2%}" if job.accuracy is not None else "n/a"
    table.add_row("held-out accuracy", acc)
    table.add_row("progress", f"epoch {job.epoch}, step {job.step}")
    table.add_row("wall time", f"{time.monotonic() - started:.1f}s")
    table.add_row("store", shown_url(db_url(args)))
    table.add_row("checkpoints", str(job_dir(job.workdir, job.id) / "checkpoints"))
    if ckpt:
        table.add_row("last committed", f"{ckpt.path} (step {ckpt.step})")
    where = f"--db '{args.db}'" if args.db else f"--workdir {args.workdir}"
    table.add_row("dashboard", f"pipetransformer dashboard {where}")
    if job.state != "completed":
        table.add_row("resume", f"pipetransformer resume {job.id} {where}")
    console.rule("summary")
    console.print(table)
    # What the elastic machinery did: one row per layout version, and what re-laying out bought
    history, bought = history_from_store(store, job.id)
    if history:
        console.print()
        console.print(history_table(history))
        console.print(bought_line(history, bought))
        cached = cache_line(store.events(job.id, limit=1000))
        if cached:
            console.print(escape(cached))
    if job.state == "completed":
        return 0
    return 130 if ctrl.progress.outcome == "stopped" else 1  # 130: stopped on request (Ctrl-C)


def _read_spec(spec_path: str | None) -> JobSpec:
    """The spec file, or (no path) the YAML text in $PIPETRANSFORMER_SPEC: how a pod gets it,
    since the submitting machine's files are not in the pod."""
    if spec_path:
        return load_spec(spec_path)
    text = os.environ.get(keys.SPEC_ENV)
    if not text:
        raise UsageError(f"give a spec file, or its YAML text in ${keys.SPEC_ENV}")
    return spec_from_text(text, f"${keys.SPEC_ENV}")


def _node_devices(spec: JobSpec, nodes: int) -> list[dict[str, str]]:
    """Per local node, the CUDA_VISIBLE_DEVICES its workers get. All nodes of `run` share this
    machine: on CUDA each gets its own slice of the GPUs (worker k of a node computes on its
    cuda:k); when `runtime.device: auto` comes out as the CPU for the machine as a whole, the GPUs
    are hidden, so that no node decides otherwise on its own."""
    import torch

    gpus = torch.cuda.device_count()
    if not gpus:
        return [{} for _ in range(nodes)]
    if local_device_type(spec.runtime.device, spec.parallel.world_size, gpus) == "cpu":
        return [{"CUDA_VISIBLE_DEVICES": ""} for _ in range(nodes)]
    per_node = spec.parallel.world_size // nodes
    return [{"CUDA_VISIBLE_DEVICES": node_gpus(k, per_node)} for k in range(nodes)]


def _gpu_memory(spec: JobSpec) -> int | None:
    """The smallest GPU's memory when this machine's workers will compute on CUDA, else None."""
    import torch

    gpus = torch.cuda.device_count()
    if not gpus or local_device_type(spec.runtime.device, spec.parallel.world_size, gpus) != "cuda":
        return None
    return min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus))


def _gpu_shortfall(spec: JobSpec) -> str | None:
    """Why this machine cannot give each of a node's workers its own GPU when the spec asks for
    CUDA (`run` puts every node on this machine)."""
    import torch

    return gpu_shortfall(spec.runtime.device, spec.parallel.world_size, torch.cuda.device_count())


def _new_job(args: argparse.Namespace, spec_path: str | None, fresh: bool = True):
    """Validate a new job's spec and id before anything is created; then its store. With `fresh`
    (the job cannot exist yet) a fine-tuning spec's checkpoint is checked here too; a controller
    that may be continuing its job leaves that to `Controller.create`.

    Admission: a spec whose job cannot run is refused here too. `run` (`fresh`) puts every worker
    on this machine, so they must fit its memory together; the controller role's workers run on
    other pods whose memory it does not know, so it checks only what needs no machine (the batch
    against the data set)."""
    from orchestrator import admission  # imported where used: only `run` paths need it

    spec = _read_spec(spec_path)  # rejects a bad spec before anything starts
    capacity, gpu = (admission.host_memory_bytes(), None) if fresh else (None, None)
    if fresh and (gpu := _gpu_memory(spec)) is not None:
        capacity = gpu  # each worker on a GPU of its own: checked against the smallest
    problems = admission.admit(
        spec, capacity, per_worker=gpu is not None, where="each GPU" if gpu else "this machine"
    )
    if fresh and (shortfall := _gpu_shortfall(spec)):
        problems.append(("runtime.device", shortfall))
    if problems:
        raise SpecError(problems, spec_path or f"${keys.SPEC_ENV}")
    if fresh:
        spec = resolve_init(spec)
    job_id = check_job_id(args.job_id) if args.job_id else new_job_id(spec)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    store = open_store(args, create=True)
    return spec, job_id, store


def cmd_run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    spec, job_id, store = _new_job(args, args.spec)
    try:
        existing = store.get_job(job_id)
    except UnknownJob:
        existing = None
    if existing is not None:
        raise UsageError(
            f"job {job_id} already exists ({existing.state}); `pipetransformer resume {job_id}` "
            "continues it, or choose another --job-id"
        )
    with etcd_for(args, job_id) as etcd:
        ctrl = Controller.create(store, etcd, spec, args.workdir, job_id)
        store_url = shown_url(db_url(args))
        console.print(f"job [bold]{job_id}[/] — store {store_url}, etcd {etcd.endpoint}")
        _train_generation(store, etcd, ctrl)
        return _summary(store, ctrl, args, started)


def cmd_resume(args: argparse.Namespace) -> int:
    store = open_store(args)
    job = store.get_job(args.job)
    if job.state == "completed":
        raise UsageError(
            f"job {job.id} already completed (epoch {job.epoch}, step {job.step}); nothing to resume"
        )
    started = time.monotonic()
    with etcd_for(args, job.id) as etcd:
        ctrl = Controller(store, etcd, job.id)
        _train_generation(store, etcd, ctrl)
        return _summary(store, ctrl, args, started)


# -- status / dashboard ------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    store = open_store(args)
    jobs = store.list_jobs()
    if args.all or (not args.job and not jobs):
        rows = [store.status(j.id) for j in jobs]
        if args.json:
            print(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
            return 0
        table = Table("job", "state", "epoch", "step", "accuracy", "updated")
        for r in rows:
            acc = f"{r.accuracy:.2%}" if r.accuracy is not None else "-"
            table.add_row(r.id, r.state, str(r.epoch), str(r.step), acc, r.updated_at.isoformat())
        console.print(table if rows else "no jobs yet")
        return 0
    job_id = args.job or jobs[0].id  # newest job by default
    status = store.status(job_id)
    if args.json:
        print(json.dumps(status.model_dump(mode="json"), indent=2))
        return 0
    table = Table(show_header=False, box=None)
    for key in ("id", "state", "message", "epoch", "step", "accuracy", "lr", "freeze_boundary"):
        value = getattr(status, key)
        if key == "accuracy" and value is not None:
            value = f"{value:.2%}"
        table.add_row(key, "-" if value is None else escape(str(value)))
    # device use, where the workers measured it (never on the CPU: no rows then)
    if (mfu := mfu_text(status.mfu)) is not None:
        table.add_row("mfu", mfu)
    if (peak := peak_memory_text(status.peak_memory_mib)) is not None:
        table.add_row("peak memory", peak)
    layout = store.current_layout(job_id)
    if layout:
        table.add_row("layout", layout.describe())
    ckpt = status.checkpoint
    if ckpt:
        table.add_row("checkpoint", f"{ckpt.path} (step {ckpt.step})")
    console.print(table)
    return 0


def _check_readable(args: argparse.Namespace) -> None:
    """The dashboard's store exists and has its schema. Read only: the dashboard may hold
    read-only credentials, and migrations are `pipetransformer db upgrade`'s job."""
    url = db_url(args)
    if url == local_store_url(args):
        open_store(args).close()  # a local run's store: the same message as `status`
        return
    store = Store(url, read_only=True)
    try:
        if store.revision() is None:
            raise UsageError(f"{store!r} has no schema yet: run `pipetransformer db upgrade`")
    finally:
        store.close()


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Check the store, then become `python -m dashboard`, which checks the sign-in settings and
    becomes Streamlit (the CLI never imports the dashboard)."""
    _check_readable(args)  # fail here, clearly, if there is nothing to show
    cmd = [sys.executable, "-m", "dashboard", "--db", db_url(args), "--host", args.host]
    cmd += ["--port", str(args.port), "--refresh", str(args.refresh)]
    if args.etcd:
        cmd += ["--etcd", args.etcd]
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # signals (kill, container stop) reach the dashboard directly


def cmd_freeze(args: argparse.Namespace) -> int:
    """File a manual freeze request; the job applies it at its next decision point."""
    store = open_store(args)
    job = store.get_job(args.job)
    endpoint = live_etcd_endpoint(job, args.etcd)
    try:
        with EtcdClient(endpoint, retry_timeout=3) as etcd:
            request = file_freeze_request(etcd, job, args.layers, args.reason)
    except EtcdUnavailable as exc:
        raise UsageError(f"job {job.id}: its etcd does not answer ({exc})") from None
    console.print(
        f"freeze request {request.id} filed: blocks 0..{args.layers - 1} at the next decision "
        f"point of {job.id} (see `pipetransformer status {job.id}`)"
    )
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    """Schema migrations as their own step (a Kubernetes Job or init container runs this before
    the controller, so no two controllers race to migrate)."""
    url = db_url(args)
    if args.action == "upgrade":
        Path(args.workdir).mkdir(parents=True, exist_ok=True)  # where the default SQLite goes
        store = Store.open(url, migrate=True)
        console.print(f"store {store!r} at revision {store.revision()}")
    else:
        store = Store(url, read_only=True)
        console.print(f"store {store!r} at revision {store.revision() or 'none (empty)'}")
    store.close()
    return 0


# -- torchx roles: controller and workers as separate processes ----------------------------------


def cmd_controller(args: argparse.Namespace) -> int:
    """Controller role of a torchx launch: creates (or continues) the job, publishes it in etcd,
    and records what the workers report until they finish."""
    started = time.monotonic()
    spec, job_id, store = _new_job(args, args.spec, fresh=False)
    with etcd_for(args, job_id, port=args.etcd_port) as etcd:
        try:
            ctrl = Controller(store, etcd, job_id)
        except UnknownJob:
            ctrl = Controller.create(store, etcd, spec, args.workdir, job_id)
        ctrl.acquire()
        try:
            if ctrl.attach():
                console.print(f"controller for job {job_id}: took over the running generation")
            else:
                ctrl.publish(args.rdzv_id or f"{job_id}-{uuid.uuid4().hex[:6]}")
                console.print(
                    f"controller for job {job_id}: waiting for {ctrl.layout.world_size} workers"
                )
            seen_workers = time.monotonic() + args.join_timeout

            def poll() -> int | None:
                nonlocal seen_workers
                if ctrl.progress.outcome:
                    return 0
                if ctrl.workers_alive() or etcd.count_prefix(keys.agents(job_id)):
                    seen_workers = time.monotonic() + 3 * ctrl.spec.runtime.lease_ttl_s
                elif time.monotonic() > seen_workers:
                    return 1  # workers never came, or all of them are gone without a word
                return None

            with ProgressView(console, ctrl.layout) as view:
                code = ctrl.supervise(poll, view.update)
            ctrl.finish(code)
            # The trainers' torchrun agents still use etcd after the last report (exit barrier,
            # closing the rendezvous, revoking leases): an embedded etcd must outlive them.
            gone = time.monotonic() + args.join_timeout
            while etcd.count_prefix(keys.agents(job_id)) and time.monotonic() < gone:
                time.sleep(0.2)
        finally:
            ctrl.release()
        return _summary(store, ctrl, args, started)


def cmd_workers(args: argparse.Namespace) -> int:
    """Trainer role of a torchx launch: waits for the job's assignment in etcd, then runs
    torchrun (etcd3 rendezvous) for the current generation."""
    client = EtcdClient(args.etcd, retry_timeout=args.join_timeout)
    deadline = time.monotonic() + args.join_timeout
    while (raw := client.get(keys.launch(args.job_id))) is None:
        if time.monotonic() > deadline:
            raise UsageError(f"job {args.job_id} has not been launched in etcd {args.etcd}")
        time.sleep(0.5)
    rdzv_id = json.loads(raw)["rdzv_id"]
    spec = JobSpec.model_validate_json(client.get(keys.spec(args.job_id)) or "{}")
    import torch  # here: only this role needs to count GPUs

    if problem := gpu_shortfall(
        spec.runtime.device, args.nproc_per_node, torch.cuda.device_count()
    ):
        # before torchrun: one clear line in the pod's log, not a traceback per worker
        raise UsageError(problem)
    env = worker_env(1)
    server, name = None, None
    if forkserver.available():  # this node's workers are forked from it, torch imported once
        server, name = forkserver.start(env)
    cmd = torchrun_command(
        args.etcd,
        args.job_id,
        rdzv_id,
        args.nproc_per_node,
        nnodes=args.nnodes,
        max_restarts=spec.runtime.max_restarts if args.max_restarts is None else args.max_restarts,
        forkserver=name,
    )
    # presence for the controller, which keeps its embedded etcd up until every launcher left
    lease = client.lease(ttl=10)
    client.put(f"{keys.agents(args.job_id)}{socket.gethostname()}-{os.getpid()}", "", lease=lease)
    keepalive = client.keep_alive(lease)
    try:
        return subprocess.call(tied_to_parent(cmd), env=env)
    finally:
        keepalive.stop(revoke=True)
        if server is not None:
            server.terminate()
            server.wait()


def cmd_etcd(args: argparse.Namespace) -> int:
    """Serve an embedded etcd in the foreground (for multi-role local launches)."""
    server = EmbeddedEtcd(Path(args.data_dir), client_port=args.port).start()
    console.print(f"etcd serving on {server.endpoint} (data {args.data_dir}); Ctrl-C to stop")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


# -- parser ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipetransformer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, etcd: bool = True) -> None:
        p.add_argument(
            "--workdir", default="./runs", help="store, etcd data and checkpoints (default ./runs)"
        )
        p.add_argument(
            "--db",
            help=f"SQLAlchemy URL of an external store (default: ${DB_ENV}, else SQLite in "
            "--workdir)",
        )
        if etcd:
            p.add_argument("--etcd", help="HOST:PORT of an external etcd (default: embedded)")

    p = sub.add_parser("run", help="train a job from a spec file")
    p.add_argument("spec", help="job spec YAML, e.g. examples/vit-digits.yaml")
    p.add_argument("--job-id", help="job id (default: <name>-<random>)")
    common(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("resume", help="continue a job from its last committed checkpoint")
    p.add_argument("job")
    common(p)
    p.set_defaults(fn=cmd_resume)

    p = sub.add_parser("status", help="job state, layout and progress (newest job by default)")
    p.add_argument("job", nargs="?")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="list every job")
    common(p, etcd=False)
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("freeze", help="ask a running job to freeze blocks [0, N) (manual override)")
    p.add_argument("job")
    p.add_argument("--layers", type=int, required=True, help="new freeze boundary N")
    p.add_argument("--reason", default="manual override", help="kept in the audit trail")
    common(p)
    p.set_defaults(fn=cmd_freeze)

    p = sub.add_parser(
        "dashboard",
        help="start the Streamlit dashboard (actions need PIPETRANSFORMER_DASHBOARD_TOKEN[_FILE])",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8501)
    p.add_argument(
        "--refresh", type=float, default=5.0, help="seconds between a running job's page updates"
    )
    common(p)
    p.set_defaults(fn=cmd_dashboard)

    p = sub.add_parser("db", help="database schema: `upgrade` to the latest, `current` revision")
    p.add_argument("action", choices=["upgrade", "current"])
    common(p, etcd=False)
    p.set_defaults(fn=cmd_db)

    p = sub.add_parser("controller", help="controller role (torchx launches)")
    p.add_argument(
        "spec", nargs="?", help=f"job spec YAML (default: the YAML text in ${keys.SPEC_ENV})"
    )
    p.add_argument("--job-id")
    p.add_argument("--etcd-port", type=int, help="start an embedded etcd on this port")
    p.add_argument("--join-timeout", type=float, default=300.0)
    p.add_argument("--rdzv-id", help="rendezvous id the workers meet at (default: generated)")
    common(p)
    p.set_defaults(fn=cmd_controller)

    p = sub.add_parser("workers", help="trainer role (torchx launches): torchrun for a job")
    p.add_argument("--job-id", required=True)
    p.add_argument("--etcd", required=True)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--nnodes", default="1", help="N, or MIN:MAX for an elastic job")
    p.add_argument(
        "--max-restarts", type=int, help="worker group restarts (default: runtime.max_restarts)"
    )
    p.add_argument("--join-timeout", type=float, default=300.0)
    p.set_defaults(fn=cmd_workers)

    p = sub.add_parser("etcd", help="serve an embedded etcd in the foreground")
    p.add_argument("--data-dir", default="./runs/etcd")
    p.add_argument("--port", type=int, default=2379)
    p.set_defaults(fn=cmd_etcd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (SpecError, UsageError, UnknownJob, ControllerError, OverrideError) as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
