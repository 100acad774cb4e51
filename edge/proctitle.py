"""Process titles: every long-lived process of a job names its role, its job and (a worker) its
rank, so that `ps`, `pgrep -f` and /proc/PID/cmdline tell jobs and ranks apart and
`pkill -f 'job=<id>( |$)'` reaches one job only (docs/operations.md, "Processes"):

    pipetransformer controller job=vit-1a2b3c
    pipetransformer forkserver job=vit-1a2b3c node=0
    pipetransformer worker-client job=vit-1a2b3c rank=1 node=0
    pipetransformer worker job=vit-1a2b3c rank=1 gen=2 node=0
    pipetransformer loader job=vit-1a2b3c rank=1 gen=2 node=0 id=0

Without titles a fork server's workers all showed the server's own command line
(`... -m pipetransformer.orchestrator.forkserver --serve-fd 13 pipetransformer.trainer.worker`).
`setproctitle` rewrites the process's argv area, which is what those tools read (`sys.argv` is
unchanged); on Linux it also names the main thread `pipetransformer` (/proc/PID/comm).

The prefix and the `key=value` words are what scripts and people match: keep them stable."""

from __future__ import annotations

import setproctitle

PREFIX = "pipetransformer"
# The node a launcher's processes run on (the index of a local run's simulated node, a trainer
# pod's host name): set by the launcher in the environment of its fork server and workers.
NODE_ENV = "PIPETRANSFORMER_NODE"

# this process's role and fields, for the loader processes it forks (they inherit them)
_current: dict[str, object] = {}


def title(role: str, **fields: object) -> str:
    """`pipetransformer <role> key=value ...`: the fields in the order given, those that are
    None or empty left out (a process that does not know its rank says nothing of it)."""
    words = [PREFIX, role]
    for key, value in fields.items():
        if value is not None and str(value) != "":
            words.append(f"{key}={'_'.join(str(value).split())}")  # one word per field
    return " ".join(words)


def set_title(role: str, **fields: object) -> str:
    """Title this process `title(role, **fields)`; returns the title."""
    text = title(role, **fields)
    _current.clear()
    _current.update(fields)
    setproctitle.setproctitle(text)
    return text


def title_loader(worker_id: int) -> None:
    """A DataLoader `worker_init_fn`: the loader process forked from a worker keeps the worker's
    fields (job, rank, generation, node) and says it is a loader, and which."""
    set_title("loader", **{k: v for k, v in _current.items() if k != "id"}, id=worker_id)
