"""`pipetransformer`: run, resume, inspect and watch elastic pipeline training jobs.

Every command takes the same `--workdir` (default ./runs: the SQLite store, each job's embedded
etcd data and its checkpoints) and `--db URL` / `--etcd HOST:PORT` to use external services, so
`status`, `resume` and `dashboard` find what `run` wrote.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy.engine import make_url

from pipetransformer.core import keys
from pipetransformer.core.readings import mfu_text, peak_memory_text
from pipetransformer.core.spec import JobSpec, SpecError, load_spec, spec_from_text
from pipetransformer.core.stage_times import chrome_trace
from pipetransformer.edge import proctitle
from pipetransformer.edge.etcd_client import EtcdClient, EtcdUnavailable
from pipetransformer.edge.overrides import (
    OverrideError,
    file_freeze_request,
    file_trace_request,
    live_etcd_endpoint,
)
from pipetransformer.orchestrator import etcd_auth, restarts
from pipetransformer.orchestrator.controller import (
    Controller,
    ControllerError,
    HandedOver,
    Submission,
    check_job_id,
    controller_holder,
    job_dir,
    new_job_id,
    submit,
)
from pipetransformer.orchestrator.errors import UsageError
from pipetransformer.orchestrator.etcd_server import EmbeddedEtcd
from pipetransformer.orchestrator.exits import (
    EXIT_JOB_FAILED,
    EXIT_SIGTERM,
    EXIT_USAGE,
    exit_status,
    write_termination_log,
)
from pipetransformer.orchestrator.local import admission_problems, job_etcd, train_here
from pipetransformer.orchestrator.monitoring import JobMetrics, TensorBoardWriter
from pipetransformer.orchestrator.progress import ProgressView
from pipetransformer.orchestrator.report import (
    data_origin,
    print_summary,
    provenance_rows,
    recoveries_of,
    recovery_rows,
)
from pipetransformer.orchestrator.roles import TrainerPods, serve_node
from pipetransformer.orchestrator.summary import pipeline_from_store
from pipetransformer.store import (
    DB_ENV,
    JobInfo,
    Store,
    StoreUnavailable,
    UnknownJob,
    server_of,
    sqlite_url,
    unreachable,
    url_problem,
)

# Logs and pipes get a wide console: rich's 80-column default would cut paths in the summary.
R = TypeVar("R")

console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False)


# -- shared plumbing ---------------------------------------------------------------------------


def local_store_url(args: argparse.Namespace) -> str:
    """The default store: SQLite in --workdir."""
    return sqlite_url(Path(args.workdir).resolve() / "store.db")


def db_url(args: argparse.Namespace) -> str:
    """--db, else $PIPETRANSFORMER_DB (from a Secret in a pod), else SQLite in --workdir."""
    return args.db or os.environ.get(DB_ENV) or local_store_url(args)


def db_source(args: argparse.Namespace) -> str | None:
    """Where the store URL came from, as an error names it: `--db` or `$PIPETRANSFORMER_DB`;
    None for the default (SQLite in --workdir)."""
    if args.db:
        return "--db"
    return f"${DB_ENV}" if os.environ.get(DB_ENV) else None


# How long a command a person waits on gives a database server to answer before saying which
# one did not (a controller role instead rides out DEFAULT_RETRY_S: its server may be starting).
PROBE_TIMEOUT_S = 5.0


def check_common(args: argparse.Namespace) -> None:
    """The arguments commands share, checked before anything is created or contacted, each
    refused in one line naming the argument (UsageError; ControllerError for --job-id)."""
    workdir = getattr(args, "workdir", None)
    if workdir is not None and Path(workdir).exists() and not Path(workdir).is_dir():
        raise UsageError(
            f"--workdir {workdir} is a file; give a directory (new or existing: it holds the "
            "store, each job's etcd data and its checkpoints)"
        )
    if hasattr(args, "db") and (source := db_source(args)):
        url = db_url(args)
        if problem := url_problem(url):
            # an unparsable URL is not shown: its password could not be masked
            where = source if "is not a database URL" in problem else f"{source} {shown_url(url)}"
            raise UsageError(f"{where}: {problem}")
    if getattr(args, "job_id", None) is not None:
        check_job_id(args.job_id)  # "" too: an empty id is a mistake, not a request for one


def check_reachable(args: argparse.Namespace) -> None:
    """A database server that does not answer, named within PROBE_TIMEOUT_S with how to check
    it, instead of a traceback after the store's retries (SQLite needs no server)."""
    url = db_url(args)
    if (reason := unreachable(url, PROBE_TIMEOUT_S)) is None:
        return
    host, _, port = server_of(url).rpartition(":")
    raise UsageError(
        f"{db_source(args) or '--db'} {shown_url(url)}: could not connect to the PostgreSQL "
        f"server at {host}:{port} ({reason}); check that it is up (`pg_isready -h {host} -p "
        f"{port}`) and that the URL's host, port, user, password and database are right"
    )


