"""Manual freeze requests (and trace requests): validated against the job's state, then filed in etcd for the next
decision point. The controller audits them in the store (it is the only SQL writer); the CLI
(`pipetransformer freeze`) and the dashboard file them through `file_freeze_request`, after
finding the job's etcd with `live_etcd_endpoint`.

The job comes in as the caller read it (`JobFacts`: a store's `JobInfo` is one), so the rule
needs no store of its own: the CLI and the dashboard read the job, this module checks and files."""

from __future__ import annotations

import getpass
import socket
import uuid
from pathlib import Path
from typing import Protocol

from pipetransformer.core import keys
from pipetransformer.core.freeze import (
    FreezeOverrideError,
    apply_override,
    max_boundary,
)  # the pure rule
from pipetransformer.core.protocol import FreezeRequest, TraceRequest, read_trace_request
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout
from pipetransformer.edge.etcd_client import EtcdClient

# Written next to a job's data by a launch with an embedded etcd while it serves, so that
# `pipetransformer freeze` and the dashboard can find a running job's etcd without being told.
ENDPOINT_FILE = "etcd.endpoint"


class OverrideError(ValueError):
    """A freeze request that cannot be filed; nothing was changed."""


class JobFacts(Protocol):
    """What a freeze request is checked against: the job as its store row says (`JobInfo`)."""

    @property
    def id(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def workdir(self) -> str: ...
    @property
    def spec(self) -> JobSpec: ...
    @property
    def freeze_boundary(self) -> int: ...


def requester() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def endpoint_file(workdir: str | Path, job_id: str) -> Path:
    return Path(workdir).resolve() / "jobs" / job_id / ENDPOINT_FILE


def live_etcd_endpoint(job: JobFacts, explicit: str | None = None) -> str:
    """The etcd a running job coordinates through: `explicit` (an external etcd) when given,
    else the endpoint its embedded etcd left in the job's directory."""
    if explicit:
        return explicit
    path = endpoint_file(job.workdir, job.id)
    try:
        return path.read_text().strip()
    except OSError:
        raise OverrideError(
            f"job {job.id} is {job.state} and has no live etcd (no {path}); pass --etcd "
            "HOST:PORT if it coordinates through an external one"
        ) from None


def current_boundary(etcd: EtcdClient, job: JobFacts) -> int:
    """The boundary in force: the layout the controller published, else the stored one."""
    raw = etcd.get(keys.layout(job.id))
    return Layout.model_validate_json(raw).freeze_boundary if raw else job.freeze_boundary


def allowed_layers(job: JobFacts, current: int) -> tuple[int, int]:
    """The range a request may ask for: past `current` (a request at the boundary in force
    would freeze nothing), keeping the spec's `freeze.keep_trainable` last blocks trainable
    (empty when lo > hi)."""
    return current + 1, max_boundary(job.spec.model.depth, job.spec.freeze.keep_trainable)


def pending_request(etcd: EtcdClient, job_id: str) -> str | None:
    """The raw request waiting for the job's next decision point, if any."""
    return etcd.get(keys.freeze_override(job_id))


def file_freeze_request(
    etcd: EtcdClient, job: JobFacts, layers: int, reason: str, who: str | None = None
) -> FreezeRequest:
    """Ask for blocks [0, layers) to be frozen at the job's next decision point. Valid only for
    a running job, past the current boundary, and within the model (keeping
    `freeze.keep_trainable` blocks trainable); one pending request at a time. Nothing is filed
    when any rule fails (OverrideError names the rule)."""
    job_id = job.id
    if job.state != "running":
        raise OverrideError(f"job {job_id} is {job.state}; freeze requests need a running job")
    current = current_boundary(etcd, job)
    try:
        apply_override(current, layers, job.spec.model.depth, job.spec.freeze.keep_trainable)
    except FreezeOverrideError as exc:
        raise OverrideError(str(exc)) from None
    if layers == current:  # the decision point would only record it as superseded
        lo, hi = allowed_layers(job, current)
        frozen = (
            f"blocks 0..{current - 1} are frozen already" if current else "nothing is frozen yet"
        )
        allowed = f"ask for {lo}..{hi}" if lo <= hi else "no further freezing is allowed"
        raise OverrideError(
            f"layers={layers} freezes nothing ({frozen}): layers is the new boundary, the "
            f"number of bottom blocks to freeze; {allowed}"
        )
    if not reason.strip():
        raise OverrideError("reason: say why (it is kept in the job's audit trail)")
    request = FreezeRequest(
        id=uuid.uuid4().hex[:8], layers=layers, who=who or requester(), reason=reason.strip()
    )
    if not etcd.put_if_absent(keys.freeze_override(job_id), request.model_dump_json()):
        pending = pending_request(etcd, job_id)
        raise OverrideError(f"job {job_id} already has a pending freeze request: {pending}")
    return request


def file_trace_request(etcd: EtcdClient, job: JobFacts, who: str | None = None) -> TraceRequest:
    """Ask every rank of a running job to trace its next step after a control point (at most
    `runtime.control_every_steps` steps away). A request still pending is returned as it is
    (two people asking get the same trace); OverrideError when the job is not running or
    does not time its stages (`runtime.stage_timing: false`)."""
    if job.state != "running":
        raise OverrideError(f"job {job.id} is {job.state}; a trace needs a running job")
    if not job.spec.runtime.stage_timing:
        raise OverrideError(
            f"job {job.id} runs with runtime.stage_timing: false; its ranks time nothing to trace"
        )
    key = keys.trace_request(job.id)
    request = TraceRequest(id=uuid.uuid4().hex[:12], who=who or requester())
    for _ in range(3):  # a request served (or replaced) between the read and the write: again
        raw = etcd.get(key)
        if (pending := read_trace_request(raw)) is not None:
            return pending
        if etcd.compare_and_swap(key, raw, request.model_dump_json()):
            return request
    raise OverrideError(f"job {job.id}'s trace request kept changing; try again")
