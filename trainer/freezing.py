"""The train loop's AutoFreeze collaborator: gradient statistics between decision points, and the
decision at each one. Rank 0 decides (the automatic decision, raised to a pending manual request
if that is further: `core.freeze.decide`); every rank adopts the same decision at the same
step. The policy itself is pure and lives in `core.freeze`."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pipetransformer.core import keys
from pipetransformer.core.freeze import (
    FreezeDecision,
    GradNormMeter,
    decide,
    policy_in_force,
    settle_criterion,
)
from pipetransformer.core.protocol import (
    FreezeDecided,
    FreezeRequest,
    FreezeSignal,
    UnreadableRequest,
    freeze_request_id,
    read_freeze_request,
)
from pipetransformer.core.spec import JobSpec
from pipetransformer.core.state import Layout
from pipetransformer.core.train_state import TrainState
from pipetransformer.edge.etcd_client import EtcdClient
from pipetransformer.trainer.collective import from_rank0
from pipetransformer.trainer.output_probe import OutputProbe
from pipetransformer.trainer.pipeline import RankPipeline
from pipetransformer.trainer.process import Reporter


class GradientDrift:
    """Criterion `noise` (core/freeze.py): per block, the interval's summed gradient against its
    noise, `||sum_t g_t|| / sqrt(sum_t ||g_t||^2)`. Each rank sums the gradients of the blocks it
    trains (one buffer per parameter: the memory of one more copy of its trainable blocks, kept
    only under this criterion); the step norms are the all-reduced per-block norms every rank
    has. Not checkpointed: after a resume, a recovery or a re-layout the interval restarts (the
    ratio is over the steps it saw)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.sums: dict[str, torch.Tensor] = {}
        self.squares = [0.0] * num_blocks

    def add(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """One step's summed, unclipped gradients of this rank's parameters."""
        for name, grad in named:
            if not name.startswith("blocks."):
                continue
            held = self.sums.get(name)
            if held is None:
                self.sums[name] = grad.detach().float().clone()
            else:
                held.add_(grad.detach())

    def add_norms(self, per_block: list[float]) -> None:
        for i, n in enumerate(per_block):
            self.squares[i] += n * n

    def ratios(self, group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
        """The drift ratio per block (NaN where no gradient was seen); collective over `group`,
        the pipeline: each block's sum lives on the one stage that trains it."""
        sq = torch.zeros(self.num_blocks, dtype=torch.float64, device=device)
        for name, total in self.sums.items():
            sq[int(name.split(".")[1])] += total.double().square().sum()
        if group is not None:
            dist.all_reduce(sq, group=group)
        return [
            math.sqrt(float(s) / q) if q > 0 else math.nan
            for s, q in zip(sq.cpu().tolist(), self.squares, strict=True)
        ]

    def reset(self) -> None:
        self.sums.clear()
        self.squares = [0.0] * self.num_blocks


class Freezing:
    """`probe`: policy `output`'s probe (the trainer makes it when that policy is in force)."""

    def __init__(
        self,
        spec: JobSpec,
        rank: int,
        etcd: EtcdClient,
        job_id: str,
        reporter: Reporter,
        probe: OutputProbe | None = None,
    ):
        self.spec, self.rank, self.etcd, self.job_id, self.reporter = (
            spec,
            rank,
            etcd,
            job_id,
            reporter,
        )
        self.meter = GradNormMeter(spec.model.depth)
        self.policy = policy_in_force(spec.freeze)
        self.probe = probe if self.policy == "output" else None
        self.from_trained = spec.model.pretrained is not None or spec.init.checkpoint is not None
        noise = (
            self.policy == "gradient"
            and settle_criterion(spec.freeze, self.from_trained) == "noise"
        )
        # criterion 'noise' sums each step's gradients (sync_and_clip hands them over)
        self.drift = GradientDrift(spec.model.depth) if noise else None
        # the requests rank 0 decided (by id, or the text of one that did not parse): the
        # controller retires one only once it has drained the report, and a decision point
        # that comes first must not read it again (as superseded by its own application)
        self._answered: set[str] = set()

    def observe(self, block_norms: list[float], lr: float) -> None:
        """One step's per-block gradient norms (the same on every rank) and learning rate."""
        self.meter.add(block_norms)
        if self.drift is not None:
            self.drift.add_norms(block_norms)
        if self.probe is not None:
            self.probe.add_lr(lr)

    def start(self, pipe: RankPipeline, layout: Layout, replica: int) -> None:
        """Before a run's first step (collective): policy `output` takes its reference probe."""
        if self.probe is not None:
            self.probe.start(pipe, layout, replica)

    def decide(
        self, ts: TrainState, pipe: RankPipeline, layout: Layout, replica: int
    ) -> FreezeDecision:
        """A decision point (collective): the decision every rank adopts; `ts.freeze` moves on.
        The caller re-lays out when the boundary moved past its layout's. Criterion 'noise'
        gathers its per-block sums over `pipe`'s pipeline group; policy `output` probes through
        `pipe` (this rank's part of `layout`, in replica `replica`)."""
        drift = None
        if self.drift is not None:
            drift = self.drift.ratios(pipe.groups.pipeline, pipe.device)
            self.drift.reset()
        rates = None
        if self.probe is not None:
            rates = self.probe.rates(pipe, layout, replica)
        decision, request = from_rank0(self.rank, lambda: self._on_rank0(ts, drift, rates))
        self.meter.reset()
        ts.freeze = decision.state
        if self.rank == 0 and decision.signal is not None and decision.limits is not None:
            self.reporter.emit(
                FreezeSignal,
                step=ts.step,
                decision=decision.state.decisions,
                boundary=decision.boundary,
                bound=decision.bound,
                policy=self.policy,
                statistic=self._statistic(),
                signal=list(decision.signal),
                limits=list(decision.limits),
                probe_s=self.probe.seconds if self.probe is not None else 0.0,
            )
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

    def _statistic(self) -> str:
        if self.policy == "output":
            return "output_rate"
        return "gradient_drift" if self.drift is not None else "gradient_norm"

    def _on_rank0(
        self, ts: TrainState, drift: list[float] | None, rates: list[float] | None = None
    ) -> tuple[FreezeDecision, FreezeRequest | UnreadableRequest | None]:
        raw = self.etcd.get(keys.freeze_override(self.job_id))
        request = read_freeze_request(raw) if raw else None
        if request is not None:
            rid = freeze_request_id(request)
            if rid in self._answered:
                request = None  # decided at an earlier decision point, not yet retired
            else:
                self._answered.add(rid)
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
            drift=drift,
            from_trained=self.from_trained,
            output_rates=rates,
        )
        return decision, request
