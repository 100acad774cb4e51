"""How a worker's end is told apart and reported: its own failure, a lost peer, or its death.

A worker whose collective fails because a peer died is not the one that failed; it reports
`peer_lost` and leaves to re-form. A worker whose own code raises reports `failed`. A worker
killed outright cannot report anything: the process that reaps it (its node's fork server) puts
its exit status in etcd through `report_exit`. The controller puts the three together
(core/postmortem.py).
"""

from __future__ import annotations

import re
import socket

from pipetransformer.core import keys
from pipetransformer.core.protocol import WorkerExit, is_abnormal

# What gloo (and NCCL, torch's store) say when the other end of a collective went away. gloo
# raises a plain RuntimeError ("[.../pair.cc:553] Connection closed by peer [127.0.0.1]:16110");
# torch's own network errors are DistNetworkError.
_PEER_GONE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|EPIPE|Connection refused|"
    r"remote process exited|NCCL communicator was aborted|Socket Timeout|"
    r"gloo/transport/tcp",
    re.IGNORECASE,
)


def is_peer_loss(exc: BaseException) -> bool:
    """Whether `exc` says a peer of a collective went away (rather than this rank failing)."""
    import torch.distributed as dist  # torch is imported by every caller already

    network = getattr(dist, "DistNetworkError", None)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:  # the schedule may wrap the gloo error
        seen.add(id(exc))
        if (network is not None and isinstance(exc, network)) or _PEER_GONE.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# how torch's DataLoader re-raises an exception from a loader process: the same type, its message
# the loader's traceback text, the original message on the traceback's last line
_CAUGHT = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.")


def own_failure(exc: BaseException) -> tuple[str, bool]:
    """This rank's failure on one line, and whether a restart would repeat it: a `DataError`
    (the user's data cannot be used as given, e.g. a corrupt image; also when a DataLoader's
    loader process raised it) names the file and row and fails the same way every time, so the
    job fails instead of restarting."""
    from pipetransformer.trainer.sources import DataError  # the data plane's, imported anyway

    text = str(exc)
    if _CAUGHT.match(text):  # the loader's traceback: its last line is the original error
        last = [line for line in text.splitlines() if line.strip()][-1]
        name, _, message = last.partition(": ")
        return f"{name.rpartition('.')[2]}: {message}", isinstance(exc, DataError)
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}", isinstance(exc, DataError)


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def report_exit(request: dict, pid: int, exit_code: int) -> None:
    """Fork-server hook (`on_worker_exit`), run in a throwaway child of the server once worker
    `pid` was reaped: put how it ended (`WorkerExit`) under the job's `keys.exit_report`, if it
    ended abnormally (a signal, or a code other than done and re-form). `request` is what the
    worker was started with (argv with --job-id and --etcd, environment with torchrun's RANK)."""
    signum = -exit_code if exit_code < 0 else None
    code = None if signum is not None else exit_code
    if not is_abnormal(code, signum):
        return
    argv, env = request.get("argv") or [], request.get("env") or {}
    job_id, endpoint = _flag(argv, "--job-id"), _flag(argv, "--etcd")
    if not job_id or not endpoint:
        return
    from pipetransformer.edge.etcd_client import (
        EtcdClient,
    )  # only on this path, in the throwaway child

    rank = env.get("RANK")
    host = socket.gethostname()
    record = WorkerExit(
        pid=pid,
        host=host,
        rank=int(rank) if rank and rank.isdigit() else None,
        exit_code=code,
        signal=signum,
    )
    with EtcdClient(endpoint, retry_timeout=5) as etcd:
        etcd.put(keys.exit_report(job_id, host, pid), record.model_dump_json())
