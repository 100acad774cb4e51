"""Partition planning (AutoPipe): the even split, the cost model, and the search for which
contiguous block ranges each pipeline stage runs with how many replicas and micro-batches. Pure
and deterministic: no torch, no I/O. Which of these a job uses when (a spec's initial layout, a
re-formed world, a measured plan) is `core.planner`; measurements come from `trainer.profile`.

Cost model (all times are per micro-batch of `b = global_batch / (R * m)` samples)
------------------------------------------------------------------------------------
A model is an embedding (pinned to the first stage), L blocks (the partition units: a cut falls
between blocks, never inside a residual connection) and a head (pinned to the last stage). Blocks
[0, F) are frozen.

* Compute of a unit: trainable -> forward + backward (+ forward again with `recompute`);
  frozen -> forward only (no gradient flows into the frozen prefix); frozen with `cached` (AutoCache
  serves the frozen prefix's output) -> 0, for the embedding too. The embedding is frozen iff F > 0.
* Transfer at a cut after block j: the activation forward and, if anything before the cut trains
  (j >= F), the same-size gradient backward: `output_bytes[j] * (2 if j >= F else 1) / bandwidth`.
  Point-to-point sends and receives are blocking in a synchronous pipeline, so a stage pays the
  transfers on both of its boundaries.
* Stage time `t_s = compute(stage) + transfer(in cut) + transfer(out cut)`; bottleneck
  `T = max_s t_s`. The DP below minimises T over contiguous ranges (PipeDream's planner);
  among splits with the same T it keeps the most slack in the other stages (leximax).
* Step time `(m + S - 1) * T + A`: GPipe's fill-drain, i.e. a bubble fraction `(S-1)/(m+S-1)`
  (1F1B has the same bubble and only holds fewer activations), plus the gradient all-reduce over
  R replicas, a ring `2 (R-1)/R * trainable_param_bytes(stage) / bandwidth` for the largest stage
  (stages reduce concurrently). The optimizer step is not modelled.
* Memory of a stage (per device): weights `param_bytes * optimizer_factor` for trainable units
  (4 by default: weight, gradient and Adam's two moments) and `param_bytes` for frozen ones, plus
  activations of trainable units times the micro-batches in flight: `m` for GPipe (every forward
  runs before any backward), `min(m, S - s)` for 1F1B on stage s; other schedules are counted like
  GPipe (an upper bound). With `recompute`, a trainable block keeps only its input per micro-batch,
  plus one block's full activations while it is recomputed. Frozen units keep no activations.

(S, R, m) are searched with S * R <= devices, R dividing the global batch and m dividing the
replica batch; m defaults to the divisors in [S, 6S] (PipeTransformer's search range), or all
divisors when none lies there. The lowest predicted step time wins; ties go to fewer stages, then
more replicas, then fewer micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from pipetransformer.core.state import Layout, StageLayout


class PlanError(ValueError):
    """No layout satisfies the request; the message carries the numbers (needed vs available)."""


# ----------------------------------------------------------------------------------------------
# Splits by block count


def uniform_partition(num_blocks: int, stages: int) -> list[tuple[int, int]]:
    """The even split: equal block counts per stage, earlier stages taking the remainder
    (10 blocks on 4 stages: 3, 3, 2, 2). A spec's initial layout and a re-formed world's layout
    use it (`parallel.partition: uniform` promises it)."""
    if not 1 <= stages <= num_blocks:
        raise PlanError(f"cannot split {num_blocks} blocks into {stages} non-empty stages")
    base, extra = divmod(num_blocks, stages)
    out, pos = [], 0
    for s in range(stages):
        n = base + (1 if s < extra else 0)
        out.append((pos, pos + n))
        pos += n
    return out


# ----------------------------------------------------------------------------------------------
# Profiles


@dataclass(frozen=True)
class BlockProfile:
    """Measured costs of one unit (a block, the embedding or the head) for one micro-batch."""

    forward_s: float
    backward_s: float
    output_bytes: int  # activation leaving the unit: what crosses a cut placed after it
    param_bytes: int
    activation_bytes: int  # tensors saved for backward (memory held per in-flight micro-batch)


def _lerp_block(lo: BlockProfile, hi: BlockProfile, w: float) -> BlockProfile:
    def f(a: float, b: float) -> float:
        return max(0.0, a + (b - a) * w)

    return BlockProfile(
        forward_s=f(lo.forward_s, hi.forward_s),
        backward_s=f(lo.backward_s, hi.backward_s),
        output_bytes=round(f(lo.output_bytes, hi.output_bytes)),
        param_bytes=lo.param_bytes,
        activation_bytes=round(f(lo.activation_bytes, hi.activation_bytes)),
    )


def _scale_block(p: BlockProfile, k: float) -> BlockProfile:
    return BlockProfile(
        p.forward_s * k,
        p.backward_s * k,
        round(p.output_bytes * k),
        p.param_bytes,
        round(p.activation_bytes * k),
    )


@dataclass(frozen=True)
class Profile:
    """Per-unit costs of a whole model at micro-batch size `microbatch` on `device`."""

    blocks: tuple[BlockProfile, ...]
    embed: BlockProfile
    head: BlockProfile
    microbatch: int
    device: str = "unknown"

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def to_dict(self) -> dict[str, Any]:
        def d(p: BlockProfile) -> dict[str, Any]:
            return dict(p.__dict__)

        return {
            "microbatch": self.microbatch,
            "device": self.device,
            "embed": d(self.embed),
            "head": d(self.head),
            "blocks": [d(b) for b in self.blocks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        return cls(
            blocks=tuple(BlockProfile(**b) for b in data["blocks"]),
            embed=BlockProfile(**data["embed"]),
            head=BlockProfile(**data["head"]),
            microbatch=int(data["microbatch"]),
            device=str(data.get("device", "unknown")),
        )


ProfileInput = Profile | Mapping[int, Profile]


def profile_at(profiles: ProfileInput, microbatch: int) -> Profile:
    """The profile at micro-batch size `microbatch`: the measured one if there is one; else
    interpolated (affinely, field by field) between the two nearest measured sizes, which keeps
    the fixed per-micro-batch overhead that small models have; with a single measurement, times
    and activation bytes are scaled in proportion (no fixed overhead known)."""
    if isinstance(profiles, Profile):
        profiles = {profiles.microbatch: profiles}
    if not profiles:
        raise PlanError("no profile given")
    if microbatch in profiles:
        return profiles[microbatch]
    sizes = sorted(profiles)
    if len(sizes) == 1:
        p = profiles[sizes[0]]
        k = microbatch / sizes[0]
        return Profile(
            tuple(_scale_block(b, k) for b in p.blocks),
            _scale_block(p.embed, k),
            _scale_block(p.head, k),
            microbatch,
            p.device,
        )
    below = [s for s in sizes if s < microbatch]
    above = [s for s in sizes if s > microbatch]
    if below and above:
        lo, hi = below[-1], above[0]
    elif above:  # extrapolate below the smallest measurement
        lo, hi = sizes[0], sizes[1]
    else:
        lo, hi = sizes[-2], sizes[-1]
    w = (microbatch - lo) / (hi - lo)
    a, b = profiles[lo], profiles[hi]
    if a.num_blocks != b.num_blocks:
        raise PlanError(f"profiles disagree on block count ({a.num_blocks} vs {b.num_blocks})")
    return Profile(
        tuple(_lerp_block(x, y, w) for x, y in zip(a.blocks, b.blocks, strict=True)),
        _lerp_block(a.embed, b.embed, w),
        _lerp_block(a.head, b.head, w),
        microbatch,
        a.device,
    )


def _num_blocks(profiles: ProfileInput) -> int:
    if isinstance(profiles, Profile):
        return profiles.num_blocks
    counts = {p.num_blocks for p in profiles.values()}
    if len(counts) != 1:
        raise PlanError(f"profiles disagree on block count: {sorted(counts)}")
    return counts.pop()


# ----------------------------------------------------------------------------------------------
# Stage costs under the model in the module docstring


@dataclass(frozen=True)
class CostModel:
    """What the cost of a stage depends on besides the profile (see the module docstring), and
    what a device can hold: one object that every caller of `plan` and `evaluate_partition`
    passes, instead of each repeating the same keyword arguments."""

    freeze_boundary: int = 0
    cached: bool = False
    bandwidth: float = math.inf  # bytes/s of a link (pipeline and all-reduce alike)
    schedule: str = "gpipe"
    recompute: bool = False
    optimizer_factor: float = 4.0  # weight + grad + Adam exp_avg + exp_avg_sq
    memory_cap: float = math.inf  # bytes per device that every stage must fit in (`plan` only)

    def in_flight(self, stage: int, stages: int, microbatches: int) -> int:
        """Micro-batches whose activations a stage holds at its peak."""
        if self.schedule == "1f1b":
            return min(microbatches, stages - stage)
        return microbatches


class StageCosts:
    """O(1) range queries of compute, transfer and weight memory for one profile + cost model."""

    def __init__(self, profile: Profile, model: CostModel):
        L, F = profile.num_blocks, model.freeze_boundary
        if not 0 <= F <= L:
            raise PlanError(f"freeze boundary {F} outside a model of {L} blocks")
        self.profile, self.model, self.L, self.F = profile, model, L, F
        bw = model.bandwidth

        def unit_time(p: BlockProfile, frozen: bool) -> float:
            if frozen:
                return 0.0 if model.cached else p.forward_s
            return p.forward_s + p.backward_s

        self.embed_time = unit_time(profile.embed, F > 0)
        self.head_time = unit_time(profile.head, False)
        times = [
            unit_time(b, j < F) + (b.forward_s if model.recompute and j >= F else 0.0)
            for j, b in enumerate(profile.blocks)
        ]
        weights = [
            b.param_bytes * (1.0 if j < F else model.optimizer_factor)
            for j, b in enumerate(profile.blocks)
        ]
        trainable = [0 if j < F else b.param_bytes for j, b in enumerate(profile.blocks)]
        self._t, self._w, self._p = _prefix(times), _prefix(weights), _prefix(trainable)
        # cut after block j (position j + 1): activation forward, gradient back if j trains
        self.cut_time = [
            0.0 if math.isinf(bw) else b.output_bytes * (2 if j >= F else 1) / bw
            for j, b in enumerate(profile.blocks)
        ]
        self.embed_weight = profile.embed.param_bytes * (1.0 if F > 0 else model.optimizer_factor)
        self.head_weight = profile.head.param_bytes * model.optimizer_factor

    def compute(self, a: int, c: int) -> float:
        t = self._t[c] - self._t[a]
        if a == 0:
            t += self.embed_time
        if c == self.L:
            t += self.head_time
        return t

    def transfer(self, a: int, c: int) -> float:
        t = 0.0
        if a > 0:
            t += self.cut_time[a - 1]
        if c < self.L:
            t += self.cut_time[c - 1]
        return t

    def time(self, a: int, c: int) -> float:
        return self.compute(a, c) + self.transfer(a, c)

    def trainable_param_bytes(self, a: int, c: int) -> float:
        n = self._p[c] - self._p[a]
        if a == 0 and self.F == 0:
            n += self.profile.embed.param_bytes
        if c == self.L:
            n += self.profile.head.param_bytes
        return n

    def activation_per_microbatch(self, a: int, c: int) -> float:
        p, F = self.profile, self.F
        act = 0.0
        if a == 0 and F == 0:
            act += p.embed.activation_bytes
        if c == self.L:
            act += p.head.activation_bytes
        trainable = range(max(a, F), c)
        if not self.model.recompute:
            return act + sum(p.blocks[j].activation_bytes for j in trainable)
        # re-materialisation keeps each block's input (the previous unit's output)
        for j in trainable:
            act += (p.blocks[j - 1] if j > 0 else p.embed).output_bytes
        return act

    def memory(self, a: int, c: int, in_flight: int) -> float:
        w = self._w[c] - self._w[a]
        if a == 0:
            w += self.embed_weight
        if c == self.L:
            w += self.head_weight
        mem = w + self.activation_per_microbatch(a, c) * in_flight
        if self.model.recompute and c > max(a, self.F):
            # one block's full activations exist while it is recomputed for its backward
            mem += max(self.profile.blocks[j].activation_bytes for j in range(max(a, self.F), c))
        return mem


def _prefix(values: Iterable[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


# ----------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class Plan:
    """A partition with its predicted costs (seconds per micro-batch, bytes per device)."""

    ranges: tuple[tuple[int, int], ...]
    replicas: int
    microbatches: int
    microbatch_size: int
    num_blocks: int
    freeze_boundary: int
    schedule: str
    stage_compute_s: tuple[float, ...]
    stage_transfer_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    allreduce_s: float
    method: str = "autopipe"

    @property
    def stages(self) -> int:
        return len(self.ranges)

    @property
    def stage_time_s(self) -> tuple[float, ...]:
        return tuple(
            c + t for c, t in zip(self.stage_compute_s, self.stage_transfer_s, strict=True)
        )

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's time per micro-batch, transfers at its boundaries included."""
        return max(self.stage_time_s)

    @property
    def bottleneck_stage(self) -> int:
        times = self.stage_time_s
        return times.index(max(times))

    @property
    def step_time_s(self) -> float:
        """(m + S - 1) * bottleneck + gradient all-reduce (see the module docstring)."""
        return (self.microbatches + self.stages - 1) * self.bottleneck_s + self.allreduce_s

    @property
    def devices(self) -> int:
        return self.stages * self.replicas

    def to_layout(self, version: int = 1, schedule: str | None = None) -> Layout:
        """The contract form: stage s of replica r runs on rank r * S + s."""
        S = self.stages
        return Layout(
            version=version,
            num_blocks=self.num_blocks,
            freeze_boundary=self.freeze_boundary,
            stages=[
                StageLayout(
                    index=s, start=a, end=b, ranks=[r * S + s for r in range(self.replicas)]
                )
                for s, (a, b) in enumerate(self.ranges)
            ],
            replicas=self.replicas,
            microbatches=self.microbatches,
            schedule=schedule or self.schedule,
        )

    def summary(self) -> str:
        ranges = "|".join(f"{a}-{b - 1}" for a, b in self.ranges)
        return (
            f"{self.method} {self.stages}x{self.replicas} [{ranges}] m={self.microbatches} "
            f"b={self.microbatch_size} F={self.freeze_boundary} "
            f"bottleneck={self.bottleneck_s * 1e3:.3f}ms (stage {self.bottleneck_stage}) "
            f"step={self.step_time_s * 1e3:.3f}ms"
        )


