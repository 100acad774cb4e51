"""The torchx component (`orchestrator/components.py:train`): the AppDef it builds, and a real
`torchx run -s local_cwd` launch that trains a tiny job into the store like `pipetransformer run`."""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import io
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from torchx.specs import AppDef, macros
from torchx.specs.file_linter import get_fn_docstring

from pipetransformer.core.keys import RDZV_SECRET_ENV, SPEC_ENV
from pipetransformer.core.spec import SpecError, load_spec, parse_spec
from pipetransformer.edge.etcd_client import PASSWORD_ENV
from pipetransformer.orchestrator import volcano
from pipetransformer.orchestrator.appdef import app_def
from pipetransformer.orchestrator.components import (
    CONTROLLER_ROLE,
    METRICS_PORT_NAME,
    TRAINER_ROLE,
    ComponentArgError,
    train,
)
from pipetransformer.orchestrator.platforms import PLATFORMS
from pipetransformer.orchestrator.platforms.base import TrainArgs, TrainInputs
from pipetransformer.store import Store, sqlite_url

REPO = Path(__file__).resolve().parents[1]
COMPONENT_FILE = "orchestrator/components.py:train"
COMPONENT_MODULE = "pipetransformer.orchestrator.components:train"
MAX_STEPS = 6

# examples/vit-digits.yaml, shrunk. Holding out 90% of the digits leaves ~180 training images,
# so the one epoch is ceil(180 / 32) = 6 steps: max_steps and the epoch end coincide, and the
# job both checkpoints and evaluates on the held-out set at step 6.
TINY: dict[str, Any] = {
    "name": "tiny-torchx",
    "model": {
        "family": "vit",
        "image_size": 8,
        "patch_size": 2,
        "channels": 1,
        "dim": 32,
        "depth": 2,
        "heads": 4,
        "mlp_ratio": 2.0,
        "num_classes": 10,
    },
    "data": {"dataset": "digits", "test_fraction": 0.9, "seed": 0},
    "training": {
        "epochs": 1,
        "global_batch_size": 32,
        "lr": 0.003,
        "weight_decay": 0.05,
        "warmup_steps": 2,
        "seed": 0,
        "max_steps": MAX_STEPS,
    },
    "parallel": {"stages": 2, "replicas": 1, "microbatches": 2, "schedule": "gpipe"},
    "checkpoint": {"every_epochs": 1, "keep": 3},
}


def write_spec(path: Path, **changes: dict[str, Any]) -> Path:
    spec = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY.items()}
    for section, values in changes.items():
        spec[section] = {**spec[section], **values}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture
def tiny_spec(tmp_path: Path) -> Path:
    path = write_spec(tmp_path / "tiny.yaml")
    load_spec(path)  # the spec itself is valid
    return path


