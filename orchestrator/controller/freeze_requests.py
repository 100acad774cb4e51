"""Manual freeze requests as the controller sees them (`FreezeRequests`): each one filed in
etcd (by the CLI or the dashboard) is audited once (`freeze_requested`), what became of it is
recorded from the workers' `FreezeDecided` (applied, superseded by the automatic decision, or
rejected; only the first answer counts), and the answered request is retired from its key
without touching one filed since.
"""

from __future__ import annotations

from pipetransformer.core import keys
from pipetransformer.core.protocol import (
    FreezeDecided,
    FreezeOutcome,
    FreezeRequest,
    UnreadableRequest,
    freeze_request_id,
    read_freeze_request,
)
from pipetransformer.orchestrator.controller.base import ControllerBase


class FreezeRequests(ControllerBase):
    """The audit trail of manual freeze requests."""

    def _audit_new_request(self) -> None:
        """Record a manual freeze request filed in etcd (by the CLI or the dashboard) once."""
        raw = self.etcd.get(keys.freeze_override(self.job_id))
        if raw:
            self._audit_request(read_freeze_request(raw))

    def _audit_request(self, request: FreezeRequest | UnreadableRequest) -> None:
        """Record `request` as filed, once (by `freeze_request_id`, as the store keys it)."""
        rid = freeze_request_id(request)
        if isinstance(request, UnreadableRequest):
            message = (
                f"unreadable request {request.raw[:80]!r} ({request.error}); it will be rejected"
            )
        else:
            message = (
                f"request {rid} by {request.who}: freeze blocks below {request.layers} "
                f"({request.reason})"
            )
        if rid in self._audited:
            return
        self._audited.add(rid)
        self.store.add_event(
            self.job_id,
            "freeze_requested",
            message,
            data={"request": request.model_dump(mode="json")},
            key=f"freeze-request:{rid[:200]}",  # audited once, across controller restarts
        )

    def _record_freeze(self, e: FreezeDecided) -> None:
        """A decision point moved the boundary or answered a manual request: audit what became
        of the request (applied, superseded by the automatic decision, or rejected), and retire
        it so it is not applied twice."""
        rid = None if e.request is None else freeze_request_id(e.request)
        if e.request is not None and rid not in self._decided:
            # filed and answered between two of this controller's reads of the key (a busy
            # controller, decision points close together): audited here, before its fate
            self._audit_request(e.request)
            # only the first answer counts: a worker that read the request again before it was
            # retired here (a decision point soon after, a restarted worker) finds it superseded
            # by its own application
            self._decided.add(rid)
            outcome = e.outcome or FreezeOutcome.REJECTED
            why = e.outcome_reason or f"boundary {e.previous} -> {e.boundary}"
            if isinstance(e.request, UnreadableRequest):
                whose = f"unreadable request {e.request.raw[:80]!r}"
            else:
                r = e.request
                whose = f"request {r.id} by {r.who} (layers={r.layers})"
            self._record_event(
                f"freeze_{outcome}",
                f"{whose}: {why}",
                data={
                    "request": e.request.model_dump(mode="json"),
                    "step": e.step,
                    "outcome": outcome.value,
                    "boundary": e.boundary,
                },
            )
        if rid is not None:
            self._retire_request(rid)
        if e.boundary != e.previous:
            self._record_event(
                "freeze",
                f"{e.source}: blocks {e.previous}..{e.boundary - 1} frozen at step "
                f"{e.step} ({e.reason})",
                data=e.payload(),
            )

    def _retire_request(self, rid: str) -> None:
        """Take the answered request `rid` out of its key, and nothing else: a request filed
        since (the key freed by an earlier answer to `rid`, a second answer arriving now) waits
        for the next decision point."""
        key = keys.freeze_override(self.job_id)
        raw, revision = self.etcd.get_with_revision(key)
        if raw is not None and freeze_request_id(read_freeze_request(raw)) == rid:
            self.etcd.delete_at_revision(key, revision)  # unless replaced since this read
