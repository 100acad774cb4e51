"""AutoFreeze: which prefix of blocks to freeze, decided at decision points (PipeTransformer).

Pure and deterministic: plain numbers in, decisions out; no torch.distributed, no I/O. The caller
(rank 0 at a decision point) gathers the statistics, calls `decide`, and broadcasts the decision
over the control group so every rank switches at the same step.

The freeze boundary has one owner: the layout in force
(`core.state.Layout.freeze_boundary`). `FreezeState` carries only what the policy remembers
between decision points (how many there have been and the gradient norms); the caller passes the
current boundary to `decide`, derived from its layout, and applies the decision's new boundary by
re-laying out.

Rules (L = number of blocks, F = freeze boundary: blocks 0 .. F-1 are frozen, T = number of
decision points so far including the current one, T = 1 at the first):

* Freezing is always a prefix, and F never decreases.
* The alpha-bound: an automatic decision never puts F above
  `alpha_bound(alpha, L, T') = ceil(L * (1 - (1 - alpha)^T'))` (PipeTransformer's schedule: at most a
  fraction alpha of the still-active layers may be frozen per decision point, compounded), nor
  above `L - keep_trainable` (the cap; the classifier head is not a block and is never frozen).
  `T' = T - warmup_decisions` counts the decision points *after* warm-up, so freezing starts at
  one alpha-step and grows gradually; counting the warm-up too would let the first post-warm-up
  decision jump straight to most of the model. T' <= T, so the paper's bound over T always holds
  too.
* No automatic freezing at the first `warmup_decisions` decision points; they still record
  gradient norms.
* Policy `off`: F never moves automatically. Policy `schedule`: F = min(alpha-bound, cap) (and never
  below the current F). Policy `gradient`: F = the longest converged prefix, clipped by the
  alpha-bound and the cap, and never below the current F.
* Policy `output`: F = the longest prefix of blocks whose output has stopped moving (below),
  clipped by the alpha-bound and the cap, and never below the current F. Policy `auto` is the
  policy `AUTO_POLICY` names: the rule that held accuracy best in the policy comparison.
* Policy `gradient` asks whether each block has *settled*, by one of two criteria
  (`freeze.criterion`; 'auto' takes `noise` when the job starts from trained weights, `decay`
  otherwise: `settle_criterion`). Both are below; "Why two criteria" says why.
* `decay`: a block has *converged* at decision point T when its gradient norm has **decayed to at
  most `threshold` times its peak**: `n_T <= threshold * max(n_1, ..., n_T)`, the peak taken over
  all decision points so far including the current one (so at the first decision point nothing has
  converged unless threshold = 1). A block whose norm is 0 at its peak too (no gradient ever)
  counts as converged; a non-finite current norm counts as not converged, and non-finite norms
  never become the peak. Blocks already frozen count as converged, so a converged block after a
  not-yet-converged one is not frozen.
* A manual override is combined with the automatic decision of the decision point it is applied
  at, never replacing it with less: the new boundary is `max(automatic, requested)`. It is bounded
  by the model and the cap only (not by alpha): `requested <= L - keep_trainable`. Its outcome is
  recorded honestly: `applied` (it moved the boundary past what the policy decided), `superseded`
  (the boundary had already reached it, or the policy reached it at this decision point: a request
  filed at F=3 for 4 blocks and read when the schedule moves to 4 freezes nothing extra and does
  not cost the automatic step) or `rejected` (malformed, or beyond the cap; the automatic
  decision still applies).

* `noise`: a block has settled at decision point T when its gradient over the interval is mostly
  noise: `||sum_t g_t|| <= noise_ratio * sqrt(sum_t ||g_t||^2)` over the interval's steps t (the
  caller passes the ratio `drift_T = ||sum g|| / sqrt(sum ||g||^2)` per block). For independent
  zero-mean steps E||sum g||^2 = sum E||g||^2, so pure noise gives about 1 whatever the norms'
  scale; a steady direction d under noise s gives about sqrt((n d^2 + s^2) / (d^2 + s^2)), up to
  sqrt(n). It has no memory, and a non-finite ratio counts as not settled.

* `output` (what a block computes, not its gradient): the caller runs a fixed probe batch (the
  first global batch of the held-out rows, the same rows whatever the layout) through the model at
  the start of a run and at every decision point, and keeps a sketch of each block's output. A
  block's *output rate* over the interval is the relative change of its output since the last
  probe, per unit of learning rate spent in between: `r_T = ||h_T - h_prev|| / ||h_prev|| /
  sum_t lr_t`. A block has settled when `r_T <= output_ratio * max(r_1 .. r_T)`: it moves at most
  that fraction as fast as it did when it moved fastest. Three properties follow. (1) A block's
  output depends on every block below it, so a block whose inputs still change (a lower block
  re-initialised, or still learning) keeps moving and is not frozen: the prefix rule freezes
  what has stopped moving as a whole. (2) Per unit of learning rate: Adam moves weights by about
  lr per step in the direction the gradients agree on, so a decaying learning rate slows the
  output of a block that has not converged in proportion to lr and leaves `r` where it was; only
  a block whose steps stop agreeing (converged: noise moves it back and forth) slows per unit of
  lr. (3) Against its own peak, as `decay` is: the scale of a block's output and of its
  movement differ by block and model, its fastest interval does not. Egeria (EuroSys 2023)
  freezes on the same kind of signal, a layer's output against a reference copy of the model;
  here the reference is the model itself one interval earlier, which needs no second copy. A
  non-finite rate (no probe before this interval) counts as not settled.

The gradient statistic `n_T` of a block is the **mean over the interval's optimizer steps of the
block's per-step gradient L2 norm**, taken on the global-batch gradient (after the cross-replica
all-reduce, before clipping), over all the block's parameters (`GradNormMeter` accumulates it).
It costs one scalar per block per step, and, computed on the all-reduced gradient, it is the same
on every replica and independent of the layout; the mean (not the sum) makes intervals of
different lengths (a short last interval of an epoch) comparable.

Why "decayed below a fraction of its peak" (a per-block relative gradient tolerance, the classic
first-order stopping test `||g|| <= rtol * ||g_ref||`, with the block's own peak as the reference
because a block's gradient often grows before it shrinks: block 0 of the digits ViT peaks at
epochs 2-5) rather than PipeTransformer's "norm changed by less than a threshold since the
previous decision point". Measured on the digits ViT (single-process simulation of the job, seeds
0-7, 20 epochs; the real benchmark, bench/elastic_speedup.py, agrees):

* The per-step block norms are noisy (coefficient of variation 0.2-2), so the mean over an
  epoch's 23 steps has a 5-20 % standard error, and the relative change between two such means is
  mostly noise at a 10 % threshold. Meanwhile the norms of all blocks fall together by 10-30 % per
  epoch until the training set is fitted (epochs 14-17), where they drop 10-50x. The change test
  therefore passes only at random plateaus: it froze 4-5 blocks at epochs 10-11 (cost 1-2 pp of
  held-out accuracy in the real benchmark) or never (seed 0). Noise-aware variants (change within
  1-2 standard errors) and EMA-smoothed norms pass by chance in the same way, at epochs 3-10
  (or, after an 8-epoch warm-up, mostly at 9-13).
* Freezing before that collapse costs accuracy on this model whatever the schedule: freezing just
  the embedding and block 0 at epoch 10 cost 1.2 pp (mean of 3 seeds), 3 blocks at epoch 13
  0.9 pp, 5 blocks at epoch 14 0.8 pp, while 5 blocks at epoch 15 or 16 cost 0.2-0.3 pp; timing
  mattered, the number of blocks hardly.
* A level test against the peak is robust to that noise (a 5x margin at threshold 0.2 against a
  ~10 % error) and fires inside the collapse: threshold 0.2 froze 5 blocks at epochs 13-16 on
  seeds 0-7 for a mean change of -0.2 pp held-out accuracy (threshold 0.1: an epoch later,
  -0.3 pp); about the spread that float summation order alone causes in one seed's final
  accuracy (up to 0.6 pp). In the real benchmark (seeds 0-2) it froze 5 blocks at epochs 14-16
  for -0.4 pp.

Why two criteria: fine-tuning (measured for bench/paper.py: a ViT of 8 blocks pretrained on digits
0-4, fine-tuned with a new head on digits 5-9, 10 epochs) never freezes under `decay`. The mean
step norms of blocks 1-7 *rise* 3-5x over the run (0.04-0.06 in epoch 1 to 0.17-0.40 in epoch 10)
while the fresh head's weights grow and pass more of the loss back into the body, so each epoch
sets a new peak and nothing decays to 0.2 of it. The level of a block's gradient says how much
loss signal reaches it, not whether it still has somewhere to go. Over the same run the drift
ratio above is near the noise level from the first epochs on (the interval's summed gradient over
its mean step norm, `||sum g|| / sum ||g||`, is 0.16-0.24 in epoch 1 and 0.08-0.18 from epoch 2,
against 1/sqrt(45 steps) = 0.15 for pure noise): the pretrained blocks have settled and only noise
moves them, which is the regime PipeTransformer freezes in from its second epoch. Training from
scratch, `decay` stays the default: there the drift is also near noise level long before the
blocks stop changing what they compute (batch noise dominates every step), and freezing before
the collapse measured below costs accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pipetransformer.core.spec import FreezeSpec

Source = Literal["auto", "manual", "none"]
Policy = Literal["output", "gradient", "schedule", "off"]
# what `policy: auto` runs: the rule that held accuracy best in the policy comparison, seeds 3-12
# (bench/paper.py --policies; docs/benchmarks.md, "Freeze rules side by side")
AUTO_POLICY: Policy = "output"
Criterion = Literal["decay", "noise"]
OverrideOutcome = Literal["applied", "superseded", "rejected"]

# Float guard for the ceiling in the alpha-bound: 10 * (1 - 0.7) is 3.0000000000000004 in binary
# floating point and must give 3, not 4. Values within this of an integer count as that integer.
_CEIL_EPS = 1e-9


class FreezeOverrideError(ValueError):
    """A manual freeze override was rejected; the message names the field and the allowed range."""


def alpha_bound(alpha: float, num_blocks: int, decisions: int) -> int:
    """The most blocks an automatic decision may have frozen after `decisions` (T) decision
    points: `ceil(L * (1 - (1 - alpha)^T))`, within 0 .. L. T = 0 gives 0; T = 1 is the first
    decision point. Not clipped by keep_trainable (see `automatic_cap`)."""
    if not 0 < alpha < 1:
        raise ValueError(f"freeze.alpha must be in (0, 1), got {alpha!r}")
    if num_blocks < 0 or decisions < 0:
        raise ValueError(f"num_blocks and decisions must be >= 0, got {num_blocks} and {decisions}")
    exact = num_blocks * (1.0 - (1.0 - alpha) ** decisions)
    return min(num_blocks, max(0, math.ceil(exact - _CEIL_EPS)))


def max_boundary(num_blocks: int, keep_trainable: int) -> int:
    """The cap: the boundary may never exceed `L - keep_trainable` (never below 0)."""
    return max(0, num_blocks - keep_trainable)


def automatic_cap(spec: FreezeSpec, num_blocks: int, decisions: int) -> int:
    """The highest boundary an automatic decision may reach at decision point T = `decisions`:
    min(alpha-bound(T - warmup_decisions), L - keep_trainable); 0 during warm-up."""
    after_warmup = max(0, decisions - spec.warmup_decisions)
    return min(
        alpha_bound(spec.alpha, num_blocks, after_warmup),
        max_boundary(num_blocks, spec.keep_trainable),
    )


def policy_in_force(spec: FreezeSpec) -> Policy:
    """The policy a job runs: the spec's, or for 'auto' `AUTO_POLICY`."""
    return AUTO_POLICY if spec.policy == "auto" else spec.policy


