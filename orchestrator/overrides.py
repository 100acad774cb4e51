"""Manual freeze requests: validated against the job's state, then filed in etcd for the next
decision point. The controller audits them in the store (it is the only SQL writer); the CLI
(`pipetransformer freeze`) files them through `file_freeze_request`."""

from __future__ import annotations

import getpass
import socket
import uuid

from orchestrator import keys
from orchestrator.etcd_client import EtcdClient
from orchestrator.protocol import FreezeRequest
from orchestrator.state import Layout
from orchestrator.store import Store


class OverrideError(ValueError):
    """A freeze request that cannot be filed; nothing was changed."""


def requester() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def file_freeze_request(
    store: Store, etcd: EtcdClient, job_id: str, layers: int, reason: str, who: str | None = None
) -> FreezeRequest:
    """Ask for blocks [0, layers) to be frozen at the job's next decision point. Valid only for
    a running job, forward from the current boundary, and within the model (keeping
    `freeze.keep_trainable` blocks trainable); one pending request at a time."""
    from trainer.freeze import FreezeOverrideError, apply_override  # the pure rule workers apply

    job = store.get_job(job_id)
    if job.state != "running":
        raise OverrideError(f"job {job_id} is {job.state}; freeze requests need a running job")
    raw = etcd.get(keys.layout(job_id))
    current = Layout.model_validate_json(raw).freeze_boundary if raw else job.freeze_boundary
    try:
        apply_override(current, layers, job.spec.model.depth, job.spec.freeze.keep_trainable)
    except FreezeOverrideError as exc:
        raise OverrideError(str(exc)) from None
    if not reason.strip():
        raise OverrideError("reason: say why (it is kept in the job's audit trail)")
    request = FreezeRequest(
        id=uuid.uuid4().hex[:8], layers=layers, who=who or requester(), reason=reason
    )
    if not etcd.put_if_absent(keys.freeze_override(job_id), request.model_dump_json()):
        pending = etcd.get(keys.freeze_override(job_id))
        raise OverrideError(f"job {job_id} already has a pending freeze request: {pending}")
    return request
