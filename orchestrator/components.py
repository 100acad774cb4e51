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
  is evaluated, so both roles know it before either starts). With `--metrics_port` (in container
  mode by default, port 9400) it serves the job's Prometheus metrics (`/metrics`,
  orchestrator/monitoring.py) from a container port named `metrics`, and its pod carries the
  `prometheus.io/*` annotations and the labels k8s/monitoring/podmonitor.yaml selects.
* `trainer` (`nnodes` replicas): `pipetransformer workers` waits for etcd and the job's
  assignment, then runs torchrun (etcd v3 rendezvous) with `nproc_per_node` workers, elastic
  between `runtime.min_nodes` and `nnodes` nodes. Start order does not matter.

Both roles use the scheduler's app id as the job id unless `--job_id` is given.

How it is built: `train` checks its arguments once into a `TrainOptions` (every default resolved
for where the job runs; what only pods need in `Pods`, None locally), then `controller_role` and
`trainer_role` build each role from it, as pure functions.
"""

# No `from __future__ import annotations`: torchx reads the parameter annotations as types.
import os
import secrets
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torchx.specs as specs
from torchx.specs import RetryPolicy, macros
from torchx.specs.finder import ComponentValidationException
from torchx.specs.overlays import set_overlay

from pipetransformer.core.keys import (
    ACTIVATION_CACHE_BYTES_ENV,
    ACTIVATION_CACHE_ENV,
    RDZV_SECRET_ENV,
    SPEC_ENV,
)
from pipetransformer.core.spec import JobSpec, SpecError, load_spec
from pipetransformer.edge.etcd_client import PASSWORD_ENV, USER_ENV
from pipetransformer.orchestrator import etcd_auth, sizing, volcano
from pipetransformer.orchestrator.etcd_server import free_port
from pipetransformer.orchestrator.pods import (
    CACHE_DIR,
    PodVolumes,
    etcd_client_env,
    metrics_annotations,
    pod_overlay,
)

CONTROLLER_ROLE = "controller"
TRAINER_ROLE = "trainer"
TRAINER_MEM_MB_PER_PROC = 1024  # locally (pods: orchestrator/sizing.py)
POD_WORKDIR = "/workdir"  # where the checkpoint volume is mounted in every pod
K8S_RETRIES = 3
# the controller pod's Prometheus metrics port (container mode's default for --metrics_port);
# `pipetransformer controller --metrics-port N` serves them
METRICS_PORT = 9400
METRICS_PORT_NAME = "metrics"  # the container port's name: k8s/monitoring/podmonitor.yaml
# what Volcano does when a role's pod ends (orchestrator/volcano.py)
CONTROLLER_POLICIES = volcano.controller_policies()
TRAINER_POLICIES = volcano.trainer_policies()


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
    workdir_pvc: str = "pipetransformer-workdir",
    grace_period_s: int = 120,
    trainer_overlay: str = "",
    metrics_port: int = -1,
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
            `trainer-<job id>` with a password made for this launch, which the controller
            creates (empty: an etcd without TLS or auth, for trials)
        workdir_pvc: container mode: the ReadWriteMany PVC mounted at workdir in every pod
        grace_period_s: container mode: seconds a pod gets after SIGTERM (a leaving trainer
            checkpoints in that time)
        trainer_overlay: container mode: a YAML file merged into every trainer pod (torchx's
            pod overlay format, top-level `spec`), e.g. k8s/overlays/gpu/pod-overlay.yaml for
            GPU tolerations and node selectors
        metrics_port: port on which the controller serves the job's Prometheus metrics at
            /metrics (default: 9400 in container mode, where the pod gets a container port
            named `metrics` and the prometheus.io/scrape, port and path annotations; off
            locally); 0 turns them off
    """
    job = _load(spec)
    nproc_per_node = _check_shape(job, spec, nnodes, nproc_per_node)
    if not -1 <= metrics_port <= 65535:
        raise ComponentArgError(
            f"metrics_port={metrics_port}: give a port (1-65535), 0 to serve no metrics, or "
            "leave it unset"
        )
    # where local and container mode differ, decided once: the roles read the outcome
    pods: Pods | None = None
    embedded_port: int | None = None
    role_mounts: list[specs.BindMount | specs.VolumeMount | specs.DeviceMount] = []
    if controller_image and not image:
        raise ComponentArgError(
            "controller_image is for container mode: give --image (the trainers') as well"
        )
    if image:
        workdir = POD_WORKDIR if workdir == "./runs" else workdir
        size = trainer_pod_size(job, nproc_per_node, trainer_gpus(job, nproc_per_node, gpu))
        size = replace(size, cpus=cpu or size.cpus, memory_mib=memMB or size.memory_mib)
        resource = _trainer_resource(job, nproc_per_node, h, size.cpus, size.memory_mib, gpu)
        _check_pod_names(job.name, nnodes)
        _check_container_args(etcd, db, db_secret, workdir_pvc, workdir, grace_period_s)
        pods = Pods(
            spec_text=Path(spec).read_text(),
            volumes=PodVolumes(workdir_pvc, workdir, _pod_mounts(mounts)),
            grace_period_s=grace_period_s,
            db_secret=db_secret,
            rdzv_secret=rdzv_secret,
            trainer_overlay=_user_overlay(trainer_overlay) if trainer_overlay else None,
            trainer_size=None if h else size,  # a named resource is the user's to size
            etcd_client_secrets=etcd_client_secrets,
            # one per launch: the trainers' etcd user can write this job's keys only
            etcd_trainer_password=secrets.token_hex(32) if etcd_client_secrets else "",
        )
        retries = K8S_RETRIES if max_retries < 0 else max_retries
        metrics_port = METRICS_PORT if metrics_port < 0 else metrics_port
    else:
        if not etcd:  # the controller serves etcd, on a port both roles know before they start
            embedded_port = etcd_port or free_port()
            etcd = f"127.0.0.1:{embedded_port}"
        role_mounts = specs.parse_mounts(mounts) if mounts else []
        resource = _trainer_resource(job, nproc_per_node, h, cpu, memMB, gpu)
        retries = max(0, max_retries)
        metrics_port = max(0, metrics_port)  # off unless asked: jobs on one machine share ports
        if metrics_port and metrics_port == embedded_port:
            raise ComponentArgError(
                f"metrics_port={metrics_port} is the embedded etcd's port (etcd_port)"
            )
    opts = TrainOptions(
        name=job.name,
        spec=spec,
        job_id=job_id or macros.app_id,
        workdir=workdir,
        db=db,
        etcd=etcd,
        embedded_etcd_port=embedded_port,
        nnodes=nnodes,
        min_nodes=min_nodes(job, nnodes),
        nproc_per_node=nproc_per_node,
        join_timeout=join_timeout,
        image=image or os.getcwd(),  # local_cwd runs a role in its image's directory
        controller_image=controller_image or image or os.getcwd(),
        python=python or ("python" if pods else sys.executable),
        trainer_resource=resource,
        env={"COLUMNS": "120", **(env or {})},
        mounts=role_mounts,
        max_retries=retries,
        metrics_port=metrics_port,
        pods=pods,
    )
    return specs.AppDef(name=opts.name, roles=[controller_role(opts), trainer_role(opts)])


