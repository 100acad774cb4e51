"""TorchX component: one pipetransformer job as a controller role plus trainer roles.

Locally (each role runs in the current directory with the current Python environment):

    torchx run -s local_cwd orchestrator/components.py:train --spec examples/vit-digits.yaml

trains the same job as `pipetransformer run examples/vit-digits.yaml`, writing to the same store
(SQLite under --workdir) so `pipetransformer status` and `dashboard` show it. The installed
module form `orchestrator.components:train` works too.

Roles:

* `controller` (1 replica): `pipetransformer controller SPEC` creates the job in the store,
  publishes spec, layout and assignment in etcd, and records what the workers report. Without
  `--etcd` it serves an embedded etcd on `--etcd_port` (picked free when this component is
  evaluated, so both roles know it before either starts).
* `trainer` (`nnodes` replicas): `pipetransformer workers` waits for etcd and the job's
  assignment, then runs torchrun (etcd v3 rendezvous) with `nproc_per_node` workers. Start order
  does not matter.

Both roles use the scheduler's app id as the job id unless `--job_id` is given.
"""

# No `from __future__ import annotations`: torchx reads the parameter annotations as types.
import os
import sys

import torchx.specs as specs
from torchx.specs import macros
from torchx.specs.finder import ComponentValidationException

from orchestrator.etcd_server import free_port
from orchestrator.spec import SpecError, load_spec

CONTROLLER_ROLE = "controller"
TRAINER_ROLE = "trainer"
CONTROLLER_MEM_MB = 1024
TRAINER_MEM_MB_PER_PROC = 1024


class ComponentArgError(ComponentValidationException, ValueError):
    """Component arguments that cannot make a valid job (torchx prints it without a traceback)."""


class ComponentSpecError(ComponentValidationException, SpecError):
    """The job spec failed validation; same fields and message as the SpecError it wraps."""


def train(
    spec: str,
    workdir: str = "./runs",
    job_id: str = "",
    db: str = "",
    etcd: str = "",
    etcd_port: int = 0,
    nnodes: int = 1,
    nproc_per_node: int = 2,
    join_timeout: float = 300.0,
    image: str = "",
    python: str = "",
    h: str | None = None,
    cpu: int = 0,
    memMB: int = 0,
    env: dict[str, str] | None = None,
    mounts: list[str] | None = None,
    max_retries: int = 0,
) -> specs.AppDef:
    """Train a pipetransformer job: one controller role and `nnodes` trainer roles.

    Usage: torchx run -s local_cwd orchestrator/components.py:train --spec examples/vit-digits.yaml

    The spec is validated here, before anything starts; nnodes x nproc_per_node must equal
    parallel.stages x parallel.replicas of the spec.

    Args:
        spec: job spec YAML (path as seen by the roles; locally relative to the current dir)
        workdir: store, embedded etcd data and checkpoints (shared by all roles)
        job_id: job id in the store and etcd (default: the scheduler's app id)
        db: SQLAlchemy URL of an external store (default: SQLite in workdir)
        etcd: HOST:PORT of an external etcd (default: an embedded etcd in the controller)
        etcd_port: port of the controller's embedded etcd (default: a free port, picked now)
        nnodes: trainer replicas (one torchrun agent each)
        nproc_per_node: worker processes per trainer replica
        join_timeout: seconds the roles wait for each other (etcd, assignment, first workers)
        image: container image for remote schedulers (local_cwd ignores it; default: current dir)
        python: interpreter the roles run (default: the one running torchx; `python` in images)
        h: a registered named resource for the trainer (takes precedence over cpu and memMB)
        cpu: cpus per trainer replica (default: nproc_per_node x runtime.threads_per_worker)
        memMB: memory in MB per trainer replica (default: 1024 per worker process)
        env: extra environment variables for both roles (e.g. ENV1=v1,ENV2=v2)
        mounts: mounts for both roles, e.g. the shared workdir on Kubernetes
            (type=<bind|volume>,src=...,dst=...[,readonly])
        max_retries: scheduler retries per role
    """
    try:
        job = load_spec(spec)  # a bad spec fails here, before anything starts
    except SpecError as exc:
        raise ComponentSpecError(exc.problems, exc.source) from None
    if nnodes < 1 or nproc_per_node < 1:
        raise ComponentArgError(
            f"nnodes ({nnodes}) and nproc_per_node ({nproc_per_node}) must be at least 1"
        )
    workers = nnodes * nproc_per_node
    if workers != job.parallel.world_size:
        p = job.parallel
        raise ComponentArgError(
            f"nnodes x nproc_per_node ({nnodes} x {nproc_per_node} = {workers}) must equal "
            f"parallel.stages x parallel.replicas ({p.stages} x {p.replicas} = {p.world_size}) "
            f"of {spec}"
        )

    job_id = job_id or macros.app_id
    if etcd:
        controller_etcd, trainer_etcd = ["--etcd", etcd], etcd
    else:
        port = etcd_port or free_port()
        controller_etcd, trainer_etcd = ["--etcd-port", str(port)], f"127.0.0.1:{port}"
    cli = [python or sys.executable, "-m", "orchestrator.cli"]
    timeout = ["--join-timeout", str(join_timeout)]

    controller_args = [
        "controller",
        spec,
        "--workdir",
        workdir,
        "--job-id",
        job_id,
        *(["--db", db] if db else []),
        *controller_etcd,
        *timeout,
    ]
    trainer_args = [
        "workers",
        "--job-id",
        job_id,
        "--etcd",
        trainer_etcd,
        "--nproc-per-node",
        str(nproc_per_node),
        "--nnodes",
        str(nnodes),
        *timeout,
    ]
    role_env = {"COLUMNS": "120", **(env or {})}
    role_mounts = specs.parse_mounts(mounts) if mounts else []
    image = image or os.getcwd()
    # Kubernetes (Volcano) will need: an image with the project, `python` as interpreter, the
    # workdir on a shared volume (mounts) or --db pointing at PostgreSQL, and --etcd pointing
    # at the cluster's etcd (the embedded one listens on the controller's loopback only).
    trainer_cpu = cpu or nproc_per_node * job.runtime.threads_per_worker
    trainer_mem = memMB or TRAINER_MEM_MB_PER_PROC * nproc_per_node
    return specs.AppDef(
        name=job.name,
        roles=[
            specs.Role(
                name=CONTROLLER_ROLE,
                image=image,
                entrypoint=cli[0],
                args=[*cli[1:], *controller_args],
                num_replicas=1,
                resource=specs.resource(cpu=1, gpu=0, memMB=CONTROLLER_MEM_MB),
                env=dict(role_env),
                mounts=list(role_mounts),
                max_retries=max_retries,
            ),
            specs.Role(
                name=TRAINER_ROLE,
                image=image,
                entrypoint=cli[0],
                args=[*cli[1:], *trainer_args],
                num_replicas=nnodes,
                resource=specs.resource(cpu=trainer_cpu, gpu=0, memMB=trainer_mem, h=h),
                env=dict(role_env),
                mounts=list(role_mounts),
                max_retries=max_retries,
            ),
        ],
    )
