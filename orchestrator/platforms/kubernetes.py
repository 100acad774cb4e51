"""Container mode on Kubernetes with Volcano (`--image` given): the roles run `python` from the
image, find etcd and the store through Services (the database URL comes from a Secret, never an
argument; so does the trainers' etcd password, never a value in the Job), share the checkpoint
volume (a ReadWriteMany PVC mounted at --workdir), keep AutoCache files on a node-local emptyDir,
and carry the spec inline (the submitting machine's files are not in the pods). Each pod is
sized from the spec (orchestrator/sizing.py, requests = limits; /dev/shm limited), gets what
torchx's pod lacks from a pod overlay (orchestrator/pods.py: a read-only root file system among
it) and its role's lifecycle policies (orchestrator/volcano.py): a failed replica is replaced
alone, never the whole job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torchx.specs as specs
from torchx.specs import RetryPolicy, macros
from torchx.specs.overlays import JOIN, set_overlay

from pipetransformer.core.keys import ACTIVATION_CACHE_BYTES_ENV, ACTIVATION_CACHE_ENV, SPEC_ENV
from pipetransformer.edge.etcd_client import PASSWORD_ENV, USER_ENV
from pipetransformer.orchestrator import etcd_auth, sizing, volcano
from pipetransformer.orchestrator.platforms.base import (
    CONTROLLER_ROLE,
    TRAINER_ROLE,
    ComponentArgError,
    TrainArgs,
    TrainInputs,
    TrainOptions,
    checked_shape,
    options,
    trainer_gpus,
    trainer_resource,
)
from pipetransformer.orchestrator.pods import (
    CACHE_DIR,
    ETCD_CERT_DIR,
    METRICS_PORT_NAME,
    SCRATCH_DIRS,
    PodVolumes,
    etcd_client_env,
    metrics_annotations,
    metrics_readiness_probe,
    pod_overlay,
)

POD_WORKDIR = "/workdir"  # where the checkpoint volume is mounted in every pod
K8S_RETRIES = 3
# the controller pod's Prometheus metrics port (container mode's default for --metrics_port);
# `pipetransformer controller --metrics-port N` serves them
METRICS_PORT = 9400
# what Volcano does when a role's pod ends (orchestrator/volcano.py)
CONTROLLER_POLICIES = volcano.controller_policies()
TRAINER_POLICIES = volcano.trainer_policies()
# torchx names the Volcano job `<name>-<random id>` (torchx.schedulers.ids.random_id: at most 14
# characters for a 64-bit value) and Volcano a pod `<job>-<role>-<replica>-<index>`; a pod's
# name is also its host name, a DNS label of at most 63 characters.
TORCHX_ID_MAX_CHARS = 14
POD_NAME_MAX_CHARS = 63
# the trainers' etcd password when --etcd_trainer_secret is not given: a Secret made for each
# launch, named after it (orchestrator/volcano.py `launch_secrets`), deleted with its Volcano Job
LAUNCH_TRAINER_SECRET = f"{macros.app_id}-etcd-trainer"
TRAINER_SECRET_KEY = "password"  # the key of the password in that Secret, or the user's


@dataclass(frozen=True)
class Kubernetes:
    """What container mode adds to the roles: the spec's text (the submitting machine's files are
    not in the pods), the pods' volumes, their grace period, the store's Secret and the user's
    trainer pod overlay."""

    spec_text: str
    volumes: PodVolumes
    grace_period_s: int
    db_secret: str
    rdzv_secret: str  # the trainers' (orchestrator/rendezvous, "Trust")
    trainer_overlay: dict[str, Any] | None
    trainer_size: sizing.PodSize | None  # requests = limits (None: a named resource's)
    trainer_shm_mib: int  # the trainers' /dev/shm size limit
    etcd_client_secrets: str  # "<this>-controller", "<this>-trainer" ("": no TLS, no auth)
    etcd_trainer_secret: str  # the Secret holding the trainers' etcd password (key `password`)

    @classmethod
    def resolve(cls, inputs: TrainInputs) -> TrainOptions:
        args, job = inputs.args, inputs.job
        nproc_per_node = checked_shape(inputs)
        # the default workdir (./runs, the local one) is the checkpoint volume's mount here
        workdir = POD_WORKDIR if args.workdir == TrainArgs.workdir else args.workdir
        size = sizing.trainer_size(job, nproc_per_node, trainer_gpus(job, nproc_per_node, args.gpu))
        size = replace(size, cpus=args.cpu or size.cpus, memory_mib=args.memMB or size.memory_mib)
        resource = trainer_resource(
            job, nproc_per_node, args.h, size.cpus, size.memory_mib, args.gpu
        )
        check_pod_names(job.name, args.nnodes)
        check_container_args(args, workdir)
        extra = pod_mounts(args.mounts)
        check_mount_paths(extra, workdir)
        pods = cls(
            spec_text=inputs.spec_text,
            volumes=PodVolumes(args.workdir_pvc, workdir, extra),
            grace_period_s=args.grace_period_s,
            db_secret=args.db_secret,
            rdzv_secret=args.rdzv_secret,
            trainer_overlay=(
                user_overlay(args.trainer_overlay, inputs.trainer_overlay)
                if args.trainer_overlay
                else None
            ),
            trainer_size=None if args.h else size,  # a named resource is the user's to size
            trainer_shm_mib=shm_mib(args.shm_mib, int(resource.memMB)),
            etcd_client_secrets=args.etcd_client_secrets,
            # by default one per launch: the trainers' etcd user can write this job's keys
            # only, and no other job's trainers know its password (orchestrator/etcd_auth.py)
            etcd_trainer_secret=args.etcd_trainer_secret or LAUNCH_TRAINER_SECRET,
        )
        return options(
            inputs,
            nproc_per_node,
            spec=None,  # the controller reads the spec's text from $PIPETRANSFORMER_SPEC
            workdir=workdir,
            db=args.db,  # none: refused above (the URL comes from db_secret)
            etcd=args.etcd,
            embedded_etcd_port=None,
            image=args.image,
            controller_image=args.controller_image or args.image,
            python=args.python or "python",
            trainer_resource=resource,
            mounts=[],  # the user's are pod volumes (`PodVolumes.extra`)
            max_retries=K8S_RETRIES if args.max_retries < 0 else args.max_retries,
            metrics_port=METRICS_PORT if args.metrics_port < 0 else args.metrics_port,
            platform=pods,
        )

    def etcd_cert_secret(self, role: str) -> str | None:
        return f"{self.etcd_client_secrets}-{role}" if self.etcd_client_secrets else None

    def trainer_password(self, variable: str) -> dict[str, Any]:
        """Role metadata: `variable` read from the trainers' password Secret (a value in the
        role's env would be in the Job for anyone who reads it, and in `--dryrun`'s output)."""
        ref = (self.etcd_trainer_secret, TRAINER_SECRET_KEY)
        return volcano.secret_env_metadata({variable: ref})

    def controller(self, role: specs.Role, opts: TrainOptions) -> specs.Role:
        """A failed controller pod is replaced alone, as its exit status says; it is ready
        once it serves its metrics."""
        role.env[SPEC_ENV] = self.spec_text
        if self.etcd_client_secrets:  # TLS with its certificate; it creates the trainers' user
            role.env.update(etcd_client_env())
            role.metadata.update(self.trainer_password(etcd_auth.TRAINER_PASSWORD_ENV))
        _replaced_alone(role, CONTROLLER_POLICIES)
        overlay = pod_overlay(
            opts.controller_image,
            self.grace_period_s,
            self.volumes,
            [self.db_secret] if self.db_secret else [],
            annotations=metrics_annotations(opts.metrics_port) if opts.metrics_port else None,
            resources=sizing.controller_size().resources(),
            etcd_cert_secret=self.etcd_cert_secret(CONTROLLER_ROLE),
            shm_mib=sizing.CONTROLLER_SHM_MIB,
            readiness_probe=metrics_readiness_probe(METRICS_PORT_NAME)
            if opts.metrics_port
            else None,
        )
        set_overlay(role, "kubernetes", "V1Pod", overlay)
        return role

    def trainer(self, role: specs.Role, opts: TrainOptions) -> specs.Role:
        """The first `min_nodes` trainer pods are required to start; a lost one is replaced
        and rejoins."""
        size = self.trainer_size
        role.env[ACTIVATION_CACHE_ENV] = CACHE_DIR
        if size and size.cache_mib:  # the files stay inside the cache volume's size limit
            role.env[ACTIVATION_CACHE_BYTES_ENV] = str(size.cache_mib * sizing.MIB)
        if self.etcd_client_secrets:  # TLS with its certificate, signed in as the job's user
            role.env.update(etcd_client_env())
            role.env[USER_ENV] = etcd_auth.trainer_user(opts.job_id)  # torchx fills in ${app_id}
            role.metadata.update(self.trainer_password(PASSWORD_ENV))
        role.min_replicas = opts.min_nodes
        _replaced_alone(role, TRAINER_POLICIES)
        overlay = pod_overlay(
            opts.image,
            self.grace_period_s,
            self.volumes,
            [self.rdzv_secret] if self.rdzv_secret else [],
            cache=True,
            resources=size.resources(opts.trainer_resource.gpu) if size else None,
            cache_mib=size.cache_mib if size else None,
            etcd_cert_secret=self.etcd_cert_secret(TRAINER_ROLE),
            shm_mib=self.trainer_shm_mib,
        )
        set_overlay(role, "kubernetes", "V1Pod", overlay)
        if self.trainer_overlay:  # the user's, merged after ours (lists append, mappings merge)
            set_overlay(role, "kubernetes", "V1Pod", self.trainer_overlay)
        return role


def _replaced_alone(role: specs.Role, policies: list[dict[str, Any]]) -> None:
    """In pods a failed replica is replaced alone (never RestartJob: the rest keeps training),
    as the role's Volcano `policies` say (orchestrator/volcano.py)."""
    role.retry_policy = RetryPolicy.REPLICA
    role.metadata.update(volcano.role_metadata(policies))