def torchx(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`torchx ...` as a user runs it, from the repository root (local_cwd runs roles there).

    On timeout torchx gets SIGTERM, as from Ctrl-C or `timeout`: it then cancels its roles (each
    runs in its own session), where the SIGKILL of `subprocess.run` would orphan them."""
    cmd = [sys.executable, "-m", "torchx.cli.main", *args]
    env = {**os.environ, "COLUMNS": "200"}
    with subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def role_logs(log_dir: Path) -> str:
    out = []
    for log in sorted(log_dir.rglob("combined.log")):
        text = log.read_text(errors="replace").splitlines()
        out.append(f"--- {log.relative_to(log_dir)} (last 40 lines)\n" + "\n".join(text[-40:]))
    return "\n".join(out)


# -- the component ------------------------------------------------------------------------------


def test_component_builds_controller_and_trainer_roles(tiny_spec: Path) -> None:
    app = train(spec=str(tiny_spec), workdir="/w", etcd_port=23456)
    assert isinstance(app, AppDef)
    assert app.name == "tiny-torchx"
    roles = {r.name: r for r in app.roles}
    assert list(roles) == [CONTROLLER_ROLE, TRAINER_ROLE]
    controller, trainer = roles[CONTROLLER_ROLE], roles[TRAINER_ROLE]
    assert controller.num_replicas == 1 and trainer.num_replicas == 1

    # both roles name the job by the scheduler's app id, and meet at the controller's etcd
    c, t = controller.args, trainer.args
    assert c[c.index("--job-id") + 1] == macros.app_id
    assert t[t.index("--job-id") + 1] == macros.app_id
    assert c[c.index("--etcd-port") + 1] == "23456" and "--etcd" not in c
    assert t[t.index("--etcd") + 1] == "127.0.0.1:23456"
    assert c[: c.index("controller")] == t[: t.index("workers")]  # same interpreter and CLI
    assert c[c.index("controller") + 1] == str(tiny_spec)
    assert c[c.index("--workdir") + 1] == "/w" and "--db" not in c
    assert t[t.index("--nproc-per-node") + 1] == "2" and t[t.index("--nnodes") + 1] == "1"
    assert trainer.resource.cpu == 2 and trainer.resource.memMB > 0
    # the trainers' agents sign the rendezvous state with a secret made for this launch
    secret = trainer.env[RDZV_SECRET_ENV]
    assert len(secret) == 64 and RDZV_SECRET_ENV not in controller.env
    again = {r.name: r for r in train(spec=str(tiny_spec), workdir="/w").roles}
    assert again[TRAINER_ROLE].env[RDZV_SECRET_ENV] != secret
    # locally no metrics unless asked: jobs on one machine would share the port
    assert "--metrics-port" not in c and controller.port_map == {} and trainer.port_map == {}


def test_component_serves_the_controllers_metrics_when_asked(tiny_spec: Path) -> None:
    controller, trainer = train(spec=str(tiny_spec), etcd_port=23456, metrics_port=9500).roles
    c = controller.args
    assert c[c.index("--metrics-port") + 1] == "9500"
    assert controller.port_map == {METRICS_PORT_NAME: 9500}
    assert "--metrics-port" not in trainer.args and trainer.port_map == {}
    assert "kubernetes" not in controller.metadata  # no pod overlay locally
    off = train(spec=str(tiny_spec), metrics_port=0).roles[0]
    assert "--metrics-port" not in off.args and off.port_map == {}
    for bad in (-2, 65536):
        with pytest.raises(ComponentArgError, match=f"metrics_port={bad}: give a port"):
            train(spec=str(tiny_spec), metrics_port=bad)
    with pytest.raises(ComponentArgError, match="embedded etcd's port"):
        train(spec=str(tiny_spec), etcd_port=23456, metrics_port=23456)


def test_component_external_services_and_nodes(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "wide.yaml", parallel={"stages": 2, "replicas": 2})
    app = train(
        spec=str(spec),
        job_id="fixed",
        db="postgresql+psycopg://u@db/pt",
        etcd="etcd.example:2379",
        nnodes=2,
        nproc_per_node=2,
    )
    controller, trainer = app.roles
    assert trainer.num_replicas == 2
    assert controller.args[controller.args.index("--etcd") + 1] == "etcd.example:2379"
    assert "--etcd-port" not in controller.args
    assert controller.args[controller.args.index("--db") + 1] == "postgresql+psycopg://u@db/pt"
    assert trainer.args[trainer.args.index("--etcd") + 1] == "etcd.example:2379"
    assert trainer.args[trainer.args.index("--nnodes") + 1] == "2"
    assert "fixed" in controller.args and "fixed" in trainer.args


def test_component_picks_a_free_etcd_port_once(tiny_spec: Path) -> None:
    app = train(spec=str(tiny_spec))
    controller, trainer = app.roles
    port = int(controller.args[controller.args.index("--etcd-port") + 1])
    assert port > 0
    assert trainer.args[trainer.args.index("--etcd") + 1] == f"127.0.0.1:{port}"


def test_component_rejects_bad_spec_naming_the_field(tmp_path: Path) -> None:
    bad = write_spec(tmp_path / "bad.yaml", model={"depth": 0})
    with pytest.raises(SpecError) as err:
        train(spec=str(bad))
    assert "model.depth" in str(err.value)
    with pytest.raises(SpecError, match="no such file"):
        train(spec=str(tmp_path / "missing.yaml"))


def test_component_rejects_worker_count_mismatch(tiny_spec: Path) -> None:
    with pytest.raises(ValueError) as err:
        train(spec=str(tiny_spec), nproc_per_node=3)
    msg = str(err.value)
    assert "nnodes x nproc_per_node (1 x 3 = 3)" in msg
    assert "parallel.stages x parallel.replicas (2 x 1 = 2)" in msg


def test_train_takes_documents_and_defaults_every_argument() -> None:
    """torchx makes `train`'s CLI from its signature and docstring: every parameter has its help,
    and `TrainArgs` (what `train` hands on) has the same names and defaults."""
    params = inspect.signature(train).parameters
    fields = {
        f.name: inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        for f in dataclasses.fields(TrainArgs)
    }
    assert {name: p.default for name, p in params.items()} == fields
    _, helps = get_fn_docstring(train)
    assert all(helps[name].strip() for name in params), [n for n in params if not helps[n].strip()]


def literal_inputs(**args: Any) -> TrainInputs:
    """What `components.gather` would hand the translation, written out: no file, port or
    secret behind any of it."""
    return TrainInputs(
        args=TrainArgs(spec="specs/tiny.yaml", **args),
        job=parse_spec(TINY),
        spec_text="name: tiny-torchx\n",
        trainer_overlay=None,
        free_port=23456,
        launch_secret="5" * 64,
        cwd="/checkout",
        python="/venv/bin/python",
    )


def test_the_translation_into_an_appdef_is_pure(monkeypatch: pytest.MonkeyPatch) -> None:
    """`train` does its I/O at its edge (`gather`); `app_def` builds the AppDef from literal
    inputs without reading a file, opening a socket, making a secret or asking for the current
    directory, and the same inputs give the same AppDef, on every platform."""
    pods_args = {"image": "registry.example/pipetransformer:1.0", "etcd": "etcd:2379"}

    def no_io(*_: object, **__: object) -> None:
        raise AssertionError("the translation into an AppDef did I/O")

    with monkeypatch.context() as m:
        for owner, name in [
            (builtins, "open"),
            (io, "open"),
            (Path, "read_text"),
            (os, "getcwd"),
            (socket, "socket"),
            (secrets, "token_hex"),
            (secrets, "token_bytes"),
        ]:
            m.setattr(owner, name, no_io)
        local, pods = app_def(literal_inputs()), app_def(literal_inputs(**pods_args))
        again = app_def(literal_inputs()), app_def(literal_inputs(**pods_args))
    assert again == (local, pods)
    assert set(PLATFORMS) == {"local", "kubernetes"}

    controller, trainer = local.roles
    c = controller.args
    assert controller.image == trainer.image == "/checkout"
    assert controller.entrypoint == trainer.entrypoint == "/venv/bin/python"
    assert c[c.index("controller") + 1] == "specs/tiny.yaml"
    assert c[c.index("--etcd-port") + 1] == "23456"
    assert trainer.args[trainer.args.index("--etcd") + 1] == "127.0.0.1:23456"
    assert trainer.env[RDZV_SECRET_ENV] == "5" * 64 and RDZV_SECRET_ENV not in controller.env

    controller, trainer = pods.roles
    assert controller.image == trainer.image == pods_args["image"]
    assert controller.entrypoint == "python" and "specs/tiny.yaml" not in controller.args
    assert controller.env[SPEC_ENV] == "name: tiny-torchx\n"  # the spec's text travels inline
    # the trainers' etcd password: never a value in the role, read from the launch's Secret
    assert PASSWORD_ENV not in trainer.env and "5" * 64 not in str(pods)
    assert volcano.secret_env(trainer, "launch") == {
        PASSWORD_ENV: {"name": "launch-etcd-trainer", "key": "password"}
    }
    assert trainer.min_replicas == 1 and "kubernetes" in trainer.metadata


# -- through the torchx CLI ---------------------------------------------------------------------


@pytest.mark.slow
def test_torchx_dryrun_prints_both_roles(tiny_spec: Path, tmp_path: Path) -> None:
    for component in (COMPONENT_FILE, COMPONENT_MODULE):
        proc = torchx(
            "run",
            "-s",
            "local_cwd",
            "--dryrun",
            component,
            "--spec",
            str(tiny_spec),
            "--workdir",
            str(tmp_path / "runs"),
            timeout=60,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert "'name': 'controller'" in out and "'name': 'trainer'" in out, out
        assert (
            "pipetransformer.orchestrator.cli" in out
            and "'workers'" in out
            and "'controller'" in out
        )
    assert not (tmp_path / "runs").exists()  # a dry run starts nothing


@pytest.mark.slow
def test_torchx_rejects_bad_spec_before_starting_anything(tmp_path: Path) -> None:
    bad = write_spec(tmp_path / "bad.yaml", parallel={"microbatches": 3})
    proc = torchx(
        "run",
        "-s",
        "local_cwd",
        COMPONENT_FILE,
        "--spec",
        str(bad),
        "--workdir",
        str(tmp_path / "runs"),
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "training.global_batch_size" in out and "Traceback" not in out, out
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_torchx_local_cwd_trains_a_job_into_the_store(tiny_spec: Path, tmp_path: Path) -> None:
    runs, logs = tmp_path / "runs", tmp_path / "torchx-logs"
    started = time.monotonic()
    try:
        proc = torchx(
            "run",
            "-s",
            "local_cwd",
            "-cfg",
            f"log_dir={logs}",
            COMPONENT_FILE,
            "--spec",
            str(tiny_spec),
            "--workdir",
            str(runs),
            "--join_timeout",
            "60",
            timeout=180,
        )
    except subprocess.TimeoutExpired as exc:
        output = f"{exc.stdout}\n{exc.stderr}\n{role_logs(logs)}"
        pytest.fail(f"torchx run did not finish in {exc.timeout}s\n{output}")
    out = f"{proc.stdout}\n{proc.stderr}\n{role_logs(logs)}"
    assert proc.returncode == 0, out
    assert "SUCCEEDED" in proc.stderr, out
    print(f"torchx run took {time.monotonic() - started:.1f}s")

    with Store.open(sqlite_url(runs / "store.db")) as store:
        jobs = store.list_jobs()
        assert len(jobs) == 1, out
        job = jobs[0]
        assert job.id.startswith("tiny-torchx-")  # the torchx app id
        assert job.state == "completed", f"{job.state}: {job.message}\n{out}"
        assert job.step == MAX_STEPS

        steps = [m.step for m in store.metrics(job.id)]
        assert steps and max(steps) == MAX_STEPS and sorted(set(steps)) == steps, steps

        checkpoints = store.checkpoints(job.id)
        assert checkpoints, out
        assert checkpoints[0].step == MAX_STEPS and Path(checkpoints[0].path).is_dir()

        # the epoch ended at step 6: held-out accuracy was measured and recorded
        evals = store.evaluations(job.id)
        assert [e.step for e in evals] == [MAX_STEPS], evals
        assert job.accuracy is not None and 0.0 <= job.accuracy <= 1.0