def shown_url(url: str) -> str:
    """A store URL fit for output and logs: its password masked (a pod's URL comes from a
    Secret, and pod logs are read by many)."""
    return make_url(url).render_as_string(hide_password=True)


def open_store(args: argparse.Namespace, create: bool = False, probe: bool = True) -> Store:
    """The store the arguments name. `probe`: a server that does not answer is named within
    seconds (see `check_reachable`); a controller role passes False and rides out an outage."""
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
    if probe:
        check_reachable(args)
    return Store.open(url)


def _summary(store: Store, ctrl: Controller, args: argparse.Namespace, started: float) -> int:
    """Print the end-of-run summary; the exit code (orchestrator/exits.py): 0 completed, 3
    failed (a restart cannot fix it), 130 stopped on request (Ctrl-C), else 1."""
    job = store.get_job(ctrl.job_id)
    print_summary(
        console,
        store,
        job.id,
        wall_s=time.monotonic() - started,
        store_url=shown_url(db_url(args)),
        checkpoints=job_dir(job.workdir, job.id) / "checkpoints",
        where=f"--db '{args.db}'" if args.db else f"--workdir {args.workdir}",
    )
    return exit_status(job.state, stopped=ctrl.progress.outcome == "stopped")


def _read_spec(spec_path: str | None) -> JobSpec:
    """The spec file, or (no path) the YAML text in $PIPETRANSFORMER_SPEC: how a pod gets it,
    since the submitting machine's files are not in the pod."""
    if spec_path:
        return load_spec(spec_path)
    text = os.environ.get(keys.SPEC_ENV)
    if not text:
        raise UsageError(f"give a spec file, or its YAML text in ${keys.SPEC_ENV}")
    return spec_from_text(text, f"${keys.SPEC_ENV}")


def _new_job(
    args: argparse.Namespace, spec_path: str | None, fresh: bool = True
) -> tuple[JobSpec | Submission, str, Store]:
    """Validate a new job's spec and id before anything is created; then its store. With `fresh`
    (`run`: the job cannot exist yet, and every worker runs on this machine) the machine must
    seat the job, and what the spec points at is resolved here (a `Submission`, which
    `Controller.create` stores as it is: resolved once); a controller role that may be
    continuing its job leaves that to `Controller.create`, which resolves a new job's spec."""
    read = _read_spec(spec_path)  # rejects a bad spec before anything starts
    # the checkpoints and data it names, before admission sizes the model
    spec: JobSpec | Submission = submit(read) if fresh else read
    checked = spec.spec if isinstance(spec, Submission) else spec
    # a pretrained model's size is known once Controller.create has read its checkpoint
    if not checked.model.pending and (problems := admission_problems(checked, here=fresh)):
        raise SpecError(problems, spec_path or f"${keys.SPEC_ENV}")
    job_id = check_job_id(args.job_id) if args.job_id is not None else new_job_id(checked)
    if fresh:  # before the workdir is made: nothing is created for a store that cannot be had
        check_reachable(args)
    _check_metrics_port(args)  # nor recorded, for a port it cannot serve
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    store = open_store(args, create=True, probe=False)
    return spec, job_id, store