def check_pod_names(name: str, nnodes: int) -> None:
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


def _loopback(host_port: str) -> bool:
    host = host_port.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def check_container_args(args: TrainArgs, workdir: str) -> None:
    """Refuse what cannot work in a cluster: every address a Service, every secret a Secret,
    state on volumes."""
    if not args.etcd:
        raise ComponentArgError(
            "etcd: container mode needs an etcd every pod can reach, e.g. --etcd etcd:2379 (the "
            "Service from k8s/); an embedded etcd would listen on the controller pod's loopback"
        )
    if _loopback(args.etcd):
        raise ComponentArgError(
            f"etcd={args.etcd} is a loopback address, which no other pod reaches"
        )
    if args.db:
        raise ComponentArgError(
            "db: in container mode the store's URL (and its password) comes from the Secret "
            f"named by --db_secret (key PIPETRANSFORMER_DB, default {args.db_secret!r}), never "
            "from an argument"
        )
    if not args.workdir_pvc:
        raise ComponentArgError("workdir_pvc: the pods need the shared checkpoint volume")
    if not workdir.startswith("/"):
        raise ComponentArgError(f"workdir={workdir!r} must be an absolute path in the pods")
    if args.grace_period_s < 1:
        raise ComponentArgError(f"grace_period_s={args.grace_period_s} must be at least 1")
    if args.etcd_trainer_secret and not args.etcd_client_secrets:
        # without TLS and auth nobody signs in: the password would be silently unused
        raise ComponentArgError(
            f"etcd_trainer_secret={args.etcd_trainer_secret!r} is the trainers' etcd password, "
            "read only with TLS and auth: give --etcd_client_secrets too (the roles' client "
            "certificates), or leave etcd_trainer_secret unset for an etcd without auth"
        )


