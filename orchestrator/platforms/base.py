"""What every platform shares (orchestrator/platforms/): `train`'s arguments as given
(`TrainArgs`) and what `train` read or made for them at its edge (`TrainInputs`); the interface
a platform implements (`Platform`: resolve its options from those, decorate the two roles) and
the options it resolves (`TrainOptions`); the checks and defaults every platform applies alike
(the job's shape, the metrics port, the trainers' GPUs and resources). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torchx.specs as specs
from torchx.specs import macros
from torchx.specs.finder import ComponentValidationException

from pipetransformer.core.spec import JobSpec, SpecError

CONTROLLER_ROLE = "controller"
TRAINER_ROLE = "trainer"
TRAINER_MEM_MB_PER_PROC = 1024  # locally (pods: orchestrator/sizing.py)


class ComponentArgError(ComponentValidationException, ValueError):
    """Component arguments that cannot make a valid job (torchx prints it without a traceback)."""


class ComponentSpecError(ComponentValidationException, SpecError):
    """The job spec failed validation; same fields and message as the SpecError it wraps."""


@dataclass(frozen=True)
class TrainArgs:
    """`train`'s arguments as given, with its defaults (orchestrator/components.py documents
    each; tests/test_torchx.py keeps the two alike)."""

    spec: str
    workdir: str = "./runs"
    job_id: str = ""
    db: str = ""
    etcd: str = ""
    etcd_port: int = 0
    nnodes: int = 1
    nproc_per_node: int = 0
    join_timeout: float = 300.0
    image: str = ""
    controller_image: str = ""
    python: str = ""
    h: str | None = None
    cpu: int = 0
    memMB: int = 0
    gpu: int = -1
    env: dict[str, str] | None = None
    mounts: list[str] | None = None
    max_retries: int = -1
    db_secret: str = "pipetransformer-db"
    rdzv_secret: str = "pipetransformer-rdzv"
    etcd_client_secrets: str = "etcd-client"
    etcd_trainer_secret: str = ""
    workdir_pvc: str = "pipetransformer-workdir"
    grace_period_s: int = 120
    trainer_overlay: str = ""
    metrics_port: int = -1
    shm_mib: int = 0


@dataclass(frozen=True)
class TrainInputs:
    """All that the translation into an AppDef reads (orchestrator/appdef.py): `train`'s
    arguments, and what `train` read or made for them at its edge (`components.gather`), so
    that the translation itself does no I/O."""

    args: TrainArgs
    job: JobSpec  # the spec file, read and validated
    spec_text: str  # its text (container mode carries it inline: the pods have none of our files)
    trainer_overlay: Any  # container mode: the YAML loaded from `args.trainer_overlay` (or None)
    free_port: int  # free when `train` ran, for an embedded etcd without etcd_port (0: not needed)
    launch_secret: str  # made for this launch: the local trainers' rendezvous secret
    cwd: str  # the current directory, where local_cwd runs the roles
    python: str  # the interpreter that ran `train`

    @property
    def platform(self) -> str:
        """Where the roles run: container mode (`--image`) on Kubernetes, else here."""
        return "kubernetes" if self.args.image else "local"


@dataclass(frozen=True)
class TrainOptions:
    """What a platform resolved from `TrainInputs`, every default decided for where the job
    runs: all that the role builders read, and the platform that decorates the roles."""

    name: str  # the AppDef's: the job spec's name
    spec: str | None  # the spec file the controller reads (None: its text, `SPEC_ENV`)
    job_id: str
    workdir: str
    db: str  # an external store's URL (locally; pods read theirs from a Secret)
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
    mounts: list[specs.BindMount | specs.VolumeMount | specs.DeviceMount]  # locally; pods' differ
    max_retries: int
    metrics_port: int  # the controller's Prometheus metrics (0: none)
    platform: Platform  # what only this platform adds to the roles


class Platform(Protocol):
    """Where a job's roles run: one module each in orchestrator/platforms/, registered in
    `PLATFORMS`. `resolve` (a class method) makes one launch's options, whose `platform` is an
    instance holding what only this platform needs; that instance decorates the two roles that
    orchestrator/appdef.py builds alike for every platform. Both pure."""

    @classmethod
    def resolve(cls, inputs: TrainInputs) -> TrainOptions:
        """`inputs` checked, with every default resolved for this platform."""
        ...

    def controller(self, role: specs.Role, opts: TrainOptions) -> specs.Role:
        """The controller role as this platform runs it."""
        ...

    def trainer(self, role: specs.Role, opts: TrainOptions) -> specs.Role:
        """The trainer role as this platform runs it."""
        ...


def options(inputs: TrainInputs, nproc_per_node: int, **resolved: Any) -> TrainOptions:
    """The options every platform resolves alike (the spec's name, the job id, the shape, the
    roles' environment), with the platform's own `resolved` ones."""
    args, job = inputs.args, inputs.job
    return TrainOptions(
        name=job.name,
        job_id=args.job_id or macros.app_id,
        nnodes=args.nnodes,
        min_nodes=min_nodes(job, args.nnodes),
        nproc_per_node=nproc_per_node,
        join_timeout=args.join_timeout,
        env={"COLUMNS": "120", **(args.env or {})},
        **resolved,
    )


def checked_shape(inputs: TrainInputs) -> int:
    """The workers per trainer replica, after what every platform refuses alike: a shape that
    is not the spec's world size, a metrics port out of range."""
    args = inputs.args
    nproc_per_node = _check_shape(inputs.job, args.spec, args.nnodes, args.nproc_per_node)
    if not -1 <= args.metrics_port <= 65535:
        raise ComponentArgError(
            f"metrics_port={args.metrics_port}: give a port (1-65535), 0 to serve no metrics, "
            "or leave it unset"
        )
    return nproc_per_node


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


def trainer_resource(
    job: JobSpec,
    nproc_per_node: int,
    h: str | None,
    cpu: int,
    memMB: int,
    gpu: int = -1,
) -> specs.Resource:
    """A trainer replica's resource: `cpu` and `memMB` where given (else the spec's threads and
    a local per-worker allowance), its GPUs (`trainer_gpus`: at least one per worker on CUDA),
    or the named resource `h`."""
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
