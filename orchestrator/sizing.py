"""What each pod of a job asks Kubernetes for, from the job's spec: CPU, memory, ephemeral
storage and the AutoCache volume's size. Pure: the torchx component's Kubernetes platform
(orchestrator/platforms/kubernetes.py) writes the figures into the pods as requests equal to
limits (Guaranteed QoS: the last pods the kubelet evicts under node pressure, and CPUs the static
CPU manager may pin).

Host memory of a trainer pod, measured with bench/trainer_memory.py (peak PSS by process, so
shared pages count once; bench/results/issue25-h200/):

    process                 CPU job (vit-digits)    GPU job (H200; ViT 14 M / ViT-B/16 86.6 M)
    torchrun agent          187 MiB                 380 MiB
    fork server             275 MiB                 540 MiB
    a worker                ~230 MiB + its state    1,665 MiB / 2,725 MiB (CUDA context, NCCL,
                            (admission's estimate)  the model built on the host, pinned buffers)
    torch.compile's pool    -                       ~490 MiB (compiled blocks only)

so a GPU worker costs about 1.45 GiB plus ~15 bytes per parameter of host memory (the model is
built and loaded on the host before it moves to the device); `GPU_WORKER_BASE_MIB` and
`GPU_HOST_BYTES_PER_PARAM` round those up. A CPU worker's training state lives in host memory:
admission's per-worker estimate (orchestrator/admission.py) covers it. /dev/shm is a
memory-backed volume and counts against the pod's limit: NCCL's shared-memory transport between
GPUs of one pod and the data loaders' batches get an allowance. `HEADROOM` covers what one run
does not show (allocator fragmentation, a longer run's caches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipetransformer.core.spec import JobSpec
from pipetransformer.orchestrator import admission

MIB = 1 << 20
GIB = 1 << 30

NODE_MIB = {"cpu": 512, "cuda": 1024}  # torchrun's agent and the fork server, measured above
COMPILE_POOL_MIB = 512  # torch.compile's worker processes (parallel.compile on a GPU)
GPU_WORKER_BASE_MIB = 1536  # a CUDA worker before its model: context, NCCL, torch's libraries
GPU_HOST_BYTES_PER_PARAM = 16  # the model on the host while it is built or loaded (measured ~15)
# a CPU worker measured ~100 MiB above admission's estimate (its 128 MiB for the process is
# what a worker forked from the fork server adds; torch's own pages it dirties come on top)
CPU_WORKER_EXTRA_MIB = 128
NCCL_SHM_MIB = 256  # per pod with more than one GPU: NCCL's shared-memory transport
LOADER_SHM_MIB = 64  # per data-loader process: the batches it hands over through /dev/shm
HEADROOM = 1.25
ROUND_MIB = 256

# a trainer's CPUs: each worker's compute threads, and on a GPU two more per worker (the Python
# thread that launches kernels, NCCL's proxy thread); one for the agent and the fork server
GPU_EXTRA_CPUS_PER_WORKER = 2
NODE_CPUS = 1

CONTROLLER_CPUS = 1
CONTROLLER_MIB = 1024  # measured 280 (CPU machine) to 580 MiB (a GPU machine's torch)
CONTROLLER_SHM_MIB = 64  # no data loaders, no NCCL: Docker's default /dev/shm is plenty

# /dev/shm's default size limit in a trainer pod: this share of the pod's memory. It is memory
# counted against the pod's limit, which the sizing above grants NCCL's and the loaders' shares
# of; half leaves room for batches larger than those allowances, while a runaway writer (leaked
# loader batches) gets "No space left on device" instead of the pod's OOM kill.
SHM_SHARE = 0.5

# ephemeral storage besides the cache: logs, /tmp (torch.compile's and triton's caches)
SCRATCH_MIB = 2048
# AutoCache keeps at most two boundaries' files at once: the one in use and the one it is
# building from (trainer/cache/); each holds a float32 row per training sample
CACHE_LEVELS = 2
CACHE_UNKNOWN_MIB = 20 * 1024  # data read from files: the size is unknown before the workers run
CACHE_MIN_MIB = 1024  # the volume's least size limit (a job without AutoCache keeps it empty)


@dataclass(frozen=True)
class PodSize:
    """One pod's requests (= limits): whole CPUs, memory and ephemeral storage in MiB; the
    AutoCache volume's size limit in MiB (None: the pod has no cache volume)."""

    cpus: int
    memory_mib: int
    ephemeral_mib: int
    cache_mib: int | None = None

    def resources(self, gpus: int = 0) -> dict[str, dict[str, str]]:
        """Kubernetes container resources with requests equal to limits (Guaranteed QoS)."""
        amounts = {
            "cpu": str(self.cpus),
            "memory": f"{self.memory_mib}Mi",
            "ephemeral-storage": f"{self.ephemeral_mib}Mi",
        }
        if gpus:
            amounts["nvidia.com/gpu"] = str(gpus)
        return {"requests": dict(amounts), "limits": dict(amounts)}


def _round_up(mib: float) -> int:
    return int(math.ceil(mib / ROUND_MIB) * ROUND_MIB)


def cache_bytes(spec: JobSpec) -> int | None:
    """The AutoCache files of one node at their largest (None: unknown before the job runs, or
    no cache: `freeze.cache: off`)."""
    if spec.freeze.cache == "off" or spec.freeze.policy == "off":
        return 0
    train = admission.data_size(spec).train
    if not train:
        return None
    m = spec.model
    return CACHE_LEVELS * train * m.tokens * m.width * 4  # float32 rows


def trainer_size(spec: JobSpec, nproc_per_node: int, gpus: int) -> PodSize:
    """A trainer pod running `nproc_per_node` workers (on `gpus` GPUs)."""
    rt, cuda = spec.runtime, gpus > 0
    # data-loader processes read data sources from files; built-in data sets are in memory
    loaders = spec.data.loader_workers if spec.data.is_source else 0
    if cuda:
        params = admission.estimate(spec).params
        worker = GPU_WORKER_BASE_MIB + GPU_HOST_BYTES_PER_PARAM * params / MIB
        node = NODE_MIB["cuda"] + (COMPILE_POOL_MIB if spec.parallel.compile else 0)
        shm = NCCL_SHM_MIB if nproc_per_node > 1 else 0
    else:
        worker = admission.estimate(spec).worker_peak_bytes / MIB + CPU_WORKER_EXTRA_MIB
        node, shm = NODE_MIB["cpu"], 0
    shm += LOADER_SHM_MIB * loaders * nproc_per_node
    memory = _round_up(HEADROOM * (node + nproc_per_node * worker + shm))
    per_worker_cpus = rt.threads_per_worker + loaders + (GPU_EXTRA_CPUS_PER_WORKER if cuda else 0)
    cached = cache_bytes(spec)
    cache_mib = CACHE_UNKNOWN_MIB if cached is None else _round_up(HEADROOM * cached / MIB)
    cache_mib = max(CACHE_MIN_MIB, cache_mib)
    return PodSize(
        cpus=NODE_CPUS + nproc_per_node * per_worker_cpus,
        memory_mib=memory,
        ephemeral_mib=SCRATCH_MIB + cache_mib,
        cache_mib=cache_mib,
    )


def shm_limit_mib(memory_mib: int) -> int:
    """The default size limit of /dev/shm (memory-backed) in a pod with `memory_mib` of
    memory: `SHM_SHARE` of it."""
    return max(1, int(memory_mib * SHM_SHARE))


def controller_size() -> PodSize:
    return PodSize(cpus=CONTROLLER_CPUS, memory_mib=CONTROLLER_MIB, ephemeral_mib=1024)