def _check_metrics_port(args: argparse.Namespace, host: str = "127.0.0.1") -> None:
    """`--metrics-port` can be served here: checked before a job is recorded, so a busy port is
    refused with nothing stored (the server binds it again once the controller runs)."""
    port = getattr(args, "metrics_port", None)
    if not port:
        return
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UsageError(f"--metrics-port {port}: cannot serve it ({exc})") from None


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
    proctitle.set_title("controller", job=job_id)  # this process is the job's controller now
    with job_etcd(args.etcd, args.workdir, job_id) as etcd:
        ctrl = Controller.create(store, etcd, spec, args.workdir, job_id)
        store_url = shown_url(db_url(args))
        console.print(f"job [bold]{job_id}[/] — store {store_url}, etcd {etcd.endpoint}")
        with monitored(ctrl, args, host="127.0.0.1"):
            train_here(ctrl, etcd, console, err)
        return _summary(store, ctrl, args, started)


def cmd_resume(args: argparse.Namespace) -> int:
    store = open_store(args)
    job = store.get_job(args.job)
    if job.state == "completed":
        raise UsageError(
            f"job {job.id} already completed (epoch {job.epoch}, step {job.step}); nothing to resume"
        )
    refuse_if_controlled(job, args.etcd)
    _check_metrics_port(args)
    started = time.monotonic()
    proctitle.set_title("controller", job=job.id)
    with job_etcd(args.etcd, args.workdir, job.id) as etcd:
        ctrl = Controller(store, etcd, job.id)
        with monitored(ctrl, args, host="127.0.0.1"):
            train_here(ctrl, etcd, console, err)
        return _summary(store, ctrl, args, started)


@contextlib.contextmanager
def monitored(ctrl: Controller, args: argparse.Namespace, host: str) -> Iterator[None]:
    """While the controller runs the job: its Prometheus metrics on `--metrics-port` (read from
    the store at each scrape, through a store of their own), and TensorBoard event files under
    the job's directory where the spec asks for them (`runtime.tensorboard`), written from each
    drain of the workers' reports."""
    with contextlib.ExitStack() as stack:
        if args.metrics_port:
            metrics = stack.enter_context(JobMetrics.open(db_url(args), ctrl.job_id))
            try:
                port = metrics.start(args.metrics_port, host=host)
            except OSError as exc:
                raise UsageError(
                    f"--metrics-port {args.metrics_port}: cannot serve it ({exc})"
                ) from None
            console.print(f"Prometheus metrics: http://{host}:{port}/metrics")
        if ctrl.spec.runtime.tensorboard:
            logdir = job_dir(ctrl.job.workdir, ctrl.job_id) / "tensorboard"
            writer = stack.enter_context(TensorBoardWriter(logdir))
            ctrl.observers.append(writer.write)
            console.print(f"TensorBoard event files: tensorboard --logdir {logdir}")
        yield


