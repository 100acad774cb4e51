"""`runtime`: where and how a job's processes run, and what a device setting means on a machine."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
)

from pipetransformer.core.spec.base import (
    MAX_CONTROL_EVERY,
    MAX_LEASE_TTL_S,
    MAX_NODES,
    MAX_RESTARTS,
    MAX_THREADS,
    NonNegativeInt,
    PositiveInt,
    _Strict,
)


class RuntimeSpec(_Strict):
    """How workers are launched and supervised, and how failures are ridden out.

    Workers run under torchrun agents ("nodes") that rendezvous over etcd. When a worker dies,
    hangs (its etcd lease lapses) or is told to leave (SIGTERM), the controller aborts the
    generation, the agents re-rendezvous with whoever is left (at least `min_nodes`), the
    controller plans a layout for that world and training resumes from the last committed
    checkpoint. A node that comes back joins at the next rendezvous and the job widens again."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where workers compute: 'cuda' (worker k of a node on cuda:k; NCCL for the "
        "pipeline and replica groups, gloo for control), 'cpu' (gloo), or 'auto': CUDA when "
        "the node has a GPU for each of its workers, else the CPU",
    )
    threads_per_worker: Annotated[PositiveInt, Field(le=MAX_THREADS)] = 1
    control_every_steps: Annotated[PositiveInt, Field(le=MAX_CONTROL_EVERY)] = Field(
        10,
        description="steps between reads of the etcd control key (stop); also each rank's "
        "stage-timing interval",
    )
    tensorboard: bool = Field(
        False,
        description="the controller also writes the job's figures (loss, samples/s, accuracy, "
        "layout, each rank's phases) as TensorBoard event files under the job's directory "
        "(jobs/<id>/tensorboard; needs the `tensorboard` extra)",
    )
    stage_timing: bool = Field(
        True,
        description="each rank measures where its time goes (forward, backward, waiting for a "
        "neighbour stage, gradient sync, optimizer, frozen prefix, data, checkpoints, "
        "evaluation) and reports it every control_every_steps steps: the dashboard's Pipeline "
        "view, `status`, the summary (CUDA events on GPUs; false turns it off)",
    )
    lease_ttl_s: Annotated[PositiveInt, Field(le=MAX_LEASE_TTL_S)] = Field(
        5,
        description="seconds a worker's etcd lease outlives its last refresh: a hung or "
        "partitioned worker is declared lost after at most this long",
    )
    nodes: Annotated[PositiveInt, Field(le=MAX_NODES)] = Field(
        1,
        description="torchrun agents `pipetransformer run` starts on this machine; the layout's "
        "workers are split evenly among them (2 nodes x 1 process simulate two machines)",
    )
    min_nodes: Annotated[PositiveInt, Field(le=MAX_NODES)] | None = Field(
        None,
        description="fewest nodes the job keeps training with after a node is lost (default: "
        "1); it waits for capacity below that",
    )
    max_restarts: Annotated[NonNegativeInt, Field(le=MAX_RESTARTS)] = Field(
        10,
        description="times each agent restarts its workers after a failure before the job "
        "gives up (0: the first failure interrupts the job; `resume` continues it)",
    )


def gpu_shortfall(setting: str, workers_per_node: int, gpus: int) -> str | None:
    """Why `runtime.device: <setting>` cannot give each of a node's `workers_per_node` workers
    its own GPU when the node has `gpus` (None if it can, or if the setting does not ask for
    CUDA)."""
    if setting != "cuda":
        return None
    if gpus == 0:
        return (
            "runtime.device is 'cuda' but this node has no CUDA device (or this torch is a "
            "CPU build); use 'cpu' or 'auto'"
        )
    if workers_per_node > gpus:
        return (
            f"runtime.device is 'cuda' and each node runs {workers_per_node} worker(s), one per "
            f"GPU, but this node has {gpus} GPU(s): lower parallel.stages x parallel.replicas / "
            "runtime.nodes (workers per node), raise runtime.nodes, or use 'cpu'"
        )
    return None


def local_device_type(setting: str, workers: int, gpus: int) -> str:
    """The device type, "cuda" or "cpu", that `runtime.device: <setting>` means for `workers`
    workers sharing `gpus` GPUs (a node, or every simulated node of one machine)."""
    if setting == "cuda" or (setting == "auto" and gpus and workers <= gpus):
        return "cuda"
    return "cpu"
