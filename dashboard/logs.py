"""A rank's recent log lines for the Workers view: the tail of the worker's log file, read in
bounded time and memory (the end of the file only), or why it cannot be read here and how to
get the lines instead.

Each worker reports the file its stdout goes to (`core.protocol.Started.log`, the store's
`WorkerRow.log`) when that is a regular file: local runs write one per node under the job's
directory. In a pod stdout is the container's log, which the dashboard cannot read: Kubernetes
keeps it, and `kubectl logs` (or `torchx log`) reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# the most the Workers view reads of a log at each refresh, and shows
MAX_BYTES = 256 * 1024
LINES = 200
# how to read a trainer pod's log, where the dashboard has no file (the torchx labels every
# pod carries: the app id torchx printed at submission, the role, the replica)
KUBERNETES_HINT = (
    "On Kubernetes a worker's output is its pod's log: `kubectl logs -l "
    "app.kubernetes.io/instance=<torchx app id>,torchx.pytorch.org/role-name=trainer --prefix "
    "--tail 200` (add `,torchx.pytorch.org/replica-id=<node>` for one node), or `torchx log "
    "kubernetes://<namespace>/<torchx app id>/trainer/<node>`."
)


@dataclass(frozen=True)
class LogTail:
    """The last lines of a log (`text`), or why there are none (`reason`)."""

    text: str | None
    reason: str | None = None
    truncated: bool = False  # the file holds more than was read


def log_tail(path: str | None, lines: int = LINES, max_bytes: int = MAX_BYTES) -> LogTail:
    """The last `lines` lines of the file at `path`, reading at most its last `max_bytes` (a
    line cut by that bound is dropped); undecodable bytes are replaced."""
    if lines < 1 or max_bytes < 1:
        raise ValueError(f"lines and max_bytes must be >= 1, got {lines} and {max_bytes}")
    if not path:
        return LogTail(
            None, "This rank reported no log file (its output is not a file). " + KUBERNETES_HINT
        )
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - max_bytes)
            # one byte before the window says whether its first line starts whole
            f.seek(max(0, start - 1))
            whole = start == 0 or f.read(1) == b"\n"
            data = f.read(max_bytes)
    except OSError as exc:
        return LogTail(
            None,
            f"The log file {path} cannot be read here ({exc.strerror or exc}): the dashboard "
            "reads only files on its own machine. " + KUBERNETES_HINT,
        )
    text = data.decode("utf-8", errors="replace")
    if not whole and "\n" in text:  # the first line was cut by the bound
        text = text.split("\n", 1)[1]
    kept = text.splitlines()[-lines:]
    return LogTail("\n".join(kept), truncated=start > 0 or len(text.splitlines()) > lines)