def settle_criterion(spec: FreezeSpec, from_trained: bool) -> Criterion:
    """The gradient policy's criterion in force: the spec's, or for 'auto' `noise` when the job
    starts from trained weights (`from_trained`: a pretrained model or an init checkpoint) and
    `decay` when it trains from a seeded initialisation."""
    if spec.criterion != "auto":
        return spec.criterion
    return "noise" if from_trained else "decay"


def settled_prefix(drift: Sequence[float], noise_ratio: float, boundary: int = 0) -> int:
    """Criterion `noise`: the longest prefix of blocks whose drift ratio is at most
    `noise_ratio` (blocks below `boundary`, already frozen, count as settled; a non-finite ratio
    does not)."""
    n = boundary
    while n < len(drift) and math.isfinite(drift[n]) and drift[n] <= noise_ratio:
        n += 1
    return n


def apply_override(current: int, requested: int, num_blocks: int, keep_trainable: int) -> int:
    """Validate a manual override of the freeze boundary and return the new boundary.

    Allowed: `current <= requested <= num_blocks - keep_trainable` (only forward, within the model,
    keeping the last `keep_trainable` blocks trainable; not bounded by alpha). Anything else raises
    `FreezeOverrideError` naming the field (`layers`) and the allowed range."""
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise FreezeOverrideError(
            f"layers must be an integer number of blocks to freeze, got {requested!r}"
        )
    top = max_boundary(num_blocks, keep_trainable)
    allowed = f"allowed: {current}..{top}" if current <= top else "no further freezing is allowed"
    where = (
        f"(model has {num_blocks} blocks, freeze.keep_trainable={keep_trainable}, "
        f"current boundary {current}; {allowed})"
    )
    if requested < 0:
        raise FreezeOverrideError(f"layers must be >= 0, got {requested} {where}")
    if requested < current:
        raise FreezeOverrideError(
            f"layers={requested} is below the current freeze boundary {current}: the boundary "
            f"may only move forward {where}"
        )
    if requested > top:
        raise FreezeOverrideError(
            f"layers={requested} exceeds {top} = blocks - freeze.keep_trainable: the last "
            f"{keep_trainable} block(s) must stay trainable {where}"
        )
    return requested


