"""TorchX component: one pipetransformer job as a controller role plus trainer roles.

Locally (each role runs in the current directory with the current Python environment):

    torchx run -s local_cwd orchestrator/components.py:train --spec examples/vit-digits.yaml

trains the same job as `pipetransformer run examples/vit-digits.yaml`, writing to the same store
(SQLite under --workdir) so `pipetransformer status` and `dashboard` show it. The installed
module form `orchestrator.components:train` works too.

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
  is evaluated, so both roles know it before either starts).
* `trainer` (`nnodes` replicas): `pipetransformer workers` waits for etcd and the job's
  assignment, then runs torchrun (etcd v3 rendezvous) with `nproc_per_node` workers, elastic
  between `runtime.min_nodes` and `nnodes` nodes. Start order does not matter.

Both roles use the scheduler's app id as the job id unless `--job_id` is given.
"""

# No `from __future__ import annotations`: torchx reads the parameter annotations as types.
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torchx.specs as specs
from torchx.specs import RetryPolicy, macros
from torchx.specs.finder import ComponentValidationException
from torchx.specs.overlays import JOIN, set_overlay

from core.keys import ACTIVATION_CACHE_ENV, SPEC_ENV
from core.spec import JobSpec, SpecError, load_spec
from orchestrator.etcd_server import free_port

