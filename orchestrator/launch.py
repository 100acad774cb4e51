"""Command lines that start trainer workers: torchrun with this project's etcd v3 rendezvous."""

from __future__ import annotations

import os
import sys


def torchrun_command(
    etcd: str,
    job_id: str,
    generation: int,
    nproc_per_node: int,
    nnodes: str = "1",
    python: str | None = None,
) -> list[str]:
    """`torchrun --rdzv-backend etcd3 ... -m trainer.worker` for one generation of a job.

    The rendezvous id carries the generation: a finished rendezvous is closed for good, so a
    resumed job needs a fresh one."""
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "etcd3",
        "--rdzv-endpoint",
        etcd,
        "--rdzv-id",
        f"{job_id}-g{generation}",
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.5",
        "-m",
        "trainer.worker",
        "--job-id",
        job_id,
        "--etcd",
        etcd,
    ]


def worker_env(threads: int) -> dict[str, str]:
    """Environment for worker processes: pinned threads (2 cores are shared), unbuffered logs."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        TORCH_CPP_LOG_LEVEL=env.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
    )
    return env