@dataclass(frozen=True)
class Pods:
    """What container mode adds to the roles: the spec's text (the submitting machine's files are
    not in the pods), the pods' volumes, their grace period, the store's Secret and the user's
    trainer pod overlay."""

    spec_text: str
    volumes: PodVolumes
    grace_period_s: int
    db_secret: str
    rdzv_secret: str  # the trainers' (orchestrator/rendezvous.py, "Trust")
    trainer_overlay: dict[str, Any] | None
    trainer_size: sizing.PodSize | None  # requests = limits (None: a named resource's)
    etcd_client_secrets: str  # "<this>-controller", "<this>-trainer" ("": no TLS, no auth)
    etcd_trainer_password: str  # the trainers' etcd user's, made for this launch

    def etcd_cert_secret(self, role: str) -> str | None:
        return f"{self.etcd_client_secrets}-{role}" if self.etcd_client_secrets else None


@dataclass(frozen=True)
class TrainOptions:
    """`train`'s arguments, checked, with every default resolved for where the job runs: all that
    `controller_role` and `trainer_role` read."""

    name: str  # the AppDef's: the job spec's name
    spec: str  # the spec file (locally the controller reads it; pods get `Pods.spec_text`)
    job_id: str
    workdir: str
    db: str  # an external store's URL (locally; pods read theirs from `Pods.db_secret`)
    etcd: str  # HOST:PORT where the trainers find etcd
    embedded_etcd_port: int | None  # the controller serves etcd there (None: an external one)
    nnodes: int
    min_nodes: int
    nproc_per_node: int
    join_timeout: float
    image: str  # the container image, or the current directory (local_cwd runs a role there)
    controller_image: str  # the controller's (container mode; else the same as `image`)
    python: str
    trainer_resource: specs.Resource
    env: dict[str, str]  # both roles'
    mounts: list[specs.BindMount | specs.VolumeMount | specs.DeviceMount]  # locally; pods: `Pods`
    max_retries: int
    metrics_port: int  # the controller's Prometheus metrics (0: none)
    pods: Pods | None  # container mode; None locally


