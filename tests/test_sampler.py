"""Elastic sampler: every sample exactly once per epoch across replica-count changes
(docs/architecture.md, Invariants 6)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetransformer.core.sampler import ElasticSampler


def _consume_epoch(sampler: ElasticSampler, epoch: int, replica_plan: list[int]) -> list[int]:
    """Walk one epoch, switching the replica count per step as the plan says (cycling)."""
    seen: list[int] = []
    cursor, i = 0, 0
    while cursor < sampler.num_samples:
        replicas = replica_plan[i % len(replica_plan)]
        batches = [sampler.batch(epoch, cursor, replicas, r) for r in range(replicas)]
        assert len({b.next_cursor for b in batches}) == 1, "replicas agree on the next cursor"
        for b in batches:
            assert len(b.indices) == sampler.global_batch // replicas  # static shapes
            seen.extend(b.indices[b.valid].tolist())
        assert sum(int(b.valid.sum()) for b in batches) == batches[0].global_valid
        cursor, i = batches[0].next_cursor, i + 1
    return seen


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    batch_mult=st.integers(1, 8),
    plan=st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    epoch=st.integers(0, 5),
)
def test_exactly_once_across_replica_changes(n, batch_mult, plan, seed, epoch) -> None:
    sampler = ElasticSampler(n, 4 * batch_mult, seed)
    seen = _consume_epoch(sampler, epoch, plan)
    assert sorted(seen) == list(range(n))


def test_order_is_seeded_and_changes_per_epoch() -> None:
    a, b = ElasticSampler(100, 10, 7), ElasticSampler(100, 10, 7)
    assert np.array_equal(a.order(3), b.order(3))
    assert not np.array_equal(a.order(3), a.order(4))
    assert not np.array_equal(a.order(3), ElasticSampler(100, 10, 8).order(3))


def test_resume_from_cursor_continues_the_same_epoch() -> None:
    s = ElasticSampler(50, 8, 1)
    first = s.batch(0, 0, 1, 0)
    resumed = s.batch(0, first.next_cursor, 2, 1)
    assert resumed.indices.tolist() == s.order(0)[8 + 4 : 8 + 8].tolist()


def test_bad_arguments() -> None:
    s = ElasticSampler(10, 4, 0)
    with pytest.raises(ValueError, match="cursor"):
        s.batch(0, 10, 1, 0)
    with pytest.raises(ValueError, match="split"):
        s.batch(0, 0, 3, 0)
