"""Command lines that start trainer workers: torchrun with this project's etcd v3 rendezvous."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from pipetransformer.core import keys
from pipetransformer.orchestrator.controller import job_dir
from pipetransformer.orchestrator.forkserver import client_args

# Rendezvous timing: a round waits this long for more nodes once `min` have joined. Short, since
# recovery time counts; a node that misses a round joins the next one and the job widens.
LAST_CALL_S = 2
# ... except the first round, a launch: its nodes start together but not at the same moment (a
# loaded machine, an image pulled on one node and cached on another), and a node a few seconds
# late would start the job narrower and re-form it a round later. torch's own default.
FIRST_CALL_S = 30
# A lost node leaves the rendezvous once it missed this many heartbeats of this interval (torch's
# default, 5 s x 3, kept the survivors of a node loss waiting 15 s for it).
HEARTBEAT_S, HEARTBEATS_MISSED = 1, 3
# ... up to this many nodes. Beyond, torch's 5 s: with N nodes, the chance that some node misses
# three 1 s heartbeats (a long GC pause, a host busy loading data, a slow etcd) grows with N, and
# every such miss re-forms the whole job; at cluster size a false loss costs far more than
# noticing a real one 12 s later. Measured in bench/control_plane_scale.py (k8s/README.md).
FAST_HEARTBEAT_MAX_NODES = 64
LARGE_JOB_HEARTBEAT_S = 5


def heartbeat_s(max_nodes: int) -> int:
    """The rendezvous keep-alive interval for a job of at most `max_nodes` torchrun agents."""
    return HEARTBEAT_S if max_nodes <= FAST_HEARTBEAT_MAX_NODES else LARGE_JOB_HEARTBEAT_S


def max_nodes(nnodes: str) -> int:
    """MAX of torchrun's `--nnodes` (N or MIN:MAX)."""
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        raise ValueError(f"nnodes must be N or MIN:MAX, got {nnodes!r}") from None


def torchrun_command(
    etcd: str,
    job_id: str,
    rdzv_id: str,
    nproc_per_node: int,
    nnodes: str = "1",
    max_restarts: int = 0,
    python: str | None = None,
    forkserver: str | None = None,
) -> list[str]:
    """`torchrun --rdzv-backend etcd3 ... -m pipetransformer.trainer.worker` for one launch of a job's workers.

    Every agent of one launch meets at `rdzv_id` (a finished rendezvous is closed for good, so a
    resumed job uses a fresh id). With `nnodes` MIN:MAX and `max_restarts` > 0 the agents are
    elastic: a failed worker group is restarted into a new rendezvous round with the nodes that
    are left (at least MIN), and a node that arrives later widens the job at the next round.
    With `forkserver` (a running server's name) each worker is forked from that node's server,
    torch already imported, instead of starting a fresh Python."""
    return [
        python or sys.executable,
        "-P",  # safe path: the job's working directory shadows no module (worker_env for workers)
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
        rdzv_id,
        "--rdzv-conf",
        f"last_call_timeout={LAST_CALL_S},first_call_timeout={FIRST_CALL_S},"
        f"keep_alive_interval={heartbeat_s(max_nodes(nnodes))},"
        f"keep_alive_max_attempt={HEARTBEATS_MISSED},job={job_id}",
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        *client_args(forkserver),
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
        # torchrun starts each worker as `python -u -m ...` from the job's working directory:
        # safe-path mode keeps that directory off sys.path, so a user's own `core/`, `trainer/`
        # or `torch/` folder there never replaces a module the worker imports
        PYTHONSAFEPATH="1",
        TORCH_CPP_LOG_LEVEL=env.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
    )
    return env


RDZV_SECRET_FILE = "rdzv.secret"


def job_secret_path(workdir: str | Path, job_id: str) -> Path:
    """Where a job run on this machine keeps its rendezvous secret (orchestrator/rendezvous/,
    "Trust"), beside its etcd data."""
    return job_dir(workdir, job_id) / RDZV_SECRET_FILE


def job_secret_file(workdir: str | Path, job_id: str) -> Path:
    """The job's rendezvous secret file, made on its first launch (readable by its owner only)
    and kept for `resume` and for nodes that join later (`pipetransformer workers`)."""
    path = job_secret_path(workdir, job_id)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def with_job_secret(env: dict[str, str], workdir: str | Path, job_id: str) -> dict[str, str]:
    """`env` for a node of the job: its secret as given (a pod's, from a Secret), else the
    file a local launch of the job made, where there is one."""
    if env.get(keys.RDZV_SECRET_ENV) or env.get(keys.RDZV_SECRET_FILE_ENV):
        return env
    path = job_secret_path(workdir, job_id)
    return {**env, keys.RDZV_SECRET_FILE_ENV: str(path)} if path.is_file() else env
