"""Which device a worker computes on, what it reads off that device (peak memory), and how to wait
for the work queued on it (`synchronize`, for timers).

A worker is process `LOCAL_RANK` of `LOCAL_WORLD_SIZE` on its node (torchrun sets both). With
`runtime.device: cuda` it computes on `cuda:LOCAL_RANK`, which must exist; with `auto` the node
computes on CUDA only when it has a GPU for each of its workers, so a laptop with one GPU runs
the 2-worker examples on the CPU instead of failing. The choice is made before any process
group exists (`torch.cuda.set_device` must precede NCCL's first communicator).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from pipetransformer.core.spec import JobSpec, gpu_shortfall, local_device_type

log = logging.getLogger("pipetransformer.worker")


class DeviceError(RuntimeError):
    """The spec asks for a device this node does not have."""


def resolve_device(
    setting: str, local_rank: int, workers_per_node: int, gpus: int | None = None
) -> torch.device:
    """The device of worker `local_rank` of a node's `workers_per_node` under `runtime.device`
    (`auto` | `cpu` | `cuda`); raises DeviceError when `cuda` cannot be honoured."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if local_device_type(setting, workers_per_node, gpus) == "cpu":
        if setting == "auto" and gpus:
            log.warning(
                "runtime.device auto: %d worker(s) on this node but %d GPU(s); computing on "
                "the CPU (set runtime.device: cuda to make this an error)",
                workers_per_node,
                gpus,
            )
        return torch.device("cpu")
    if problem := gpu_shortfall(setting, workers_per_node, gpus):
        raise DeviceError(problem)
    if local_rank >= gpus:
        raise DeviceError(f"worker LOCAL_RANK={local_rank} has no GPU: the node has {gpus}")
    return torch.device("cuda", local_rank)


def local_placement() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) of this process; (0, 1) outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def worker_device(spec: JobSpec) -> torch.device:
    """This worker's device, made current (CUDA: before any process group is created)."""
    local_rank, per_node = local_placement()
    device = resolve_device(spec.runtime.device, local_rank, per_node)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # a failed or timed-out NCCL collective ends the process (its agent re-forms the job)
        # instead of leaving it hung; read when the NCCL groups are created
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    return device


@dataclass(frozen=True)
class Compute:
    """How a rank computes: its device, the blocks' precision, whether blocks are compiled."""

    device: torch.device = torch.device("cpu")
    precision: str = "fp32"
    compile: bool = False

    @classmethod
    def for_spec(cls, spec: JobSpec, device: torch.device | None = None) -> Compute:
        return cls(
            device=device or torch.device("cpu"),
            precision=spec.training.precision,
            compile=spec.parallel.compile,
        )

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        """The training groups' backend: NCCL between GPUs, gloo between CPU processes."""
        return "nccl" if self.cuda else "gloo"

    def name(self) -> str:
        """The device's name (`NVIDIA H100 80GB HBM3`), "cpu" for the CPU."""
        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu"


def peak_memory_mib(device: torch.device) -> float | None:
    """Peak memory allocated by this process on a CUDA device since the last reset (MiB); None on
    the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def synchronize(dev: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs kernels asynchronously), so a timer read
    afterwards covers it; a no-op on the CPU."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
