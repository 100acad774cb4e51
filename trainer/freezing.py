"""The train loop's AutoFreeze collaborator: gradient statistics between decision points, and the
decision at each one. Rank 0 decides (the automatic decision, raised to a pending manual request
if that is further: `core.freeze.decide`); every rank adopts the same decision at the same
step. The policy itself is pure and lives in `core.freeze`."""

from __future__ import annotations

from core import keys
from core.etcd_client import EtcdClient
from core.freeze import FreezeDecision, GradNormMeter, decide
from core.protocol import (
    FreezeDecided,
    FreezeRequest,
    UnreadableRequest,
    read_freeze_request,
)
from core.spec import JobSpec
from trainer.collective import from_rank0
from trainer.process import Reporter
from trainer.train_state import TrainState


class Freezing:
    def __init__(self, spec: JobSpec, rank: int, etcd: EtcdClient, job_id: str, reporter: Reporter):
        self.spec, self.rank, self.etcd, self.job_id, self.reporter = (
            spec,
            rank,
            etcd,
            job_id,
            reporter,
        )
        self.meter = GradNormMeter(spec.model.depth)

    def observe(self, block_norms: list[float]) -> None:
        """One step's per-block gradient norms (the same on every rank)."""
        self.meter.add(block_norms)

    def decide(self, ts: TrainState) -> FreezeDecision:
        """A decision point (collective): the decision every rank adopts; `ts.freeze` moves on.
        The caller re-lays out when the boundary moved past its layout's."""
        decision, request = from_rank0(self.rank, lambda: self._on_rank0(ts))
        self.meter.reset()
        ts.freeze = decision.state
        if self.rank == 0 and (decision.changed or request is not None):
            self.reporter.emit(
                FreezeDecided,
                step=ts.step,
                previous=decision.previous,
                boundary=decision.boundary,
                source=decision.source,
                reason=decision.reason,
                request=request,
                outcome=decision.override,
                outcome_reason=decision.override_reason,
            )
        return decision

    def _on_rank0(
        self, ts: TrainState
    ) -> tuple[FreezeDecision, FreezeRequest | UnreadableRequest | None]:
        raw = self.etcd.get(keys.freeze_override(self.job_id))
        request = read_freeze_request(raw) if raw else None
        if request is None:
            override = None
        elif isinstance(request, UnreadableRequest):  # rejected with the reason it did not parse
            override = f"<unreadable request: {request.error}>"
        else:
            override = request.layers
        norms = self.meter.means() if self.meter.steps else None
        decision = decide(
            self.spec.freeze,
            ts.freeze,
            norms,
            self.spec.model.depth,
            boundary=ts.boundary,
            override=override,
        )
        return decision, request