CONTROLLER_ROLE = "controller"
TRAINER_ROLE = "trainer"
CONTROLLER_MEM_MB = 1024
TRAINER_MEM_MB_PER_PROC = 1024
# torchx's Kubernetes scheduler requests memMB minus this reserve (it leaves room for the node's
# own daemons), so the controller asks for that much more to get CONTROLLER_MEM_MB
K8S_RESERVED_MEM_MB = 1024
CACHE_DIR = "/cache"  # a node-local emptyDir in each trainer pod
POD_WORKDIR = "/workdir"  # where the checkpoint volume is mounted in every pod
IMAGE_UID = 10001  # the non-root user of the project's image (Dockerfile)
TORCHX_SHM_VOLUME = "dshm"  # the /dev/shm volume torchx gives every pod (a test checks the name)
K8S_RETRIES = 3


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
    gpu: int = -1,
    env: dict[str, str] | None = None,
    mounts: list[str] | None = None,
    max_retries: int = -1,
    db_secret: str = "pipetransformer-db",
    workdir_pvc: str = "pipetransformer-workdir",
    grace_period_s: int = 120,
    trainer_overlay: str = "",
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
        nproc_per_node: worker processes per trainer replica
        join_timeout: seconds the roles wait for each other (etcd, assignment, first workers)
        image: container image with the project (REGISTRY/pipetransformer:TAG); switches to
            container mode (Kubernetes); local_cwd leaves it empty
        python: interpreter the roles run (default: the one running torchx; `python` in images)
        h: a registered named resource for the trainer (takes precedence over cpu and memMB)
        cpu: cpus per trainer replica (default: nproc_per_node x runtime.threads_per_worker)
        memMB: memory in MB per trainer replica (default: 1024 per worker process)
        gpu: GPUs per trainer replica (default: nproc_per_node when the spec's runtime.device
            is cuda, else 0); locally add -cfg auto_set_cuda_visible_devices=True so that each
            trainer sees its own
        env: extra environment variables for both roles (e.g. ENV1=v1,ENV2=v2)
        mounts: extra mounts for both roles (type=<bind|volume>,src=...,dst=...[,readonly])
        max_retries: scheduler retries per role (default: 0 locally, 3 in container mode)
        db_secret: container mode: Secret holding the store's URL under the key
            PIPETRANSFORMER_DB, the controller's environment (empty: SQLite on the checkpoint
            volume, for trials)
        workdir_pvc: container mode: the ReadWriteMany PVC mounted at workdir in every pod
        grace_period_s: container mode: seconds a pod gets after SIGTERM (a leaving trainer
            checkpoints in that time)
        trainer_overlay: container mode: a YAML file merged into every trainer pod (torchx's
            pod overlay format, top-level `spec`), e.g. k8s/overlays/gpu/pod-overlay.yaml for
            GPU tolerations and node selectors
    """
    job = _load(spec)
    _check_shape(job, spec, nnodes, nproc_per_node)
    if image:
        return _container_app(
            job=job,
            spec=spec,
            job_id=job_id or macros.app_id,
            workdir=POD_WORKDIR if workdir == "./runs" else workdir,
            db=db,
            etcd=etcd,
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            join_timeout=join_timeout,
            image=image,
            python=python or "python",
            # torchx's Kubernetes scheduler requests memMB minus its reserve: add it back
            resource=_trainer_resource(
                job, nproc_per_node, h, cpu, memMB, K8S_RESERVED_MEM_MB, gpu
            ),
            env=env or {},
            mounts=mounts or [],
            max_retries=K8S_RETRIES if max_retries < 0 else max_retries,
            db_secret=db_secret,
            workdir_pvc=workdir_pvc,
            grace_period_s=grace_period_s,
            trainer_overlay=trainer_overlay,
        )

    job_id = job_id or macros.app_id
    if etcd:
        controller_etcd, trainer_etcd = ["--etcd", etcd], etcd
    else:
        port = etcd_port or free_port()
        controller_etcd, trainer_etcd = ["--etcd-port", str(port)], f"127.0.0.1:{port}"
    cli = [python or sys.executable, "-m", "orchestrator.cli"]
    controller_args = [
        "controller",
        spec,
        "--workdir",
        workdir,
        "--job-id",
        job_id,
        *(["--db", db] if db else []),
        *controller_etcd,
        "--join-timeout",
        str(join_timeout),
    ]
    trainer_args = _trainer_args(job, job_id, trainer_etcd, nnodes, nproc_per_node, join_timeout)
    role_env = {"COLUMNS": "120", **(env or {})}
    role_mounts = specs.parse_mounts(mounts) if mounts else []
    retries = max(0, max_retries)
    return specs.AppDef(
        name=job.name,
        roles=[
            specs.Role(
                name=CONTROLLER_ROLE,
                image=os.getcwd(),  # local_cwd runs a role in its image's directory
                entrypoint=cli[0],
                args=[*cli[1:], *controller_args],
                num_replicas=1,
                resource=specs.resource(cpu=1, gpu=0, memMB=CONTROLLER_MEM_MB),
                env=dict(role_env),
                mounts=list(role_mounts),
                max_retries=retries,
            ),
            specs.Role(
                name=TRAINER_ROLE,
                image=os.getcwd(),
                entrypoint=cli[0],
                args=[*cli[1:], *trainer_args],
                num_replicas=nnodes,
                resource=_trainer_resource(job, nproc_per_node, h, cpu, memMB, gpu=gpu),
                env=dict(role_env),
                mounts=list(role_mounts),
                max_retries=retries,
            ),
        ],
    )


def _load(spec: str) -> JobSpec:
    try:
        return load_spec(spec)  # a bad spec fails here, before anything starts
    except SpecError as exc:
        raise ComponentSpecError(exc.problems, exc.source) from None


def _check_shape(job: JobSpec, spec: str, nnodes: int, nproc_per_node: int) -> None:
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


def min_nodes(job: JobSpec, nnodes: int) -> int:
    """The fewest trainer nodes the job keeps training on: the spec's runtime.min_nodes, within
    1..nnodes (a spec without it is not elastic: every node is required)."""
    return max(1, min(job.runtime.min_nodes or nnodes, nnodes))


def _trainer_args(
    job: JobSpec, job_id: str, etcd: str, nnodes: int, nproc_per_node: int, join_timeout: float
) -> list[str]:
    low = min_nodes(job, nnodes)
    return [
        "workers",
        "--job-id",
        job_id,
        "--etcd",
        etcd,
        "--nproc-per-node",
        str(nproc_per_node),
        "--nnodes",
        f"{low}:{nnodes}" if low < nnodes else str(nnodes),  # MIN:MAX: torchrun is elastic
        "--join-timeout",
        str(join_timeout),
    ]


def trainer_gpus(job: JobSpec, nproc_per_node: int, gpu: int = -1) -> int:
    """GPUs per trainer replica: `gpu` when given (>= 0), else one per worker process when the
    spec computes on CUDA (`runtime.device: cuda`; `auto` requests none and runs where it lands)."""
    if gpu < -1:
        raise ComponentArgError(
            f"gpu={gpu}: give a number of GPUs per trainer (0 or more), or leave it unset"
        )
    if gpu >= 0:
        return gpu
    return nproc_per_node if job.runtime.device == "cuda" else 0


def _trainer_resource(
    job: JobSpec,
    nproc_per_node: int,
    h: str | None,
    cpu: int,
    memMB: int,
    reserve: int = 0,
    gpu: int = -1,
) -> specs.Resource:
    gpus = trainer_gpus(job, nproc_per_node, gpu)
    if job.runtime.device == "cuda" and gpus < nproc_per_node:
        raise ComponentArgError(
            f"gpu={gpus}: runtime.device is 'cuda' and each trainer runs {nproc_per_node} "
            f"worker(s), one per GPU; request at least {nproc_per_node} (or leave gpu unset)"
        )
    return specs.resource(
        cpu=cpu or nproc_per_node * job.runtime.threads_per_worker,
        gpu=gpus,  # torchx's Kubernetes scheduler requests nvidia.com/gpu
        memMB=(memMB or TRAINER_MEM_MB_PER_PROC * nproc_per_node) + reserve,
        h=h,
    )


def _loopback(host_port: str) -> bool:
    host = host_port.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _container_app(
    *,
    job: JobSpec,
    spec: str,
    job_id: str,
    workdir: str,
    db: str,
    etcd: str,
    nnodes: int,
    nproc_per_node: int,
    join_timeout: float,
    image: str,
    python: str,
    resource: specs.Resource,
    env: dict[str, str],
    mounts: list[str],
    max_retries: int,
    db_secret: str,
    workdir_pvc: str,
    grace_period_s: int,
    trainer_overlay: str,
) -> specs.AppDef:
    """The job as pods: every address a Service, every secret a Secret, state on volumes."""
    if not etcd:
        raise ComponentArgError(
            "etcd: container mode needs an etcd every pod can reach, e.g. --etcd etcd:2379 (the "
            "Service from k8s/); an embedded etcd would listen on the controller pod's loopback"
        )
    if _loopback(etcd):
        raise ComponentArgError(f"etcd={etcd} is a loopback address, which no other pod reaches")
    if db:
        raise ComponentArgError(
            "db: in container mode the store's URL (and its password) comes from the Secret "
            f"named by --db_secret (key PIPETRANSFORMER_DB, default {db_secret!r}), never from "
            "an argument"
        )
    if not workdir_pvc:
        raise ComponentArgError("workdir_pvc: the pods need the shared checkpoint volume")
    if not workdir.startswith("/"):
        raise ComponentArgError(f"workdir={workdir!r} must be an absolute path in the pods")
    if grace_period_s < 1:
        raise ComponentArgError(f"grace_period_s={grace_period_s} must be at least 1")
    cli = [python, "-m", "orchestrator.cli"]
    controller_args = [
        "controller",  # no spec path: it reads the spec's text from $PIPETRANSFORMER_SPEC
        "--workdir",
        workdir,
        "--job-id",
        job_id,
        "--etcd",
        etcd,
        "--join-timeout",
        str(join_timeout),
    ]
    trainer_args = _trainer_args(job, job_id, etcd, nnodes, nproc_per_node, join_timeout)
    extra = specs.parse_mounts(mounts) if mounts else []
    base_env = {"COLUMNS": "120", **env}
    controller = specs.Role(
        name=CONTROLLER_ROLE,
        image=image,
        entrypoint=cli[0],
        args=[*cli[1:], *controller_args],
        num_replicas=1,
        resource=specs.resource(cpu=1, gpu=0, memMB=CONTROLLER_MEM_MB + K8S_RESERVED_MEM_MB),
        env={**base_env, SPEC_ENV: Path(spec).read_text()},
        max_retries=max_retries,
        retry_policy=RetryPolicy.REPLICA,  # a failed controller is restarted alone
    )
    trainer = specs.Role(
        name=TRAINER_ROLE,
        image=image,
        entrypoint=cli[0],
        args=[*cli[1:], *trainer_args],
        num_replicas=nnodes,
        # the first min_nodes pods are required to start; a lost pod is replaced and rejoins
        min_replicas=min_nodes(job, nnodes),
        resource=resource,
        env={**base_env, ACTIVATION_CACHE_ENV: CACHE_DIR},
        max_retries=max_retries,
        retry_policy=RetryPolicy.REPLICA,  # never RestartJob: the rest keeps training
    )
    volumes = PodVolumes(workdir_pvc, workdir, extra)
    set_overlay(
        controller, "kubernetes", "V1Pod", pod_overlay(image, grace_period_s, volumes, db_secret)
    )
    set_overlay(
        trainer, "kubernetes", "V1Pod", pod_overlay(image, grace_period_s, volumes, cache=True)
    )
    if trainer_overlay:  # the user's, merged after ours (lists append, mappings merge)
        set_overlay(trainer, "kubernetes", "V1Pod", _user_overlay(trainer_overlay))
    return specs.AppDef(name=job.name, roles=[controller, trainer])


def _user_overlay(path: str) -> dict[str, Any]:
    import yaml  # a dependency of torchx and of this project's spec reader

    try:
        overlay = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ComponentArgError(f"trainer_overlay={path}: cannot read it ({exc})") from None
    if not isinstance(overlay, dict) or set(overlay) != {"spec"}:
        raise ComponentArgError(
            f"trainer_overlay={path}: expected a mapping with one key, `spec` (fields of the "
            "pod's spec, e.g. tolerations and nodeSelector)"
        )
    return overlay


@dataclass(frozen=True)
class PodVolumes:
    """The volumes of a job's pods: the checkpoint PVC at the workdir, and the user's mounts."""

    workdir_pvc: str
    workdir: str
    extra: list[specs.BindMount | specs.VolumeMount | specs.DeviceMount]

    def volumes(self, cache: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(pod volumes, container volume mounts), torchx's shared-memory mount included: the
        overlay replaces the container's list, so it must list everything."""
        vols: list[dict[str, Any]] = [
            {"name": "workdir", "persistentVolumeClaim": {"claimName": self.workdir_pvc}}
        ]
        mounts: list[dict[str, Any]] = [
            {"name": TORCHX_SHM_VOLUME, "mountPath": "/dev/shm"},
            {"name": "workdir", "mountPath": self.workdir},
        ]
        if cache:
            vols.append({"name": "activation-cache", "emptyDir": {}})
            mounts.append({"name": "activation-cache", "mountPath": CACHE_DIR})
        for i, m in enumerate(self.extra):
            name = f"extra-{i}"
            if isinstance(m, specs.VolumeMount):
                vols.append({"name": name, "persistentVolumeClaim": {"claimName": m.src}})
            elif isinstance(m, specs.BindMount):
                vols.append({"name": name, "hostPath": {"path": m.src_path}})
            else:
                raise ComponentArgError(f"mounts: device mounts are not supported here ({m})")
            mounts.append({"name": name, "mountPath": m.dst_path, "readOnly": m.read_only})
        return vols, mounts