def refuse_if_controlled(job: JobInfo, explicit_etcd: str | None) -> None:
    """A job whose controller is alive (a `run` or `resume` still training it, here or
    elsewhere) is not resumed: say so at once, and where, instead of waiting for its lease or
    its embedded etcd's data directory. Its etcd is `--etcd`, else the endpoint its running
    launch left in the job's directory; none answering means nobody controls it."""
    try:
        endpoint = live_etcd_endpoint(job, explicit_etcd)
    except OverrideError:
        return  # no external etcd named, and no launch serving one
    if not endpoint:
        return  # an empty endpoint file: its launch was cut short while writing it
    try:
        with EtcdClient(endpoint, timeout=2, retry_timeout=2) as etcd:
            holder = controller_holder(etcd, job.id)
    except EtcdUnavailable:
        return  # a stale endpoint file (its launch was killed); --etcd is checked by job_etcd
    if holder is not None:
        raise UsageError(
            f"job {job.id} is running: its controller ({holder}) holds it through etcd at "
            f"{endpoint}; follow it with `pipetransformer status {job.id}` or the dashboard, "
            "or stop that run (Ctrl-C where it runs) before resuming"
        )


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
    reading = pipeline_from_store(store, job_id)  # the ranks' stage timings, newest layout
    if args.json:
        out = status.model_dump(mode="json")
        out["pipeline"] = None if reading is None else dataclasses.asdict(reading)
        # what the text form shows of where the model and data came from, typed: the model's
        # source (a directory or hub id with its commit and fingerprint), the data's origin with
        # the rows each split read, and the rows as the text form words them
        job = store.get_job(job_id)
        pretrained = job.spec.model.pretrained
        out["model"] = {
            "family": job.spec.model.family,
            "pretrained": None if pretrained is None else pretrained.model_dump(mode="json"),
        }
        out["data"] = data_origin(store, job).model_dump(mode="json")
        out["provenance"] = dict(provenance_rows(store, job))
        out["recoveries"] = [dataclasses.asdict(r) for r in recoveries_of(store, job_id)]
        print(json.dumps(out, indent=2))
        return 0
    table = Table(show_header=False, box=None)
    for key in ("id", "state", "message", "epoch", "step", "accuracy", "lr", "freeze_boundary"):
        value = getattr(status, key)
        if key == "accuracy" and value is not None:
            value = f"{value:.2%}"
        table.add_row(key, "-" if value is None else escape(str(value)))
        if key == "accuracy" and status.perplexity is not None:  # a language model's
            table.add_row("perplexity", f"{status.perplexity:.2f}")
            table.add_row("held-out loss", f"{status.held_out_loss:.4f} per token")
    # device use, where the workers measured it (never on the CPU: no rows then)
    if (mfu := mfu_text(status.mfu)) is not None:
        table.add_row("mfu", mfu)
    if (peak := peak_memory_text(status.peak_memory_mib)) is not None:
        table.add_row("peak memory", peak)
    layout = store.current_layout(job_id)
    if layout:
        table.add_row("layout", layout.describe())
    if reading is not None:
        table.add_row("pipeline", escape(reading.text()))
    ckpt = status.checkpoint
    if ckpt:
        table.add_row("checkpoint", f"{ckpt.path} (step {ckpt.step})")
    for label, text in recovery_rows(recoveries_of(store, job_id)):
        table.add_row(label, escape(text))
    # where the model and the data came from (the spec; rows from the workers' report)
    for label, text in provenance_rows(store, store.get_job(job_id)):
        table.add_row(label, escape(text))
    console.print(table)
    return 0


def _check_readable(args: argparse.Namespace) -> None:
    """The dashboard's store exists and has its schema. A local workdir's store that does not
    exist yet is made (empty, as `run` would make it), so the page opens on its empty state and
    shows the first job `run` records there. Any other store is only read: the dashboard may hold
    read-only credentials, and migrations are `pipetransformer db upgrade`'s job."""
    url = db_url(args)
    if url == local_store_url(args):
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        open_store(args, create=True).close()
        return
    check_reachable(args)
    store = Store(url, read_only=True)
    try:
        if store.revision() is None:
            raise UsageError(f"{store!r} has no schema yet: run `pipetransformer db upgrade`")
    finally:
        store.close()


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Check the store, then become `python -m pipetransformer.dashboard`, which checks the sign-in settings and
    becomes Streamlit (the CLI never imports the dashboard)."""
    _check_readable(args)  # fail here, clearly, if there is nothing to show
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "pipetransformer.dashboard",
        "--db",
        db_url(args),
        "--host",
        args.host,
    ]
    cmd += ["--port", str(args.port), "--refresh", str(args.refresh)]
    if args.etcd:
        cmd += ["--etcd", args.etcd]
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # signals (kill, container stop) reach the dashboard directly


def _file_request(
    job: JobInfo, args: argparse.Namespace, what: str, file: Callable[[EtcdClient], R]
) -> R:
    """`file(etcd)` on the running job's etcd (`--etcd`, else the one its launch serves). A job
    that is not running is said first (no etcd to look for); an etcd that does not answer is
    the user's to check, said in one line."""
    if job.state in ("completed", "failed", "interrupted"):
        after = f"; `pipetransformer resume {job.id}` first" if job.state == "interrupted" else ""
        raise UsageError(f"job {job.id} is {job.state}: {what} needs a running job{after}")
    endpoint = live_etcd_endpoint(job, args.etcd)
    try:
        with EtcdClient(endpoint, retry_timeout=3) as etcd:
            return file(etcd)
    except EtcdUnavailable as exc:
        raise UsageError(f"job {job.id}: its etcd does not answer ({exc})") from None