def controller_role(opts: TrainOptions) -> specs.Role:
    """`pipetransformer controller`: one replica (a failed one is restarted alone in pods)."""
    pods = opts.pods
    etcd = (
        ["--etcd", opts.etcd]
        if opts.embedded_etcd_port is None
        else ["--etcd-port", str(opts.embedded_etcd_port)]
    )
    args = [
        "controller",
        # no spec path in pods: it reads the spec's text from $PIPETRANSFORMER_SPEC
        *([] if pods else [opts.spec]),
        "--workdir",
        opts.workdir,
        "--job-id",
        opts.job_id,
        *(["--db", opts.db] if opts.db else []),
        *etcd,
        "--join-timeout",
        str(opts.join_timeout),
        # a controller restarted within this launch after the job ended exits at once; unclean
        # restarts past the budget fail the job (orchestrator/restarts.py)
        "--launch-id",
        macros.app_id,
        "--restart-budget",
        str(opts.max_retries),
        *(["--metrics-port", str(opts.metrics_port)] if opts.metrics_port else []),
    ]
    env = dict(opts.env)
    size = sizing.controller_size()
    if pods:
        env[SPEC_ENV] = pods.spec_text
        if pods.etcd_client_secrets:  # TLS with its certificate; it creates the trainers' user
            env.update(etcd_client_env())
            env[etcd_auth.TRAINER_PASSWORD_ENV] = pods.etcd_trainer_password
    resource = specs.resource(cpu=size.cpus, gpu=0, memMB=size.memory_mib)
    role = _role(
        opts,
        CONTROLLER_ROLE,
        args,
        1,
        resource,
        env,
        policies=CONTROLLER_POLICIES,
        image=opts.controller_image,
    )
    if opts.metrics_port:  # a container port named `metrics` in the pod (unused locally)
        role.port_map = {METRICS_PORT_NAME: opts.metrics_port}
    if pods:
        overlay = pod_overlay(
            opts.controller_image,
            pods.grace_period_s,
            pods.volumes,
            [pods.db_secret] if pods.db_secret else [],
            annotations=metrics_annotations(opts.metrics_port) if opts.metrics_port else None,
            resources=size.resources(),
            etcd_cert_secret=pods.etcd_cert_secret(CONTROLLER_ROLE),
        )
        set_overlay(role, "kubernetes", "V1Pod", overlay)
    return role