def shm_mib(given: int, memory_mib: int) -> int:
    """The trainers' /dev/shm size limit: `given` (0: `sizing.shm_limit_mib` of the pod's
    memory), refused past the pod's memory, which it is part of."""
    if given < 0:
        raise ComponentArgError(
            f"shm_mib={given}: give /dev/shm's size limit in MiB (at least 1), or leave it "
            "unset for half the trainer pod's memory"
        )
    if given > memory_mib:
        raise ComponentArgError(
            f"shm_mib={given} exceeds the trainer pod's memory ({memory_mib} MiB; memMB): "
            "/dev/shm is memory, counted against that limit"
        )
    return given or sizing.shm_limit_mib(memory_mib)


def check_mount_paths(mounts: list[specs.BindMount | specs.VolumeMount], workdir: str) -> None:
    """Refuse a user's mount at a path the pods mount already (Kubernetes refuses a pod with
    two volumes at one path)."""
    taken = {"/dev/shm", workdir, CACHE_DIR, ETCD_CERT_DIR, *SCRATCH_DIRS.values()}
    for m in mounts:
        if m.dst_path.rstrip("/") in taken:
            raise ComponentArgError(
                f"mounts: dst={m.dst_path} is where the pods mount a volume of their own "
                f"({', '.join(sorted(taken))}); mount it elsewhere"
            )


def pod_mounts(mounts: list[str] | None) -> list[specs.BindMount | specs.VolumeMount]:
    """The user's mounts as pod volumes can hold them: PVCs and host paths."""
    parsed = specs.parse_mounts(mounts) if mounts else []
    for m in parsed:
        if isinstance(m, specs.DeviceMount):
            raise ComponentArgError(f"mounts: device mounts are not supported here ({m})")
    return parsed  # type: ignore[return-value]


def user_overlay(path: str, loaded: Any) -> dict[str, Any]:
    """The user's trainer pod overlay, as loaded from `path`: torchx's pod overlay format, one
    top-level key `spec`."""
    if not isinstance(loaded, dict) or set(loaded) != {"spec"}:
        raise ComponentArgError(
            f"trainer_overlay={path}: expected a mapping with one key, `spec` (fields of the "
            "pod's spec, e.g. tolerations and nodeSelector)"
        )
    spec = loaded["spec"]
    if isinstance(spec, dict) and isinstance(spec.get("volumes"), list):
        # ours are merged by name (torchx's /dev/shm gets its limit): a plain list merged
        # after them would replace them all, so the user's join them by name too
        spec = {JOIN("volumes", on="name") if k == "volumes" else k: v for k, v in spec.items()}
        return {"spec": spec}
    return loaded
