"""TorchX component: one pipetransformer job as a controller role plus trainer roles.

Locally (each role runs in the current directory with the current Python environment):

    torchx run -s local_cwd orchestrator/components.py:train --spec examples/vit-digits.yaml

trains the same job as `pipetransformer run examples/vit-digits.yaml`, writing to the same store
(SQLite under --workdir) so `pipetransformer status` and `dashboard` show it. The installed
module form `pipetransformer.orchestrator.components:train` works too.

On Kubernetes (Volcano), after `kubectl apply -k k8s/overlays/...` (k8s/README.md):

    torchx run -s kubernetes --workspace "" -cfg queue=pipetransformer,priority_class=...
        orchestrator/components.py:train --spec examples/vit-digits.yaml
        --image REGISTRY/pipetransformer:TAG --etcd etcd:2379

`--image` switches the component to container mode: the roles run `python` from the image, find
etcd and the store through Services (the database URL comes from a Secret, never an argument),
share the checkpoint volume (a ReadWriteMany PVC mounted at --workdir), keep AutoCache files on a
node-local emptyDir, and carry the spec inline (the submitting machine's files are not in the pods).

Roles:

* `controller` (1 replica): `pipetransformer controller [SPEC]` creates the job in the store,
  publishes spec, layout and assignment in etcd, and records what the workers report. Locally,
  without `--etcd`, it serves an embedded etcd on `--etcd_port` (picked free when this component
  is evaluated, so both roles know it before either starts). With `--metrics_port` (in container
  mode by default, port 9400) it serves the job's Prometheus metrics (`/metrics`,
  orchestrator/monitoring.py) from a container port named `metrics`, and its pod carries the
  `prometheus.io/*` annotations and the labels k8s/monitoring/podmonitor.yaml selects.
* `trainer` (`nnodes` replicas): `pipetransformer workers` waits for etcd and the job's
  assignment, then runs torchrun (etcd v3 rendezvous) with `nproc_per_node` workers, elastic
  between `runtime.min_nodes` and `nnodes` nodes. Start order does not matter.

Both roles use the scheduler's app id as the job id unless `--job_id` is given.

How it is built (as torchx's own components are: the docstring below is `train`'s CLI help):
`train` gathers what needs I/O at its edge (`gather`: the spec file read and validated, a trainer
pod overlay read, a free port for an embedded etcd, a secret for this launch, the current
directory and interpreter) into one `TrainInputs`, and hands it to the pure translation
(orchestrator/appdef.py `app_def`): the platform it names (orchestrator/platforms/: `local`, or
`kubernetes` with `--image`) resolves the options and decorates the two roles.
"""

# No `from __future__ import annotations`: torchx reads the parameter annotations as types.
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import torchx.specs as specs

from pipetransformer.core.spec import JobSpec, SpecError, load_spec
from pipetransformer.orchestrator.appdef import METRICS_PORT_NAME, app_def
from pipetransformer.orchestrator.etcd_server import free_port
from pipetransformer.orchestrator.platforms.base import (
    CONTROLLER_ROLE,
    TRAINER_ROLE,
    ComponentArgError,
    ComponentSpecError,
    TrainArgs,
    TrainInputs,
)
from pipetransformer.orchestrator.platforms.kubernetes import METRICS_PORT

__all__ = [
    "CONTROLLER_ROLE",
    "METRICS_PORT",
    "METRICS_PORT_NAME",
    "TRAINER_ROLE",
    "ComponentArgError",
    "ComponentSpecError",
    "gather",
    "train",
]