def _check_ranges(ranges: Sequence[tuple[int, int]], num_blocks: int) -> None:
    pos = 0
    for a, b in ranges:
        if a != pos or b <= a:
            raise PlanError(f"ranges {list(ranges)} are not contiguous and non-empty from 0")
        pos = b
    if pos != num_blocks:
        raise PlanError(f"ranges {list(ranges)} end at {pos}, model has {num_blocks} blocks")


def _microbatch_size(global_batch: int, replicas: int, microbatches: int) -> int:
    if global_batch % (replicas * microbatches):
        raise PlanError(
            f"global batch {global_batch} does not split into {replicas} replicas x "
            f"{microbatches} micro-batches"
        )
    return global_batch // (replicas * microbatches)


def _evaluate(
    costs: StageCosts,
    ranges: Sequence[tuple[int, int]],
    replicas: int,
    microbatches: int,
    method: str,
) -> Plan:
    S, bw = len(ranges), costs.model.bandwidth
    ring = 0.0
    if replicas > 1 and not math.isinf(bw):
        ring = max(
            2 * (replicas - 1) / replicas * costs.trainable_param_bytes(a, c) / bw
            for a, c in ranges
        )
    return Plan(
        ranges=tuple((int(a), int(c)) for a, c in ranges),
        replicas=replicas,
        microbatches=microbatches,
        microbatch_size=costs.profile.microbatch,
        num_blocks=costs.L,
        freeze_boundary=costs.F,
        schedule=costs.model.schedule,
        stage_compute_s=tuple(costs.compute(a, c) for a, c in ranges),
        stage_transfer_s=tuple(costs.transfer(a, c) for a, c in ranges),
        stage_memory_bytes=tuple(
            costs.memory(a, c, costs.model.in_flight(s, S, microbatches))
            for s, (a, c) in enumerate(ranges)
        ),
        allreduce_s=ring,
        method=method,
    )