def _norms_json(norms: tuple[float, ...] | None) -> list[float | None] | None:
    return None if norms is None else [n if math.isfinite(n) else None for n in norms]


def _norms_from_json(raw: Any, field: str) -> tuple[float, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
        raise ValueError(f"FreezeState.{field} must be a list or null, got {raw!r}")
    out = []
    for i, n in enumerate(raw):
        if n is None:
            out.append(math.nan)
        elif isinstance(n, int | float) and not isinstance(n, bool):
            out.append(float(n))
        else:
            raise ValueError(f"FreezeState.{field}[{i}] must be a number, got {n!r}")
    return tuple(out)


def _check_count(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class FreezeState:
    """AutoFreeze policy state carried between decision points (goes into checkpoints and etcd).

    It does not hold the freeze boundary: that belongs to the layout in force, and `decide` takes
    it as an argument. `decisions`: decision points taken so far (T of the last one).
    `last_norms`: the per-block gradient norms recorded at the last decision point (NaN where
    unknown), or None. `peak_norms`: per block, the largest finite norm recorded at any decision
    point so far (NaN while none), or None when unknown (a state written before peaks were kept:
    the `gradient` policy then takes `last_norms` as the peak so far, which can only delay
    freezing, never hasten it). `output_peaks`: policy `output`'s memory, per block the fastest
    output rate recorded so far (NaN while none), or None."""

    decisions: int = 0
    last_norms: tuple[float, ...] | None = None
    peak_norms: tuple[float, ...] | None = None
    output_peaks: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _check_count(self.decisions, "FreezeState.decisions")

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-serialisable dict (non-finite norms become None). No "boundary": the
        boundary is the layout's, recorded with it."""
        out: dict[str, Any] = {
            "decisions": self.decisions,
            "last_norms": _norms_json(self.last_norms),
            "peak_norms": _norms_json(self.peak_norms),
        }
        if self.output_peaks is not None:  # policy 'output' only: other states keep their form
            out["output_peaks"] = _norms_json(self.output_peaks)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FreezeState:
        """Inverse of `to_dict`; raises ValueError naming the field on malformed input. Every
        field is optional (a state saved before `peak_norms` existed loads with None).

        Legacy: states written by earlier versions (checkpoint metadata, etcd) also have a
        "boundary" key. It is accepted, checked to be an integer >= 0 like any other field, and
        then ignored: the boundary in force is the layout's (which such a checkpoint records too),
        so the key is not carried and `to_dict` does not write it back. Other unknown keys are
        rejected."""
        if not isinstance(data, Mapping):
            raise ValueError(f"FreezeState must be a mapping, got {type(data).__name__}")
        fields = {"boundary", "decisions", "last_norms", "peak_norms", "output_peaks"}
        unknown = set(data) - fields
        if unknown:
            raise ValueError(f"FreezeState: unknown field(s) {sorted(unknown)}")
        if "boundary" in data:  # legacy key: validated, then dropped
            _check_count(data["boundary"], "FreezeState.boundary")
        return cls(
            decisions=data.get("decisions", 0),
            last_norms=_norms_from_json(data.get("last_norms"), "last_norms"),
            peak_norms=_norms_from_json(data.get("peak_norms"), "peak_norms"),
            output_peaks=_norms_from_json(data.get("output_peaks"), "output_peaks"),
        )


@dataclass(frozen=True)
class FreezeDecision:
    """The outcome of one decision point.

    `state`: the policy state to carry on to the next decision point. `boundary`: the new boundary
    (the caller's layout must move to it; it is the `boundary` to pass to the next `decide`).
    `previous`: the boundary before (the `boundary` this decision was taken at). `source`:
    "manual" (an override moved the boundary past the automatic decision), "auto" (the policy moved
    the boundary forward) or "none".
    `proposed`: what the policy alone proposed before clipping (the converged prefix, or the
    alpha-bound for `schedule`; == previous for `off` and during warm-up). `bound`: the automatic
    cap at this decision point, min(alpha-bound, L - keep_trainable). `reason`: for the audit log.
    `override`: what became of a manual request read at this decision point (None: there was
    none), with `override_reason` saying why. `signal` and `limits`: per block, the statistic the
    policy read at this decision point and the value at or below which a block counts as settled
    (None for `schedule` and `off`, which read none); what the dashboard draws as each block's
    distance from its threshold."""

    state: FreezeState
    boundary: int
    previous: int
    source: Source
    proposed: int
    bound: int
    reason: str
    override: OverrideOutcome | None = None
    override_reason: str = ""
    signal: tuple[float, ...] | None = None
    limits: tuple[float, ...] | None = None

    @property
    def changed(self) -> bool:
        return self.boundary != self.previous


def update_peaks(peaks: Sequence[float] | None, current: Sequence[float]) -> tuple[float, ...]:
    """Per block, the larger of the peak so far and the current norm. Non-finite values never
    become the peak; NaN where no finite norm has been seen yet."""
    if peaks is None:
        peaks = [math.nan] * len(current)
    out = []
    for p, c in zip(peaks, current, strict=True):
        finite = [x for x in (p, c) if math.isfinite(x)]
        out.append(max(finite) if finite else math.nan)
    return tuple(out)


def has_decayed(peak: float, current: float, threshold: float) -> bool:
    """Whether a block's current norm has decayed to at most `threshold` times its peak
    (`current <= threshold * peak`; 0 at a peak of 0 counts). A non-finite current norm or an
    unknown (NaN) peak: False."""
    if not (math.isfinite(current) and math.isfinite(peak)):
        return False
    return current <= threshold * peak


def converged_prefix(
    peaks: Sequence[float],
    current: Sequence[float],
    threshold: float,
    boundary: int = 0,
) -> int:
    """The length of the longest prefix of blocks that have converged: blocks below `boundary`
    (already frozen) count as converged; block i >= boundary has converged when
    `has_decayed(peaks[i], current[i], threshold)`. `peaks` must already include `current`
    (see `update_peaks`)."""
    n = boundary
    while n < len(current) and has_decayed(peaks[n], current[n], threshold):
        n += 1
    return n


def _check_norms(norms: Sequence[float], num_blocks: int) -> tuple[float, ...]:
    if len(norms) != num_blocks:
        raise ValueError(
            f"block_grad_norms has {len(norms)} entries; expected one per block ({num_blocks})"
        )
    out = tuple(float(n) for n in norms)
    for i, n in enumerate(out):
        if n < 0:  # NaN compares False: a non-finite norm is allowed and counts as not converged
            raise ValueError(f"block_grad_norms[{i}] is a norm and cannot be negative, got {n}")
    return out


def _check_rates(rates: Sequence[float], num_blocks: int) -> tuple[float, ...]:
    if len(rates) != num_blocks:
        raise ValueError(
            f"output_rates has {len(rates)} entries; expected one per block ({num_blocks})"
        )
    out = tuple(float(r) for r in rates)
    for i, r in enumerate(out):
        if r < 0:  # NaN compares False: an unknown rate is allowed and counts as not settled
            raise ValueError(
                f"output_rates[{i}] is a rate of change and cannot be negative, got {r}"
            )
    return out


def output_rate(change: float, reference: float, lr_sum: float) -> float:
    """Policy `output`'s statistic for one block: the relative change of its output
    (`change` = ||h - h_prev||, `reference` = ||h_prev||) per unit of learning rate spent in the
    interval (`lr_sum`). NaN when it cannot be known (no steps or no learning rate in between, a
    zero or non-finite reference)."""
    if not (lr_sum > 0 and math.isfinite(lr_sum)):
        return math.nan
    if not (reference > 0 and math.isfinite(reference) and math.isfinite(change)):
        return math.nan
    return change / reference / lr_sum


def decide(
    spec: FreezeSpec,
    state: FreezeState,
    block_grad_norms: Sequence[float] | None,
    num_blocks: int,
    *,
    boundary: int,
    override: int | None = None,
    drift: Sequence[float] | None = None,
    from_trained: bool = False,
    output_rates: Sequence[float] | None = None,
) -> FreezeDecision:
    """Take one decision point (T = state.decisions + 1) and return the new boundary and state.

    `boundary`: the freeze boundary in force (blocks 0 .. boundary-1 are frozen), which the caller
    takes from its layout (`Layout.freeze_boundary`); `state` does not carry it. It must be an
    integer in 0 .. num_blocks.
    `block_grad_norms`: one gradient norm per block for the interval since the last decision point
    (see the module docstring for the definition; entries of frozen blocks are ignored); required
    by the `gradient` policy, optional otherwise. The policy's proposal is clipped by
    min(alpha-bound(T), num_blocks - keep_trainable) and never goes below the current boundary.
    `override`: a manual boundary request; the boundary becomes the larger of it and the automatic
    decision (`combine_override`), and the decision says whether it was applied, superseded or
    rejected. `drift`: one drift ratio per block for the interval (criterion `noise`, required
    there); `from_trained` resolves criterion 'auto' (`settle_criterion`). `output_rates`: one
    output rate per block for the interval (policy `output`, required there; NaN where unknown).
    The returned state records T, the norms (or None), the per-block peaks including them, and
    the output rates' peaks."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    if isinstance(boundary, bool) or not isinstance(boundary, int):
        raise ValueError(f"freeze boundary must be an integer, got {boundary!r}")
    if not 0 <= boundary <= num_blocks:
        raise ValueError(f"freeze boundary {boundary} is outside a model of {num_blocks} blocks")
    policy = policy_in_force(spec)
    norms = None if block_grad_norms is None else _check_norms(block_grad_norms, num_blocks)
    if policy == "gradient" and norms is None:
        raise ValueError("freeze.policy 'gradient' needs block_grad_norms at every decision point")
    rates = None if output_rates is None else _check_rates(output_rates, num_blocks)
    if policy == "output" and rates is None:
        raise ValueError("freeze.policy 'output' needs output_rates at every decision point")
    for name in ("last_norms", "peak_norms", "output_peaks"):
        recorded = getattr(state, name)
        if recorded is not None and len(recorded) != num_blocks:
            raise ValueError(
                f"FreezeState.{name} has {len(recorded)} entries but the model has "
                f"{num_blocks} blocks"
            )
    known = state.peak_norms if state.peak_norms is not None else state.last_norms
    peaks = state.peak_norms if norms is None else update_peaks(known, norms)
    out_peaks = state.output_peaks if rates is None else update_peaks(state.output_peaks, rates)

    current = boundary
    t = state.decisions + 1
    bound = automatic_cap(spec, num_blocks, t)

    # what the policy reads, per block, and where a block counts as settled (for the record
    # and the dashboard, during warm-up too)
    signal: tuple[float, ...] | None = None
    limits: tuple[float, ...] | None = None
    criterion = settle_criterion(spec, from_trained)
    if policy == "output":
        assert rates is not None and out_peaks is not None
        signal, limits = rates, tuple(spec.output_ratio * p for p in out_peaks)
    elif policy == "gradient" and criterion == "noise":
        if drift is None or len(drift) != num_blocks:
            raise ValueError(
                f"freeze.criterion 'noise' needs one drift ratio per block ({num_blocks}) at "
                "every decision point"
            )
        signal = tuple(float(d) for d in drift)
        limits = (float(spec.noise_ratio),) * num_blocks
    elif policy == "gradient":
        assert norms is not None and peaks is not None
        signal, limits = norms, tuple(spec.threshold * p for p in peaks)

    if policy == "off":
        proposed, why = current, "policy 'off'"
    elif t <= spec.warmup_decisions:
        proposed, why = current, f"warm-up ({t} of {spec.warmup_decisions} decision points)"
    elif policy == "schedule":
        proposed = alpha_bound(spec.alpha, num_blocks, t - spec.warmup_decisions)
        why = f"schedule: alpha-bound {proposed}"
    elif policy == "output":
        assert rates is not None and out_peaks is not None
        proposed = converged_prefix(out_peaks, rates, spec.output_ratio, current)
        why = (
            f"settled prefix {proposed} (output moving <= {spec.output_ratio:g} x its fastest, "
            "per unit of learning rate)"
        )
    elif criterion == "noise":
        assert signal is not None
        proposed = settled_prefix(signal, spec.noise_ratio, current)
        why = f"settled prefix {proposed} (gradient drift <= {spec.noise_ratio:g} x its noise)"
    else:
        assert norms is not None and peaks is not None
        proposed = converged_prefix(peaks, norms, spec.threshold, current)
        why = f"converged prefix {proposed} (gradient norm <= {spec.threshold:g} x its peak)"

    new = max(current, min(proposed, bound))
    new_state = FreezeState(t, norms, peaks, out_peaks)
    if new > current:
        clip = f", clipped to {bound}" if proposed > bound else ""
        reason = f"decision {t}: {why}{clip}: froze blocks {current}..{new - 1}"
        source: Source = "auto"
    else:
        reason = f"decision {t}: {why}: boundary stays {current}"
        source = "none"
    auto = FreezeDecision(
        new_state, new, current, source, proposed, bound, reason, signal=signal, limits=limits
    )
    if override is None:
        return auto
    return combine_override(auto, override, num_blocks, spec.keep_trainable)


def combine_override(
    auto: FreezeDecision, requested: Any, num_blocks: int, keep_trainable: int
) -> FreezeDecision:
    """A decision point's automatic decision `auto` with a manual request for `requested` blocks
    read at it: the boundary becomes max(automatic, requested), so a request can only add to what
    the policy decided, never take its place.

    - `rejected`: not a whole number of blocks in 0 .. L - keep_trainable (`apply_override`'s
      message); the automatic decision stands.
    - `superseded`: requested <= the automatic boundary (the boundary was already there, or the
      policy reached it at this very decision point); the automatic decision stands.
    - `applied`: requested > the automatic boundary; the boundary moves to it (source "manual").

    Only the boundary, source, reason and override fields change: the policy state (`auto.state`)
    is the same whatever becomes of the request."""
    t, current = auto.state.decisions, auto.previous
    try:
        apply_override(current, requested, num_blocks, keep_trainable)
    except FreezeOverrideError as exc:
        behind = type(requested) is int and 0 <= requested < current
        if not behind:  # a request filed forward that the boundary has since passed is not bad
            return replace(auto, override="rejected", override_reason=str(exc))
    if requested <= auto.boundary:
        if requested <= current:
            where = f"the boundary was already {current}"
        else:
            where = f"the automatic decision reached {auto.boundary} at this decision point"
        why = f"layers={requested} superseded at decision {t}: {where} ({auto.reason})"
        return replace(auto, override="superseded", override_reason=why)
    reason = (
        f"manual override at decision {t}: moved boundary {current} -> {requested} "
        f"(automatic decision: {auto.boundary})"
    )
    return replace(
        auto,
        boundary=requested,
        source="manual",
        reason=reason,
        override="applied",
        override_reason=reason,
    )


def is_decision_point(spec: FreezeSpec, steps_done: int, end_of_epoch: bool) -> bool:
    """Whether a decision point falls here: after the last step of every epoch (`every: epoch`),
    or after every K-th optimizer step counted over the whole job (`every: K`)."""
    if spec.every == "epoch":
        return end_of_epoch
    return steps_done > 0 and steps_done % spec.every == 0


class GradNormMeter:
    """Accumulates the per-block gradient statistic between decision points: the mean, over the
    interval's optimizer steps, of each block's per-step gradient L2 norm. Pure (plain floats)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._sums = [0.0] * num_blocks
        self.steps = 0

    def add(self, step_norms: Sequence[float]) -> None:
        """Record one optimizer step's per-block gradient norms (0 for frozen blocks)."""
        if len(step_norms) != self.num_blocks:
            raise ValueError(
                f"expected {self.num_blocks} block norms per step, got {len(step_norms)}"
            )
        for i, n in enumerate(step_norms):
            self._sums[i] += float(n)
        self.steps += 1

    def means(self) -> tuple[float, ...]:
        """The per-block mean norm over the steps recorded (NaN for every block if none)."""
        if not self.steps:
            return (math.nan,) * self.num_blocks
        return tuple(s / self.steps for s in self._sums)

    def reset(self) -> None:
        self._sums = [0.0] * self.num_blocks
        self.steps = 0

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-serialisable dict (a non-finite sum becomes None)."""
        sums = [s if math.isfinite(s) else None for s in self._sums]
        return {"sums": sums, "steps": self.steps}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GradNormMeter:
        """Inverse of `to_dict`."""
        sums = [math.nan if s is None else float(s) for s in data["sums"]]
        meter = cls(len(sums))
        meter._sums, meter.steps = sums, int(data["steps"])
        return meter