def cmd_freeze(args: argparse.Namespace) -> int:
    """File a manual freeze request; the job applies it at its next decision point."""
    store = open_store(args)
    job = store.get_job(args.job)
    request = _file_request(
        job,
        args,
        "a freeze request",
        lambda etcd: file_freeze_request(etcd, job, args.layers, args.reason),
    )
    console.print(
        f"freeze request {request.id} filed: blocks 0..{args.layers - 1} at the next decision "
        f"point of {job.id} (see `pipetransformer status {job.id}`)"
    )
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """Capture one step's schedule on every rank of a running job: file a trace request, wait
    for every rank's `StepTrace` in the store, write them as a Chrome / Perfetto trace."""
    store = open_store(args)
    job = store.get_job(args.job)
    request = _file_request(job, args, "a trace", lambda etcd: file_trace_request(etcd, job))
    layout = store.current_layout(job.id)
    ranks = layout.world_size if layout else 1
    every = job.spec.runtime.control_every_steps
    console.print(
        f"trace request {request.id} filed: every rank traces the step after the next control "
        f"point (at most {every} steps away); waiting up to {args.wait:g}s for {ranks} rank(s)"
    )
    deadline = time.monotonic() + args.wait
    traces = store.step_traces(job.id, request=request.id)
    while len({t.rank for t in traces}) < ranks and time.monotonic() < deadline:
        time.sleep(0.5)
        traces = store.step_traces(job.id, request=request.id)
    if not traces:
        raise UsageError(
            f"no rank of job {job.id} answered trace request {request.id} within {args.wait:g}s "
            f"(is it still training? `pipetransformer status {job.id}`)"
        )
    out = Path(args.out or Path(job.workdir) / "jobs" / job.id / f"trace-{request.id}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(traces)))
    table = Table(title=f"step {traces[0].step}", title_justify="left", box=None)
    for column in ("rank", "stages", "replica", "step time", "compute", "waiting", "spans"):
        table.add_column(column, justify="right")
    for t in traces:
        end = max((s.end_s for s in t.spans), default=0.0)
        compute = sum(s.end_s - s.start_s for s in t.spans if s.phase in ("forward", "backward"))
        wait = sum(s.end_s - s.start_s for s in t.spans if s.phase == "pipeline_wait")
        table.add_row(
            str(t.rank),
            ",".join(map(str, t.stages)),
            str(t.replica),
            f"{end * 1e3:.1f} ms",
            f"{compute * 1e3:.1f} ms",
            f"{wait * 1e3:.1f} ms",
            str(len(t.spans)),
        )
    console.print(table)
    missing = ranks - len({t.rank for t in traces})
    if missing > 0:
        console.print(f"{missing} rank(s) did not answer within {args.wait:g}s")
    console.print(
        f"Chrome / Perfetto trace: {out} (open it in ui.perfetto.dev or chrome://tracing)"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Find the job's committed checkpoint in the store, then have `python -m pipetransformer.trainer.export`
    write it as a directory `transformers` loads (the CLI never imports the data plane, and the
    data plane never reads the store: docs/architecture.md, "Dependency rules")."""
    import subprocess

    store = open_store(args)
    try:
        job = store.get_job(args.job)
        if job.spec.model.pretrained is None:
            raise UsageError(
                f"job {job.id} trained a seeded {job.spec.model.family} model, not a Hugging Face "
                "checkpoint (model.pretrained): there is no transformers model to export it as"
            )
        every = store.checkpoints(job.id, state=None)
    finally:
        store.close()
    committed = [c for c in every if c.state == "committed"]  # newest first
    if not committed:
        raise UsageError(f"job {job.id} ({job.state}) has no committed checkpoint yet")
    ckpt = committed[0]
    if args.step is not None:
        found = [c for c in committed if c.step == args.step]
        if not found:
            steps = ", ".join(str(c.step) for c in reversed(committed))
            gone = [c.state for c in every if c.step == args.step]
            why = f" (that checkpoint is {gone[0]})" if gone else ""
            raise UsageError(
                f"job {job.id} has no committed checkpoint at step {args.step}{why}; "
                f"committed steps: {steps}"
            )
        ckpt = found[0]
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "pipetransformer.trainer.export",
        "--checkpoint",
        ckpt.path,
        "--to",
        args.to,
    ]
    cmd += ["--spec-json", job.spec.to_json(), "--checksum", ckpt.checksum]
    cmd += ["--source", f"pipetransformer job {job.id}, step {ckpt.step}"]
    if args.force:
        cmd.append("--force")
    if args.merge:
        if job.spec.model.adapters is None:
            raise UsageError(
                f"--merge: job {job.id} trained no adapters (model.adapters); its export is "
                "a whole model already"
            )
        cmd.append("--merge")
    console.print(f"exporting job {job.id} at step {ckpt.step} ({ckpt.path})")
    sys.stdout.flush()
    return subprocess.run(cmd, check=False).returncode


def cmd_db(args: argparse.Namespace) -> int:
    """Schema migrations as their own step (a Kubernetes Job or init container runs this before
    the controller, so no two controllers race to migrate)."""
    url = db_url(args)
    if args.action == "upgrade":
        # no quick probe: the migration Job starts beside its database and rides out its start
        Path(args.workdir).mkdir(parents=True, exist_ok=True)  # where the default SQLite goes
        try:
            store = Store.open(url, migrate=True)
        except StoreUnavailable as exc:
            raise UsageError(f"{db_source(args) or '--db'}: {exc}") from None
        console.print(f"store {store!r} at revision {store.revision()}")
    else:
        check_reachable(args)
        store = Store(url, read_only=True)
        console.print(f"store {store!r} at revision {store.revision() or 'none (empty)'}")
    store.close()
    return 0


# -- torchx roles: controller and workers as separate processes ----------------------------------


def cmd_controller(args: argparse.Namespace) -> int:
    """Controller role of a torchx launch: creates (or continues) the job, publishes it in etcd
    (or takes over the generation a previous controller left running), and records what the
    trainer pods' workers report until they finish. Its exit status tells Volcano whether a
    restart can help (orchestrator/exits.py, orchestrator/volcano.py), and its last line is
    the pod's termination message."""
    started = time.monotonic()
    # PID 1 of the controller pod (which ignores signals it has no handler for): a pod's stop
    # hands the job over between two ticks, its lease revoked, so that the controller Volcano
    # starts in its place takes it over while the workers train on. Before the job is being
    # supervised there is nothing to hand over: it exits at once.
    supervising: list[Controller] = []

    def on_sigterm(_signum: int, _frame: object) -> None:
        if not supervising:
            raise SystemExit(EXIT_SIGTERM)
        supervising[0].leave()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        spec, job_id, store = _new_job(args, args.spec, fresh=False)  # rides out a starting DB
    except (SpecError, UsageError) as exc:
        write_termination_log(str(exc))
        raise
    proctitle.set_title("controller", job=job_id)
    if (ended := _ended_or_over_budget(store, job_id, args)) is not None:
        return ended
    with job_etcd(args.etcd, args.workdir, job_id, port=args.etcd_port) as etcd:
        try:
            ctrl = Controller(store, etcd, job_id)
        except UnknownJob:
            ctrl = Controller.create(store, etcd, spec, args.workdir, job_id)
        store.add_event(job_id, restarts.STARTED, "controller started", data=_launch(args))
        ctrl.refusal_budget = args.restart_budget  # pods that cannot run here, replaced as often

        def launch(attached: bool) -> TrainerPods:
            if attached:
                console.print(f"controller for job {job_id}: took over the running generation")
            else:
                console.print(
                    f"controller for job {job_id}: waiting for {ctrl.layout.world_size} workers"
                )
            return TrainerPods(ctrl, etcd, args.join_timeout)

        rdzv_id = args.rdzv_id or f"{job_id}-{uuid.uuid4().hex[:6]}"
        # an etcd with auth: the trainers' user exists before they can read the launch
        for line in etcd_auth.admit_trainers_from_env(etcd, job_id, rdzv_id):
            console.print(f"etcd auth: {line}")
        supervising.append(ctrl)
        try:
            # 0.0.0.0: Prometheus scrapes the pod's address
            with monitored(ctrl, args, host="0.0.0.0"), ProgressView(console, ctrl.layout) as view:
                ctrl.run(rdzv_id, launch, on_tick=view.update, attach=True)
        except HandedOver as exc:
            console.print(str(exc))
            return _exited(store, job_id, args, EXIT_SIGTERM, str(exc))
        except Exception as exc:  # a restart may get past it: recorded for the budget
            why = f"controller crashed: {type(exc).__name__}: {exc}"
            store.add_event(job_id, restarts.CRASHED, why, data=_launch(args))
            write_termination_log(why)
            raise
        status = _summary(store, ctrl, args, started)
        job = store.get_job(job_id)
        return _exited(store, job_id, args, status, f"job {job_id} {job.state}: {job.message}")


def _launch(args: argparse.Namespace) -> dict[str, str]:
    return {"launch": args.launch_id or ""}


def _exited(store: Store, job_id: str, args: argparse.Namespace, status: int, why: str) -> int:
    """Record the controller's chosen exit (a clean one ends the count of unclean restarts),
    leave `why` as the pod's termination message; `status`."""
    store.add_event(job_id, restarts.EXITED, why, data={**_launch(args), "status": status})
    write_termination_log(why)
    return status


def _ended_or_over_budget(store: Store, job_id: str, args: argparse.Namespace) -> int | None:
    """For a controller restarted in its pod: the status to exit with at once when its launch
    already ended the job (Volcano then ends the Volcano job), or when it has restarted
    uncleanly more than `--restart-budget` times in a row (the job fails with the reason);
    None to go on."""
    try:
        job = store.get_job(job_id)
    except UnknownJob:
        return None  # a new job
    events = store.events(job_id, limit=500, kinds=[*restarts.KINDS, *restarts.END_KINDS])
    if (status := restarts.ended_status(job, events, args.launch_id or "")) is not None:
        why = f"job {job_id} already ended ({job.state}): {job.message}"
        console.print(why)
        write_termination_log(why)
        return status
    count, reason = restarts.unclean_restarts(events, args.launch_id or "")
    if count <= args.restart_budget:
        return None
    why = (
        f"the controller restarted {count} times in a row without ending cleanly (budget "
        f"--restart-budget {args.restart_budget}); the last: {reason}"
    )
    store.set_job_state(job_id, "failed", why)
    store.add_event(job_id, "job_failed", why, data={"outcome": "restart_budget"})
    err.print(f"[red]{why}[/]")
    return _exited(store, job_id, args, EXIT_JOB_FAILED, why)


def cmd_workers(args: argparse.Namespace) -> int:
    """Trainer role of a torchx launch: waits for the job's assignment in etcd, then runs
    torchrun (etcd3 rendezvous) for the current generation."""
    proctitle.set_title("launcher", job=args.job_id, node=socket.gethostname())
    return serve_node(
        args.etcd,
        args.job_id,
        args.nproc_per_node,
        args.nnodes,
        args.max_restarts,
        args.join_timeout,
        args.workdir,
    )


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


def count(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: give 0 or more")
    return n


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0..65535 (0: off)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give 0..65535 (0: off)")
    return port


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
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=0,
        metavar="PORT",
        help="serve the job's Prometheus metrics at http://127.0.0.1:PORT/metrics while it "
        "runs (0: off, the default)",
    )
    common(p)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("resume", help="continue a job from its last committed checkpoint")
    p.add_argument("job", help="the job's id (`pipetransformer status --all` lists them)")
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=0,
        metavar="PORT",
        help="serve the job's Prometheus metrics at http://127.0.0.1:PORT/metrics while it "
        "runs (0: off, the default)",
    )
    common(p)
    p.set_defaults(fn=cmd_resume)

    p = sub.add_parser("status", help="job state, layout and progress (newest job by default)")
    p.add_argument(
        "job", nargs="?", help="the job's id (default: the newest job; --all: every job)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="list every job")
    common(p, etcd=False)
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("freeze", help="ask a running job to freeze blocks [0, N) (manual override)")
    p.add_argument("job", help="the running job's id")
    p.add_argument("--layers", type=int, required=True, help="new freeze boundary N")
    p.add_argument("--reason", default="manual override", help="kept in the audit trail")
    common(p)
    p.set_defaults(fn=cmd_freeze)

    p = sub.add_parser(
        "trace",
        help="capture one step's schedule on every rank of a running job (a Chrome trace)",
        description="Every rank of the running job traces one step (the step after its next "
        "control point): each stage's forward and backward per micro-batch, the waits between "
        "them, the optimizer, data and frozen prefix. Written as a Chrome / Perfetto trace "
        "(Trace Event Format JSON); the dashboard's Pipeline view draws the same as a Gantt chart.",
    )
    p.add_argument("job", help="the running job's id")
    p.add_argument(
        "--out", metavar="FILE", help="where to write the trace (default: the job's directory)"
    )
    p.add_argument(
        "--wait", type=float, default=120.0, help="seconds to wait for every rank (default 120)"
    )
    common(p)
    p.set_defaults(fn=cmd_trace)

    p = sub.add_parser(
        "export",
        help="write a committed checkpoint of a job on a Hugging Face model (model.pretrained) "
        "as a directory transformers loads",
        description="Write a committed checkpoint of a job on a Hugging Face model as a "
        "`save_pretrained` directory: config.json (the pretrained model's, with the job's "
        "labels), model.safetensors (float32) and the tokenizer or image processor files. The "
        "checkpoint is verified against the checksum the store committed first.",
    )
    p.add_argument("job", help="the job's id (a job on a Hugging Face model)")
    p.add_argument(
        "--step", type=int, help="the committed checkpoint at this step (default: the newest)"
    )
    p.add_argument("--to", required=True, metavar="DIR", help="directory to write: new or empty")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a DIR that holds files: the export is written beside it and swapped in "
        "whole once complete (never DIR containing the checkpoint, the pretrained model or the "
        "current directory)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a job with LoRA adapters (model.adapters): merge them into the base model and "
        "write a plain save_pretrained directory (default: the adapters alone, in PEFT's "
        "format: adapter_config.json and adapter_model.safetensors)",
    )
    common(p, etcd=False)
    p.set_defaults(fn=cmd_export)

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
    p.add_argument(
        "action",
        choices=["upgrade", "current"],
        help="upgrade: migrate to the latest schema; current: print the revision",
    )
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
    p.add_argument(
        "--launch-id",
        default="",
        help="the scheduler's id of this launch (the torchx component passes its app id): a "
        "controller restarted within its launch after the job ended exits at once, a new "
        "launch resumes the job",
    )
    p.add_argument(
        "--restart-budget",
        type=count,
        default=3,
        metavar="N",
        help="unclean restarts in a row (crashes, kills, giving up on absent workers) after "
        "which the job fails with the last one's reason (default 3; a handover on SIGTERM "
        "resets the count)",
    )
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=0,
        metavar="PORT",
        help="serve the job's Prometheus metrics at http://0.0.0.0:PORT/metrics while it "
        "runs (0: off, the default)",
    )
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
    p.add_argument(
        "--workdir",
        default="./runs",
        help="where a job run on this machine keeps its rendezvous secret (default ./runs; "
        "pods take theirs from $PIPETRANSFORMER_RDZV_SECRET)",
    )
    p.set_defaults(fn=cmd_workers)

    p = sub.add_parser("etcd-auth", help="etcd's users and roles for each role (TLS + auth)")
    etcd_auth.add_arguments(p)
    p.set_defaults(fn=etcd_auth.cmd_etcd_auth)

    p = sub.add_parser("etcd", help="serve an embedded etcd in the foreground")
    p.add_argument("--data-dir", default="./runs/etcd")
    p.add_argument("--port", type=int, default=2379)
    p.set_defaults(fn=cmd_etcd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_common(args)
        return args.fn(args)
    except (SpecError, UsageError, UnknownJob, ControllerError, OverrideError) as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)  # one line, for grep
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