def evaluate_partition(
    profile: ProfileInput,
    ranges: Sequence[tuple[int, int]],
    *,
    global_batch: int,
    replicas: int = 1,
    microbatches: int = 1,
    cost: CostModel | None = None,
    method: str = "given",
) -> Plan:
    """The predicted costs of a given partition under the module's cost model (memory is
    reported, not enforced: `cost.memory_cap` is ignored), so any method's split can be compared
    with the planner's."""
    L = _num_blocks(profile)
    _check_ranges(ranges, L)
    b = _microbatch_size(global_batch, replicas, microbatches)
    costs = StageCosts(profile_at(profile, b), cost or CostModel())
    return _evaluate(costs, ranges, replicas, microbatches, method)


def _allowed(L: int, allowed_cuts: Iterable[int] | None) -> tuple[int, ...]:
    if allowed_cuts is None:
        return tuple(range(1, L))
    cuts = sorted(set(allowed_cuts))
    bad = [c for c in cuts if not 0 < c < L]
    if bad:
        raise PlanError(
            f"allowed cuts {bad} are not between blocks of a {L}-block model (1..{L - 1})"
        )
    return tuple(cuts)


Ranges = tuple[tuple[int, int], ...]


def _best_ranges(
    costs: StageCosts,
    stages: int,
    microbatches: int,
    cuts: tuple[int, ...],
    memory_cap: float,
    objective: str = "time",
) -> tuple[float, Ranges] | None:
    """Min over contiguous partitions (cuts only at `cuts`) of the max stage time (or stage
    memory, for `objective="memory"`) among those whose every stage fits `memory_cap`; None if
    none fits. Returns (that max, the ranges).

    Ties on the maximum are broken by the next-largest stage, and so on (the stage values sorted
    in decreasing order, compared lexicographically): among equally slow bottlenecks the planner
    keeps the most slack elsewhere, which is what protects a plan against measurement noise.
    Inserting one stage's value into two sorted vectors keeps their order, so the DP stays exact.
    Values are compared in whole picoseconds (bytes for memory), so float rounding in sums cannot
    decide a tie; remaining ties go to the earliest cut."""
    L, model = costs.L, costs.model
    unit = 1.0 if objective == "memory" else 1e12

    def value(a: int, c: int, s: int) -> int:
        if objective == "memory":
            v = costs.memory(a, c, model.in_flight(s, stages, microbatches))
        else:
            v = costs.time(a, c)
        return round(v * unit)

    def fits(a: int, c: int, s: int) -> bool:
        return costs.memory(a, c, model.in_flight(s, stages, microbatches)) <= memory_cap

    @cache
    def best(i: int, k: int) -> tuple[tuple[int, ...], Ranges] | None:
        s = stages - k
        if k == 1:
            return ((value(i, L, s),), ((i, L),)) if fits(i, L, s) else None
        found: tuple[tuple[int, ...], Ranges] | None = None
        for j in cuts:
            if j <= i:
                continue
            if not fits(i, j, s):
                break  # memory only grows as the stage takes more blocks
            rest = best(j, k - 1)
            if rest is None:
                continue
            key = tuple(sorted((value(i, j, s), *rest[0]), reverse=True))
            if found is None or key < found[0]:
                found = (key, ((i, j), *rest[1]))
        return found

    result = best(0, stages)
    if result is None:
        return None
    return result[0][0] / unit, result[1]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_candidates(stages: int, replica_batch: int) -> list[int]:
    """Divisors of the replica batch in [S, 6S] (PipeTransformer's search range for M); all
    divisors if none lies there."""
    divs = _divisors(replica_batch)
    inside = [d for d in divs if stages <= d <= 6 * stages]
    return inside or divs


