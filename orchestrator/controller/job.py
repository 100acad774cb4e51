"""What names, places and submits a job, and the plain types the controller's parts share: job
ids (`new_job_id`, `check_job_id`), who holds a job (`controller_holder`), where its files live
(`job_dir`), a spec resolved once per job (`Submission`, `submit`), what the controller has seen
(`Progress`), where the next generation starts (`ResumePoint`) and the workers it supervises
(`Workers`)."""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from pipetransformer.core import keys
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout, TrainingState
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.orchestrator.sources import resolve_submission
from pipetransformer.store import CheckpointInfo


class ControllerError(RuntimeError):
    pass


# How often the controller looks for rendezvous states an agent refused (`_drain_alerts`).
ALERT_POLL_S = 1.0


class HandedOver(Exception):  # noqa: N818 (an outcome, not an error)
    """`run` left the job running on request (`Controller.leave`: a controller pod's stop), its
    lease revoked, for the next controller to take over."""


# Job ids name directories, etcd keys and Kubernetes objects: DNS-label characters only.
_JOB_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def new_job_id(spec: JobSpec) -> str:
    return f"{spec.name}-{uuid.uuid4().hex[:6]}"


def check_job_id(job_id: str) -> str:
    """A user-chosen job id, or ControllerError naming `--job-id` and what is allowed."""
    if not _JOB_ID_RE.match(job_id):
        raise ControllerError(
            f"--job-id {job_id!r} must be 1-63 lowercase letters, digits or '-', starting and "
            "ending with a letter or digit (it names directories, etcd keys and Kubernetes objects)"
        )
    return job_id


def is_dead_local_process(holder_json: str) -> bool:
    try:
        holder = json.loads(holder_json)
        if holder.get("host") != socket.gethostname():
            return False
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (ValueError, KeyError, TypeError, PermissionError):
        return False
    return False


def controller_holder(etcd: EtcdClient, job_id: str) -> str | None:
    """Who controls the job now, as a person reads it ("pid 812 on node-a"): the holder of its
    controller lease, unless that is a dead process on this host (whose lease `acquire` takes
    over at once). None when nobody does."""
    holder = etcd.get(keys.controller(job_id))
    if holder is None or is_dead_local_process(holder):
        return None
    try:
        who = json.loads(holder)
        return f"pid {int(who['pid'])} on {who['host']}"
    except (ValueError, KeyError, TypeError):
        return holder


def job_dir(workdir: str | Path, job_id: str) -> Path:
    return Path(workdir).resolve() / "jobs" / job_id


@dataclass(frozen=True)
class Submission:
    """A job's spec with everything it points at resolved and checked (orchestrator/sources.py:
    the pretrained model located and fingerprinted, data paths made absolute, a fine-tuning
    checkpoint pinned). Only `submit` makes one, so holding a Submission means the resolution
    was done, and no path resolves it again: `pipetransformer run` resolves before admission
    and hands the Submission to `Controller.create`, which resolves only a spec handed to it
    unresolved (the controller role's, a test's)."""

    spec: JobSpec


def submit(spec: JobSpec | Submission, cwd: Path | None = None) -> Submission:
    """`spec` resolved against `cwd` (default: the current directory): SpecError naming the field
    a missing file or a contradicting checkpoint breaks, before anything is stored. A Submission
    is returned as it is: it was resolved when it was made (a fine-tuning checkpoint is hashed
    whole to pin it, so twice would be a second read of gigabytes)."""
    if isinstance(spec, Submission):
        return spec
    return Submission(resolve_submission(spec, cwd))


@dataclass
class Progress:
    """What the controller has seen of the current generation (for displays and the outcome)."""

    step: int = 0
    epoch: int = 0
    total_steps: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    mfu: float | None = None  # the latest step's model FLOPs utilisation (a fraction)
    # the latest per-rank peak GPU memory (MiB, index = rank): kept until the next one, since
    # only steps at control points carry it
    peak_memory_mib: list[float | None] | None = None
    accuracy: float | None = None  # question answering: exact match
    f1: float | None = None  # question answering
    # a language model's held-out mean loss per token (its perplexity's log); None otherwise
    token_loss: float | None = None
    outcome: str | None = None  # done / stopped / failed, from the workers
    error: str | None = None
    layout: Layout | None = None
    waiting: str | None = None  # no layout fits the workers that joined: why
    # lines for a person, one per change a failure made (a generation aborted and why, the one
    # formed after it, its first step): the controller's one list, shared by every Progress
    notices: list[str] = field(default_factory=list)


class ResumePoint(NamedTuple):
    """Where the next generation starts: the state, the checkpoint it loads (None: from
    scratch) and the freeze boundary that checkpoint continues with."""

    state: TrainingState
    checkpoint: CheckpointInfo | None
    boundary: int


class Workers(Protocol):
    """The workers a controller supervises, as whoever runs it launched them: local torchrun
    agents (`pipetransformer run`), trainer pods seen through etcd (the controller role), or
    simulated agents (the benchmarks)."""

    def poll(self) -> int | None:
        """None while they run; then their launchers' exit code."""

    def detail(self, code: int | None) -> str:
        """What the job's message should add when they ended with `code` ("" for nothing)."""

    def close(self) -> None:
        """After the job's end is recorded (or on an error): release what the launch holds."""