def trainer_role(opts: TrainOptions) -> specs.Role:
    """`pipetransformer workers`: `nnodes` replicas, each a torchrun agent with `nproc_per_node`
    workers, elastic down to `min_nodes`."""
    pods = opts.pods
    args = [
        "workers",
        "--job-id",
        opts.job_id,
        "--etcd",
        opts.etcd,
        "--nproc-per-node",
        str(opts.nproc_per_node),
        "--nnodes",
        # MIN:MAX: torchrun is elastic
        f"{opts.min_nodes}:{opts.nnodes}" if opts.min_nodes < opts.nnodes else str(opts.nnodes),
        "--join-timeout",
        str(opts.join_timeout),
    ]
    env = dict(opts.env)
    size = pods.trainer_size if pods else None
    if pods:
        env[ACTIVATION_CACHE_ENV] = CACHE_DIR
        if size and size.cache_mib:  # the files stay inside the cache volume's size limit
            env[ACTIVATION_CACHE_BYTES_ENV] = str(size.cache_mib * sizing.MIB)
        if pods.etcd_client_secrets:  # TLS with its certificate, signed in as the job's user
            env.update(etcd_client_env())
            env[USER_ENV] = etcd_auth.trainer_user(opts.job_id)  # torchx fills in ${app_id}
            env[PASSWORD_ENV] = pods.etcd_trainer_password
    else:  # one secret per launch, shared by its agents (pods read theirs from a Secret)
        env[RDZV_SECRET_ENV] = secrets.token_hex(32)
    # in pods the first min_nodes are required to start; a lost pod is replaced and rejoins
    min_replicas = opts.min_nodes if pods else None
    role = _role(
        opts,
        TRAINER_ROLE,
        args,
        opts.nnodes,
        opts.trainer_resource,
        env,
        min_replicas,
        policies=TRAINER_POLICIES,
    )
    if pods:
        rdzv = [pods.rdzv_secret] if pods.rdzv_secret else []
        overlay = pod_overlay(
            opts.image,
            pods.grace_period_s,
            pods.volumes,
            rdzv,
            cache=True,
            resources=size.resources(opts.trainer_resource.gpu) if size else None,
            cache_mib=size.cache_mib if size else None,
            etcd_cert_secret=pods.etcd_cert_secret(TRAINER_ROLE),
        )
        set_overlay(role, "kubernetes", "V1Pod", overlay)
        if pods.trainer_overlay:  # the user's, merged after ours (lists append, mappings merge)
            set_overlay(role, "kubernetes", "V1Pod", pods.trainer_overlay)
    return role


def _role(
    opts: TrainOptions,
    name: str,
    args: list[str],
    replicas: int,
    resource: specs.Resource,
    env: dict[str, str],
    min_replicas: int | None = None,
    policies: list[dict[str, Any]] | None = None,
    image: str | None = None,
) -> specs.Role:
    """What both roles share: the CLI of the image's (or this) Python, mounts and retries; in
    pods a failed replica is replaced alone (never RestartJob: the rest keeps training), as the
    role's Volcano `policies` say (orchestrator/volcano.py)."""
    return specs.Role(
        name=name,
        image=image or opts.image,
        entrypoint=opts.python,
        args=["-P", "-m", "pipetransformer.orchestrator.cli", *args],  # -P: the cwd shadows nothing
        num_replicas=replicas,
        min_replicas=min_replicas,
        resource=resource,
        env=env,
        mounts=list(opts.mounts),
        max_retries=opts.max_retries,
        retry_policy=RetryPolicy.REPLICA if opts.pods else RetryPolicy.APPLICATION,
        metadata=volcano.role_metadata(policies) if opts.pods and policies else {},
    )


def _load(spec: str) -> JobSpec:
    try:
        return load_spec(spec)  # a bad spec fails here, before anything starts
    except SpecError as exc:
        raise ComponentSpecError(exc.problems, exc.source) from None