def train(
    spec: str,
    workdir: str = "./runs",
    job_id: str = "",
    db: str = "",
    etcd: str = "",
    etcd_port: int = 0,
    nnodes: int = 1,
    nproc_per_node: int = 0,
    join_timeout: float = 300.0,
    image: str = "",
    controller_image: str = "",
    python: str = "",
    h: str | None = None,
    cpu: int = 0,
    memMB: int = 0,
    gpu: int = -1,
    env: dict[str, str] | None = None,
    mounts: list[str] | None = None,
    max_retries: int = -1,
    db_secret: str = "pipetransformer-db",
    rdzv_secret: str = "pipetransformer-rdzv",
    etcd_client_secrets: str = "etcd-client",
    etcd_trainer_secret: str = "",
    workdir_pvc: str = "pipetransformer-workdir",
    grace_period_s: int = 120,
    trainer_overlay: str = "",
    metrics_port: int = -1,
    shm_mib: int = 0,
) -> specs.AppDef:
    """Train a pipetransformer job: one controller role and `nnodes` trainer roles.

    Usage: torchx run -s local_cwd orchestrator/components.py:train --spec examples/vit-digits.yaml

    On Kubernetes: torchx run -s kubernetes --workspace "" -cfg queue=pipetransformer
    orchestrator/components.py:train --spec SPEC --image REGISTRY/pipetransformer:TAG
    --etcd etcd:2379

    The spec is validated here, before anything starts; nnodes x nproc_per_node must equal
    parallel.stages x parallel.replicas of the spec.

    Args:
        spec: job spec YAML (read here; in container mode it travels inline with the job)
        workdir: store, embedded etcd data and checkpoints (shared by all roles; /workdir, the
            checkpoint volume, in container mode)
        job_id: job id in the store and etcd (default: the scheduler's app id)
        db: SQLAlchemy URL of an external store, locally (default: SQLite in workdir); in
            container mode the URL comes from db_secret instead
        etcd: HOST:PORT of an external etcd (default: an embedded etcd in the controller);
            required in container mode, e.g. etcd:2379 (the Service from k8s/)
        etcd_port: port of the controller's embedded etcd (default: a free port, picked now)
        nnodes: trainer replicas (one torchrun agent each); the job keeps training down to the
            spec's runtime.min_nodes of them
        nproc_per_node: worker processes per trainer replica (default: the spec's workers,
            parallel.stages x parallel.replicas, shared evenly by the nnodes replicas)
        join_timeout: seconds the roles wait for each other (etcd, assignment, first workers)
        image: container image with the project (REGISTRY/pipetransformer:TAG); switches to
            container mode (Kubernetes); local_cwd leaves it empty
        controller_image: container mode: the controller's image (default: --image), e.g. the
            Dockerfile's slim `controller` target (CPU torch, no CUDA wheels or Hugging Face
            libraries): a cold pull that fits well inside join_timeout (docs/image.md)
        python: interpreter the roles run (default: the one running torchx; `python` in images)
        h: a registered named resource for the trainer (takes precedence over cpu and memMB)
        cpu: cpus per trainer replica (default: from the spec, orchestrator/sizing.py: each
            worker's threads and data loaders, two more per GPU worker, one for torchrun)
        memMB: memory in MiB per trainer replica (default: from the spec and the measured cost
            of torchrun, the fork server and a worker, orchestrator/sizing.py; 1024 per worker
            locally); in pods requests equal limits (Guaranteed QoS)
        gpu: GPUs per trainer replica (default: nproc_per_node when the spec's runtime.device
            is cuda, else 0); locally add -cfg auto_set_cuda_visible_devices=True so that each
            trainer sees its own
        env: extra environment variables for both roles (e.g. ENV1=v1,ENV2=v2)
        mounts: extra mounts for both roles (type=<bind|volume>,src=...,dst=...[,readonly])
        max_retries: scheduler retries per role (default: 0 locally, 3 in container mode: the
            Volcano job's maxRetry, which bounds the pod replacements Volcano makes; the
            controller also ends the job after that many unclean restarts of its own)
        db_secret: container mode: Secret holding the store's URL under the key
            PIPETRANSFORMER_DB, the controller's environment (empty: SQLite on the checkpoint
            volume, for trials)
        rdzv_secret: container mode: Secret holding the job's rendezvous secret under the key
            PIPETRANSFORMER_RDZV_SECRET, the trainers' environment: it signs torchrun's
            rendezvous state, a pickle, so that no one without it can write one (empty: an
            unsigned rendezvous, for trials); locally a secret is made for each launch
        etcd_client_secrets: container mode: the Secrets holding each role's etcd client
            certificate, `<this>-controller` and `<this>-trainer` (keys ca.crt, tls.crt, tls.key;
            k8s/README.md "etcd: TLS and roles"); the trainers sign in as etcd user
            `trainer-<job id>` with the password in etcd_trainer_secret, which the controller
            creates (empty: an etcd without TLS or auth, for trials)
        etcd_trainer_secret: container mode, with etcd_client_secrets: the Secret holding the
            trainers' etcd password under the key `password`, which the controller and the
            trainers read (`secretKeyRef`; never a value in the Job). Default: one made for
            each launch by `torchx run -s kubernetes`, `<Volcano Job name>-etcd-trainer`,
            owned by the Job and deleted with it (so no other job's trainers know it). A
            Secret named here is yours, and every job that names it shares its password
        workdir_pvc: container mode: the ReadWriteMany PVC mounted at workdir in every pod
        grace_period_s: container mode: seconds a pod gets after SIGTERM (a leaving trainer
            checkpoints in that time)
        trainer_overlay: container mode: a YAML file merged into every trainer pod (torchx's
            pod overlay format, top-level `spec`), e.g. k8s/overlays/gpu/pod-overlay.yaml for
            GPU tolerations and node selectors
        metrics_port: port on which the controller serves the job's Prometheus metrics at
            /metrics (default: 9400 in container mode, where the pod gets a container port
            named `metrics` and the prometheus.io/scrape, port and path annotations, and is
            ready once it serves them; off locally); 0 turns them off
        shm_mib: container mode: size limit of each trainer pod's /dev/shm in MiB (memory,
            counted against the pod's memory: at most memMB; default half the pod's memory)
    """
    args = TrainArgs(**locals())  # every parameter above, as given
    return app_def(gather(args))


def gather(args: TrainArgs) -> TrainInputs:
    """All the component's I/O, done once before the pure translation: the spec file read and
    validated (its text too: container mode carries it inline), the user's trainer pod overlay
    read (container mode), a port free now for an embedded etcd (no --etcd, no --etcd_port: both
    roles know it before either starts), a secret made for this launch, and where local roles
    run from (the current directory, this interpreter)."""
    embedded = not (args.etcd or args.etcd_port)
    return TrainInputs(
        args=args,
        job=_load(args.spec),
        spec_text=Path(args.spec).read_text(),
        trainer_overlay=(
            _read_overlay(args.trainer_overlay) if args.image and args.trainer_overlay else None
        ),
        free_port=free_port() if embedded else 0,
        launch_secret=secrets.token_hex(32),
        cwd=os.getcwd(),
        python=sys.executable,
    )


def _load(spec: str) -> JobSpec:
    try:
        return load_spec(spec)  # a bad spec fails here, before anything starts
    except SpecError as exc:
        raise ComponentSpecError(exc.problems, exc.source) from None


def _read_overlay(path: str) -> Any:
    import yaml  # a dependency of torchx and of this project's spec reader

    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ComponentArgError(f"trainer_overlay={path}: cannot read it ({exc})") from None
