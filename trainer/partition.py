"""Partition planning: contiguous block ranges per stage, and the `Layout` built from them.
Pure and deterministic."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from orchestrator.spec import JobSpec
from orchestrator.state import Layout, StageLayout


def balanced_partition(costs: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Split `costs` into `stages` contiguous non-empty ranges minimising the largest range sum
    (dynamic programming; ties go to the earliest cut, so the answer is deterministic)."""
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


def plan_layout(
    spec: JobSpec, version: int = 1, block_costs: Sequence[float] | None = None
) -> Layout:
    """The layout a job starts with: `parallel.stages` stages balanced over block costs (uniform
    until measured profiles arrive), `parallel.replicas` replicas; rank = replica * S + stage."""
    p = spec.parallel
    costs = list(block_costs) if block_costs is not None else [1.0] * spec.model.depth
    ranges = balanced_partition(costs, p.stages)
    return Layout(
        version=version,
        num_blocks=spec.model.depth,
        stages=[
            StageLayout(
                index=s, start=a, end=b, ranks=[r * p.stages + s for r in range(p.replicas)]
            )
            for s, (a, b) in enumerate(ranges)
        ],
        replicas=p.replicas,
        microbatches=p.microbatches,
        schedule=p.schedule,
    )