def _check_shape(job: JobSpec, spec: str, nnodes: int, nproc_per_node: int) -> int:
    """The workers per trainer replica: `nproc_per_node`, or (0) the spec's workers shared
    evenly by the `nnodes` replicas; refused unless nnodes x it is the spec's world size."""
    p = job.parallel
    if nnodes >= 1 and nproc_per_node == 0:
        if p.world_size % nnodes:
            raise ComponentArgError(
                f"nnodes={nnodes} cannot share the {p.world_size} workers of {spec} "
                f"(parallel.stages x parallel.replicas = {p.stages} x {p.replicas}) evenly; "
                "choose nnodes that divides it"
            )
        nproc_per_node = p.world_size // nnodes
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
    return nproc_per_node


# torchx names the Volcano job `<name>-<random id>` (torchx.schedulers.ids.random_id: at most 14
# characters for a 64-bit value) and Volcano a pod `<job>-<role>-<replica>-<index>`; a pod's
# name is also its host name, a DNS label of at most 63 characters.
TORCHX_ID_MAX_CHARS = 14
POD_NAME_MAX_CHARS = 63


def _check_pod_names(name: str, nnodes: int) -> None:
    """Refuse, at submission, a spec name that makes a pod name Kubernetes rejects (the
    submission would fail at the API server, or worse, part way through)."""
    names = [
        f"{name}-{'x' * TORCHX_ID_MAX_CHARS}-{role}-{replicas - 1}-0"
        for role, replicas in ((CONTROLLER_ROLE, 1), (TRAINER_ROLE, nnodes))
    ]
    longest = max(names, key=len)
    if len(longest) > POD_NAME_MAX_CHARS:
        room = POD_NAME_MAX_CHARS - (len(longest) - len(name))
        raise ComponentArgError(
            f"the spec's name {name!r} ({len(name)} characters) is too long for Kubernetes: "
            f"pods are named '<name>-<torchx id, up to {TORCHX_ID_MAX_CHARS}>-<role>-<replica>-0' "
            f"(the longest here {len(longest)} characters, the limit {POD_NAME_MAX_CHARS}); "
            f"give the spec a name of at most {room} characters"
        )


def min_nodes(job: JobSpec, nnodes: int) -> int:
    """The fewest trainer nodes the job keeps training on: the spec's runtime.min_nodes, within
    1..nnodes (a spec without it is not elastic: every node is required)."""
    return max(1, min(job.runtime.min_nodes or nnodes, nnodes))


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


def trainer_pod_size(job: JobSpec, nproc_per_node: int, gpus: int) -> sizing.PodSize:
    """A trainer pod's requests (= limits), from the spec (orchestrator/sizing.py)."""
    return sizing.trainer_size(job, nproc_per_node, gpus)


def _trainer_resource(
    job: JobSpec,
    nproc_per_node: int,
    h: str | None,
    cpu: int,
    memMB: int,
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
        memMB=memMB or TRAINER_MEM_MB_PER_PROC * nproc_per_node,
        h=h,
    )


def _loopback(host_port: str) -> bool:
    host = host_port.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _check_container_args(
    etcd: str, db: str, db_secret: str, workdir_pvc: str, workdir: str, grace_period_s: int
) -> None:
    """Refuse what cannot work in a cluster: every address a Service, every secret a Secret,
    state on volumes."""
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


def _pod_mounts(mounts: list[str] | None) -> list[specs.BindMount | specs.VolumeMount]:
    """The user's mounts as pod volumes can hold them: PVCs and host paths."""
    parsed = specs.parse_mounts(mounts) if mounts else []
    for m in parsed:
        if isinstance(m, specs.DeviceMount):
            raise ComponentArgError(f"mounts: device mounts are not supported here ({m})")
    return parsed  # type: ignore[return-value]


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
