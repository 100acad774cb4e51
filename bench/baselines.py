"""Baselines and measure-then-plan helpers that only the benchmarks (and their tests) use, kept
out of the planner: a min-max split over given block costs, PipeTransformer's parameter-count
greedy split, a side-by-side comparison of
the planner's split with the baselines', and AutoPipe run on a bare model spec (no job spec).

Imported by bench/*.py (after `_common` put the repository root on sys.path) and by tests with
bench/ on sys.path."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

from pipetransformer.core.partition import (
    CostModel,
    Plan,
    PlanError,
    Profile,
    ProfileInput,
    evaluate_partition,
    microbatch_candidates,
    plan,
    profile_at,
    uniform_partition,
)
from pipetransformer.core.spec import ModelSpec
from pipetransformer.trainer.profile import measure_profiles

# PipeTransformer's AutoPipe weights a frozen layer at 1/6 of an active one
# (its `frozen_layer_cost_factor`).
PIPETRANSFORMER_FROZEN_FACTOR = 1.0 / 6.0


def balanced_partition(costs: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Split `costs` into `stages` contiguous non-empty ranges minimising the largest range sum
    (dynamic programming; ties go to the earliest cut, so the answer is deterministic). Not the
    even split: equal costs leave the first stage short (10 blocks on 4 stages: 1, 3, 3, 3)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} blocks into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    @cache
    def best(i: int, k: int) -> tuple[float, tuple[int, ...]]:
        # blocks [i, n) on k stages -> (bottleneck, cut positions)
        if k == 1:
            return prefix[n] - prefix[i], ()
        options = []
        for j in range(i + 1, n - k + 2):
            rest, cuts = best(j, k - 1)
            options.append((max(prefix[j] - prefix[i], rest), (j, *cuts)))
        return min(options)

    cuts = (0, *best(0, stages)[1], n)
    return [(cuts[s], cuts[s + 1]) for s in range(stages)]


def param_greedy_partition(
    profile: Profile,
    stages: int,
    freeze_boundary: int = 0,
    frozen_factor: float = PIPETRANSFORMER_FROZEN_FACTOR,
) -> list[tuple[int, int]]:
    """PipeTransformer's AutoPipe split, by parameter count: the embedding and every frozen block
    go to stage 0 (frozen ones weighted by `frozen_factor`, its 1/6); then each stage in turn
    takes blocks while that brings its parameter load closer to the mean of what is left; the
    last stage takes the rest (with the head). Compute, activations and transfers are ignored.

    PipeTransformer's code also lets a stage overshoot the mean by a variance term; that slack is
    left out here (it only makes the greedy's balance worse), and every stage keeps at least one
    block so the result is a valid layout."""
    L, F = profile.num_blocks, freeze_boundary
    if not 1 <= stages <= L:
        raise PlanError(f"cannot split {L} blocks into {stages} non-empty stages")
    weight = [
        b.param_bytes * (frozen_factor if j < F else 1.0) for j, b in enumerate(profile.blocks)
    ]
    ranges: list[tuple[int, int]] = []
    load = profile.embed.param_bytes * (frozen_factor if F > 0 else 1.0)
    pos = 0
    # frozen blocks all to stage 0, leaving one block for each later stage
    while pos < min(F, L - (stages - 1)):
        load += weight[pos]
        pos += 1
    remaining = sum(weight[pos:]) + profile.head.param_bytes + load
    for s in range(stages):
        left_stages = stages - s
        if left_stages == 1:
            ranges.append((ranges[-1][1] if ranges else 0, L))
            break
        start = ranges[-1][1] if ranges else 0
        mean = remaining / left_stages
        # take blocks while that brings the load nearer the mean, keeping one per later stage
        while pos < L - (left_stages - 1):
            nxt = load + weight[pos]
            if pos > start and abs(nxt - mean) >= abs(load - mean):
                break
            load = nxt
            pos += 1
        ranges.append((start, pos))
        remaining -= load
        load = 0.0
    return ranges


def compare_partitions(
    profile: ProfileInput,
    stages: int,
    *,
    global_batch: int,
    replicas: int = 1,
    microbatches: int = 1,
    cost: CostModel | None = None,
) -> dict[str, Plan]:
    """The planner's, the parameter-count greedy's and the uniform split's plans for the same
    S x R x m, costed by the same model (for benchmarks and reports)."""
    cost = cost or CostModel()
    if global_batch % (replicas * microbatches):
        raise PlanError(
            f"global batch {global_batch} does not split into {replicas} replicas x "
            f"{microbatches} micro-batches"
        )
    prof = profile_at(profile, global_batch // (replicas * microbatches))
    common: dict[str, Any] = dict(
        profile=prof,
        global_batch=global_batch,
        replicas=replicas,
        microbatches=microbatches,
        cost=cost,
    )
    auto = plan(
        prof,
        devices=stages * replicas,
        global_batch=global_batch,
        cost=cost,
        microbatches=[microbatches],
        stages=stages,
        replicas=replicas,
    )
    return {
        "autopipe": auto,
        "param_greedy": evaluate_partition(
            ranges=param_greedy_partition(prof, stages, cost.freeze_boundary),
            method="param_greedy",
            **common,
        ),
        "uniform": evaluate_partition(
            ranges=uniform_partition(prof.num_blocks, stages), method="uniform", **common
        ),
    }


def choose_microbatches(
    model_spec: ModelSpec,
    stages: int,
    replica_batch: int,
    *,
    replicas: int = 1,
    cost: CostModel | None = None,
    profiles: dict[int, Profile] | None = None,
    device: str | torch.device | None = None,
    reuse: bool = True,
    profile_dir: str | Path | None = None,
) -> int:
    """The micro-batch count m for S = `stages` with the lowest predicted step time
    `(m + S - 1) * T(b) + all-reduce`, where T(b) is the planner's bottleneck stage time measured
    at micro-batch size b = replica_batch / m. Candidates: the divisors of `replica_batch` in
    [S, 6S] (PipeTransformer's range), all divisors if none lies there. Missing sizes are
    measured (and stored); `profiles` supplies measurements keyed by micro-batch size."""
    candidates = microbatch_candidates(stages, replica_batch)
    sizes = {replica_batch // m for m in candidates}
    measured = dict(profiles or {})
    missing = sizes - set(measured)
    if missing:
        measured.update(
            measure_profiles(model_spec, missing, device, reuse=reuse, profile_dir=profile_dir)
        )
    best = plan(
        {b: measured[b] for b in sizes},
        devices=stages * replicas,
        global_batch=replica_batch * replicas,
        cost=cost,
        microbatches=candidates,
        stages=stages,
        replicas=replicas,
    )
    return best.microbatches


def measured_plan(
    model_spec: ModelSpec,
    devices: int,
    global_batch: int,
    *,
    cost: CostModel | None = None,
    stages: int | None = None,
    replicas: int | None = None,
    device: str | torch.device | None = None,
    reuse: bool = True,
    profile_dir: str | Path | None = None,
    repeats: int = 7,
) -> Plan:
    """AutoPipe end to end on a model spec: measure the model at every micro-batch size the
    search can reach (S x R <= devices, m in [S, 6S]), then plan (S, R, m and the partition) on
    those measurements."""
    L = model_spec.depth
    stage_opts = [stages] if stages else list(range(1, min(devices, L) + 1))
    sizes: set[int] = set()
    for S in stage_opts:
        rep_opts = [replicas] if replicas else list(range(1, devices // S + 1))
        for R in rep_opts:
            if global_batch % R:
                continue
            sizes |= {global_batch // R // m for m in microbatch_candidates(S, global_batch // R)}
    if not sizes:
        raise PlanError(
            f"no replica count divides global batch {global_batch} on {devices} devices"
        )
    profiles = measure_profiles(
        model_spec, sizes, device, reuse=reuse, repeats=repeats, profile_dir=profile_dir
    )
    return plan(
        profiles,
        devices=devices,
        global_batch=global_batch,
        cost=cost,
        stages=stages,
        replicas=replicas,
    )