def _as_list(value: int | Sequence[int] | None, default: Iterable[int]) -> list[int]:
    if value is None:
        return list(default)
    if isinstance(value, int):
        return [value]
    return list(value)


def plan(
    profile: ProfileInput,
    *,
    devices: int,
    global_batch: int,
    cost: CostModel | None = None,
    microbatches: Sequence[int] | None = None,
    stages: int | Sequence[int] | None = None,
    replicas: int | Sequence[int] | None = None,
    allowed_cuts: Iterable[int] | None = None,
) -> Plan:
    """AutoPipe: the (S, R, m, partition) with the lowest predicted step time whose every stage
    fits `cost.memory_cap` bytes, on at most `devices` devices (cost model: module docstring;
    `cost` defaults to `CostModel()`: nothing frozen, free links, GPipe, no memory cap).

    `profile` is one measured `Profile` or several keyed by micro-batch size (the planner then
    uses the measurement at each candidate's micro-batch size, interpolating between sizes).
    `stages`, `replicas` and `microbatches` restrict the search; `allowed_cuts` restricts the
    cut positions (a cut at p separates block p-1 from block p) for units larger than a block.
    Raises PlanError, with the numbers, when nothing fits."""
    L = _num_blocks(profile)
    if devices < 1:
        raise PlanError(f"need at least one device, got {devices}")
    if global_batch < 1:
        raise PlanError(f"global batch must be positive, got {global_batch}")
    cuts = _allowed(L, allowed_cuts)
    model = cost or CostModel()
    memory_cap = model.memory_cap
    stage_options = [
        s for s in _as_list(stages, range(1, devices + 1)) if 1 <= s <= min(devices, len(cuts) + 1)
    ]
    if not stage_options:
        raise PlanError(
            f"no stage count fits: asked for {stages}, with {devices} devices and "
            f"{len(cuts) + 1} partition units"
        )
    by_size: dict[int, StageCosts] = {}

    def costs_at(b: int) -> StageCosts:
        if b not in by_size:
            by_size[b] = StageCosts(profile_at(profile, b), model)
        return by_size[b]

    best: tuple[tuple[float, int, int, int], Plan] | None = None
    tried: list[tuple[int, int, int]] = []
    for S in stage_options:
        for R in _as_list(replicas, range(1, devices // S + 1)):
            if R < 1 or S * R > devices or global_batch % R:
                continue
            replica_batch = global_batch // R
            ms = _as_list(microbatches, microbatch_candidates(S, replica_batch))
            for m in ms:
                if m < 1 or replica_batch % m:
                    continue
                tried.append((S, R, m))
                costs = costs_at(replica_batch // m)
                found = _best_ranges(costs, S, m, cuts, memory_cap)
                if found is None:
                    continue
                p = _evaluate(costs, found[1], R, m, "autopipe")
                key = (p.step_time_s, S, -R, m)
                if best is None or key < best[0]:
                    best = (key, p)
    if best is not None:
        return best[1]
    if not tried:
        raise PlanError(
            f"no (stages, replicas, micro-batches) combination divides global batch "
            f"{global_batch} on {devices} devices (stages {stage_options}, replicas {replicas}, "
            f"micro-batches {microbatches})"
        )
    raise _memory_error(tried, costs_at, global_batch, cuts, memory_cap)


def _memory_error(
    tried: list[tuple[int, int, int]],
    costs_at: Any,
    global_batch: int,
    cuts: tuple[int, ...],
    memory_cap: float,
) -> PlanError:
    """Explain infeasibility with the least memory-hungry configuration tried: its per-stage
    needs under the split that minimises the largest stage's memory."""
    report = None
    for S, R, m in tried:
        costs = costs_at(global_batch // (R * m))
        found = _best_ranges(costs, S, m, cuts, math.inf, objective="memory")
        if found is not None and (report is None or found[0] < report[0]):
            report = (found[0], S, R, m, costs, found[1])
    assert report is not None  # with an infinite cap every tried configuration has a split
    peak, S, R, m, costs, ranges = report
    needs = [costs.memory(a, c, costs.model.in_flight(s, S, m)) for s, (a, c) in enumerate(ranges)]
    per_stage = ", ".join(
        f"stage {s} blocks {a}-{c - 1}: {need:,.0f} B" + (" (over)" if need > memory_cap else "")
        for s, ((a, c), need) in enumerate(zip(ranges, needs, strict=True))
    )
    return PlanError(
        f"model does not fit: per-device memory cap is {memory_cap:,.0f} B, but the least "
        f"memory-hungry plan tried (S={S} stages x R={R} replicas, m={m} micro-batches of "
        f"{global_batch // (R * m)}) needs {peak:,.0f} B on its largest stage [{per_stage}]"
    )
