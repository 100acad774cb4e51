"""The local platform (torchx's `local_cwd`; no `--image`): each role is a process in the
current directory, run by this Python. Without `--etcd` the controller serves an embedded etcd
on a port both roles know before either starts (`--etcd_port`, else one `train` found free), the
user's mounts are taken as given, retries are the scheduler's (none by default), metrics are
off unless asked for (jobs on one machine would share the port), and the trainers sign their
rendezvous state with a secret made for this launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torchx.specs as specs

from pipetransformer.core.keys import RDZV_SECRET_ENV
from pipetransformer.orchestrator.platforms.base import (
    ComponentArgError,
    TrainInputs,
    TrainOptions,
    checked_shape,
    options,
    trainer_resource,
)


@dataclass(frozen=True)
class Local:
    """What a local launch adds to the roles: the trainers' rendezvous secret (one per launch,
    shared by its agents; pods read theirs from a Secret)."""

    rdzv_secret: str

    @classmethod
    def resolve(cls, inputs: TrainInputs) -> TrainOptions:
        args, job = inputs.args, inputs.job
        nproc_per_node = checked_shape(inputs)
        if args.controller_image:
            raise ComponentArgError(
                "controller_image is for container mode: give --image (the trainers') as well"
            )
        # the controller serves etcd, on a port both roles know before they start
        port = None if args.etcd else (args.etcd_port or inputs.free_port)
        resource = trainer_resource(job, nproc_per_node, args.h, args.cpu, args.memMB, args.gpu)
        metrics_port = max(
            0, args.metrics_port
        )  # off unless asked: jobs on one machine share ports
        if metrics_port and metrics_port == port:
            raise ComponentArgError(
                f"metrics_port={metrics_port} is the embedded etcd's port (etcd_port)"
            )
        return options(
            inputs,
            nproc_per_node,
            spec=args.spec,
            workdir=args.workdir,
            db=args.db,
            etcd=args.etcd or f"127.0.0.1:{port}",
            embedded_etcd_port=port,
            image=inputs.cwd,  # local_cwd runs a role in its image's directory
            controller_image=inputs.cwd,
            python=args.python or inputs.python,
            trainer_resource=resource,
            mounts=specs.parse_mounts(args.mounts) if args.mounts else [],
            max_retries=max(0, args.max_retries),
            metrics_port=metrics_port,
            platform=cls(rdzv_secret=inputs.launch_secret),
        )

    def controller(self, role: specs.Role, opts: TrainOptions) -> specs.Role:
        return role  # the spec file and the embedded etcd are in its arguments already

    def trainer(self, role: specs.Role, opts: TrainOptions) -> specs.Role:
        role.env[RDZV_SECRET_ENV] = self.rdzv_secret
        return role