def pod_overlay(
    image: str,
    grace_period_s: int,
    volumes: PodVolumes,
    db_secret: str = "",
    cache: bool = False,
) -> dict[str, Any]:
    """What torchx's generated pod lacks: the non-root user and volume group of the image, no
    API token (the pods never call the Kubernetes API), restarts in place, the grace period a
    leaving trainer checkpoints in, the store URL from its Secret (`envFrom`: its key is the
    variable's name, PIPETRANSFORMER_DB), the checkpoint volume and a node-local cache.

    The container is found by its image (each role's pod has one container, named per replica)
    and merged field by field: a list given here replaces the generated one, so only
    `volumeMounts` (listed whole) and `envFrom` (absent before) are set on it."""
    pod_volumes, container_mounts = volumes.volumes(cache)
    container: dict[str, Any] = {"image": image, "volumeMounts": container_mounts}
    if db_secret:
        container["envFrom"] = [{"secretRef": {"name": db_secret}}]
    return {
        "spec": {
            "automountServiceAccountToken": False,
            # no FOO_SERVICE_HOST variables: the `etcd` Service's ETCD_* would reach the pods
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": grace_period_s,
            # a crashed process restarts in its pod; a lost pod is recreated by Volcano
            "restartPolicy": "OnFailure",
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": IMAGE_UID,
                "runAsGroup": IMAGE_UID,
                "fsGroup": IMAGE_UID,  # the checkpoint volume writable by the image's user
            },
            "volumes": pod_volumes,  # appended to torchx's shared-memory volume
            JOIN("containers", on="image"): [container],
        }
    }
