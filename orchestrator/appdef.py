"""The torchx component's translation: `TrainInputs` (`train`'s arguments and what it read or
made at its edge) -> `AppDef`, pure: no file, socket, secret or current directory is read here,
so the same inputs give the same AppDef (tests call it with literal inputs).

The platform the inputs name (orchestrator/platforms/: `local`, or `kubernetes` in container
mode) resolves the options; `controller_role` and `trainer_role` build each role alike for every
platform, then hand it to the platform to decorate.
"""

from __future__ import annotations

import torchx.specs as specs
from torchx.specs import macros

from pipetransformer.orchestrator import sizing
from pipetransformer.orchestrator.platforms import PLATFORMS
from pipetransformer.orchestrator.platforms.base import (
    CONTROLLER_ROLE,
    TRAINER_ROLE,
    TrainInputs,
    TrainOptions,
)
from pipetransformer.orchestrator.pods import METRICS_PORT_NAME  # the container port's name


def app_def(inputs: TrainInputs) -> specs.AppDef:
    """The job as torchx runs it: one controller role and `nnodes` trainer roles."""
    opts = PLATFORMS[inputs.platform].resolve(inputs)
    return specs.AppDef(name=opts.name, roles=[controller_role(opts), trainer_role(opts)])


def controller_role(opts: TrainOptions) -> specs.Role:
    """`pipetransformer controller`: one replica."""
    etcd = (
        ["--etcd", opts.etcd]
        if opts.embedded_etcd_port is None
        else ["--etcd-port", str(opts.embedded_etcd_port)]
    )
    args = [
        "controller",
        # no spec path in pods: it reads the spec's text from $PIPETRANSFORMER_SPEC
        *([opts.spec] if opts.spec else []),
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
    size = sizing.controller_size()
    resource = specs.resource(cpu=size.cpus, gpu=0, memMB=size.memory_mib)
    role = _role(opts, CONTROLLER_ROLE, args, 1, resource, image=opts.controller_image)
    if opts.metrics_port:  # a container port named `metrics` in the pod (unused locally)
        role.port_map = {METRICS_PORT_NAME: opts.metrics_port}
    return opts.platform.controller(role, opts)


def trainer_role(opts: TrainOptions) -> specs.Role:
    """`pipetransformer workers`: `nnodes` replicas, each a torchrun agent with `nproc_per_node`
    workers, elastic down to `min_nodes`."""
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
    role = _role(opts, TRAINER_ROLE, args, opts.nnodes, opts.trainer_resource, image=opts.image)
    return opts.platform.trainer(role, opts)


def _role(
    opts: TrainOptions,
    name: str,
    args: list[str],
    replicas: int,
    resource: specs.Resource,
    image: str,
) -> specs.Role:
    """What both roles share on every platform: the CLI of the image's (or this) Python, the
    roles' environment, mounts and retries."""
    return specs.Role(
        name=name,
        image=image,
        entrypoint=opts.python,
        args=["-P", "-m", "pipetransformer.orchestrator.cli", *args],  # -P: the cwd shadows nothing
        num_replicas=replicas,
        resource=resource,
        env=dict(opts.env),
        mounts=list(opts.mounts),
        max_retries=opts.max_retries,
    )
