"""The exit statuses of `pipetransformer` commands, and what each one means to whoever restarts
them: the job's Volcano lifecycle policies (orchestrator/volcano.py) map the controller pod's
status to an action, so a status says whether a restart can help.

    0    the job completed                               -> the Volcano job completes
    1    an error a restart may fix (a crash, the trainer pods never came or all went)
                                                          -> the controller pod is replaced
    2    the command's arguments or the spec are wrong   -> terminal: a restart fails the same way
    3    the job failed for a reason a restart cannot fix (a deterministic error in training, or
         the controller's restart budget is spent)       -> terminal
    130  stopped on a user's request (Ctrl-C, `pipetransformer stop`, the dashboard)
                                                          -> terminal, resumable by a user
    143  SIGTERM: a pod's stop (a drain, an eviction, a delete); the job was handed over
                                                          -> the controller pod is replaced
"""

from __future__ import annotations

import signal

EXIT_COMPLETED = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_JOB_FAILED = 3
EXIT_STOPPED = 128 + signal.SIGINT  # what a shell reports for Ctrl-C
EXIT_SIGTERM = 128 + signal.SIGTERM  # a shell's status for a process ended by SIGTERM

# statuses after which restarting the controller cannot help: the Volcano job ends
TERMINAL = (EXIT_USAGE, EXIT_JOB_FAILED, EXIT_STOPPED)

# Kubernetes shows a container's last words (at most 4096 bytes) in its status, where
# `kubectl describe pod` and `torchx status` find them; the file exists only in containers
TERMINATION_LOG = "/dev/termination-log"
TERMINATION_LOG_MAX_BYTES = 4096


def exit_status(job_state: str, stopped: bool) -> int:
    """The controller's status for the job state it ended the job in (`Controller.finish`)."""
    if job_state == "completed":
        return EXIT_COMPLETED
    if job_state == "failed":
        return EXIT_JOB_FAILED
    return EXIT_STOPPED if stopped else EXIT_ERROR


def write_termination_log(message: str, path: str = TERMINATION_LOG) -> bool:
    """Leave `message` as the container's termination message, where there is one (in a pod);
    False elsewhere. Never raises: a missing or read-only file must not change the exit."""
    data = message.encode()[-TERMINATION_LOG_MAX_BYTES:]
    try:
        with open(path, "r+b") as f:  # r+: never create it outside a container
            f.truncate(0)
            f.write(data)
        return True
    except OSError:
        return False
