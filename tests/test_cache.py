"""AutoCache: a cached frozen-prefix output equals recomputing it (invariant 8), for both model
families; the RAM budget holds and rows spill to the files and come back equal; advancing cached
rows from F_old to F_new equals computing F_new from scratch; two processes sharing one cache
directory see each other's rows; the counters count; the policy never caches with data
augmentation.

Exactness: a cache hit is compared bit for bit with the value that was stored, and a computed
row with recomputing the same batch (the same shapes, hence the same kernels). Against a
recomputation in a batch of another size the comparison has a tolerance (`close`): float results
depend on the batch shape, the thread count and the kernels the CPU's instruction set selects
(MKL's AVX2 and AVX-512 paths differ in the last bit for the same sample)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

from pipetransformer.core.spec import ModelSpec
from pipetransformer.models.seeded import build_model, build_stage, empty_unit
from pipetransformer.models.stage import (
    StageModule,
    num_tokens,
    stage_input_dtype,
    stage_input_shape,
)
from pipetransformer.trainer.cache import (
    ActivationCache,
    CachePolicy,
    FrozenPrefix,
    choose_memory,
    decide_cache,
    measure_prefix_costs,
)

# float results compared across computations: run again under other kernels (scripts/test.sh)
pytestmark = pytest.mark.numerics

# dropout > 0 and models left in train mode: the frozen prefix must run in eval mode regardless
VIT = ModelSpec(family="vit", image_size=8, patch_size=2, channels=1, dim=32, depth=6, heads=4,
                dropout=0.1)  # fmt: skip
BERT = ModelSpec(family="bert", vocab_size=40, seq_len=12, dim=32, depth=6, heads=4,
                 num_classes=4, dropout=0.1)  # fmt: skip
FAMILIES = {"vit": VIT, "bert": BERT}
N = 96  # training samples


def _inputs(spec: ModelSpec, n: int = N, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = stage_input_shape(spec, 0, n)
    if stage_input_dtype(spec, 0) == torch.int64:
        return torch.randint(0, spec.vocab_size, shape, generator=gen)
    return torch.randn(shape, generator=gen)


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal to float32 rounding: a few ulps per matmul, compounded over at most 6 blocks with
    LayerNorm, stay below 1e-5 of values of order 1, while a wrong boundary, stale weights or a
    row of another sample differ by 1e-2 or more."""
    return torch.allclose(actual, expected, rtol=1e-5, atol=1e-5)


def _reference(model, x: torch.Tensor, boundary: int) -> torch.Tensor:
    """Recomputation, written out independently of FrozenPrefix: eval mode, no autograd."""
    model.eval()
    try:
        with torch.no_grad():
            h = model.embed(x)
            for i in range(boundary):
                h = model.blocks[str(i)](h)
        return h
    finally:
        model.train()


def _cache(spec: ModelSpec, directory: Path, rows_in_ram: int, **kw) -> ActivationCache:
    row_bytes = num_tokens(spec) * spec.dim * 4
    return ActivationCache.for_model(directory, spec, N, ram_bytes=rows_in_ram * row_bytes, **kw)


def _epoch(cache, prefix, x, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    order = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
    return [
        (idx, cache.get_or_compute(idx, x[idx], prefix)) for idx in order.split(batch)
    ]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_output_equals_recomputation(family: str, tmp_path: Path) -> None:
    spec = FAMILIES[family]
    model = build_model(spec, seed=1).train()
    prefix = FrozenPrefix.of(model)
    x = _inputs(spec)
    boundary = 3
    whole = _reference(model, x, boundary)  # the whole split in one batch of 96
    with _cache(spec, tmp_path, rows_in_ram=N // 3) as cache:
        cache.set_boundary(boundary, prefix.fingerprints(boundary))
        first = _epoch(cache, prefix, x, batch=16, seed=0)  # all computed, then stored
        second = _epoch(cache, prefix, x, batch=24, seed=1)  # all hits, other batch makeup
        stats = cache.stats()
        assert stats.computed == N and stats.hits == N and stats.hits_ram and stats.hits_disk
        stored = torch.empty_like(whole)
        for idx, out in first:
            assert out.dtype == torch.float32 and not out.requires_grad
            # computed: bit-exact against recomputing the same batch (same shapes and kernels)
            assert torch.equal(out, _reference(model, x[idx], boundary))
            stored[idx] = out
        for idx, out in second:
            assert out.dtype == torch.float32 and not out.requires_grad
            assert torch.equal(out, stored[idx])  # a hit is exactly what was stored
            assert close(out, _reference(model, x[idx], boundary))  # a batch of 24, not 16
        assert close(stored, whole)
        assert model.training and all(b.training for b in model.blocks.values())


def test_ram_budget_holds_and_rows_spill_to_disk(tmp_path: Path) -> None:
    spec = VIT
    model = build_model(spec, seed=0)
    prefix = FrozenPrefix.of(model)
    x = _inputs(spec)
    full = _reference(model, x, 2)
    in_ram = 20
    budget = in_ram * num_tokens(spec) * spec.dim * 4 + 100  # not a whole number of rows
    for shared in (True, False):
        d = tmp_path / f"shared-{shared}"
        cache = ActivationCache.for_model(d, spec, N, ram_bytes=budget, shared=shared)
        row = cache.row_bytes
        assert cache.ram_rows == in_ram and cache.capacity == N
        cache.set_boundary(2, prefix.fingerprints(2))
        for idx in torch.arange(N).split(32):
            cache.store(idx, full[idx])
        s = cache.stats()
        assert s.bytes_ram == in_ram * row <= budget
        # shared: every row written through to the files; private: only the spilled rows
        assert s.bytes_disk == (N if shared else N - in_ram) * row
        assert sum(f.stat().st_blocks for f in d.iterdir()) * 512 >= (N - in_ram) * row
        hits, values = cache.lookup(torch.arange(N))
        assert hits.all() and torch.equal(values, full)
        assert cache.stats().hits_ram == in_ram and cache.stats().hits_disk == N - in_ram
        cache.close()
        # a fresh process state (restart): the RAM tier is gone, the files remain
        again = ActivationCache.for_model(d, spec, N, ram_bytes=0, shared=shared)
        again.set_boundary(2, prefix.fingerprints(2))
        hits, values = again.lookup(torch.arange(N))
        expect = torch.arange(N) >= (0 if shared else in_ram)
        assert torch.equal(hits, expect) and torch.equal(values, full[expect])
        again.close()


def test_disk_cap_limits_what_is_cached(tmp_path: Path) -> None:
    spec = VIT
    prefix = FrozenPrefix.of(build_model(spec, seed=0))
    x = _inputs(spec)
    row = num_tokens(spec) * spec.dim * 4
    cache = ActivationCache.for_model(tmp_path, spec, N, ram_bytes=8 * row, disk_bytes=50 * row)
    assert cache.capacity == 50 and cache.ram_rows == 8
    cache.set_boundary(1, prefix.fingerprints(1))
    out = cache.get_or_compute(torch.arange(N), x, prefix)
    assert torch.equal(out, prefix.compute(x, 1))
    hits, _ = cache.lookup(torch.arange(N))
    assert torch.equal(hits, torch.arange(N) < 50)
    assert cache.stats().bytes_disk == 50 * row


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_advance_equals_computing_from_scratch(family: str, tmp_path: Path) -> None:
    spec = FAMILIES[family]
    model = build_model(spec, seed=2).train()
    prefix = FrozenPrefix.of(model)
    x = _inputs(spec)
    cache = _cache(spec, tmp_path, rows_in_ram=N // 4)
    cache.set_boundary(2, prefix.fingerprints(2))
    half = torch.arange(0, N, 2)
    cache.get_or_compute(half, x[half], prefix)  # half of the samples cached at F=2
    # lazily, per batch: cached rows run blocks 2..4 only, the rest is computed from the inputs
    cache.set_boundary(5, prefix.fingerprints(5))
    s0 = cache.stats()
    scratch5 = _reference(model, x, 5)
    served = torch.empty_like(scratch5)
    for idx, out in _epoch(cache, prefix, x, batch=20, seed=3):
        assert close(out, scratch5[idx])  # advanced and computed rows mixed in a batch
        served[idx] = out
    s1 = cache.stats()
    assert s1.source_boundary == 2
    assert s1.advanced - s0.advanced == N // 2 and s1.computed - s0.computed == N // 2
    hits, values = cache.lookup(torch.arange(N))
    assert hits.all() and torch.equal(values, served)  # exactly what was served and stored
    # eagerly, after a restart: a new cache object finds the F=5 files as the source for F=6
    cache.close()
    again = _cache(spec, tmp_path, rows_in_ram=0)
    again.set_boundary(6, prefix.fingerprints(6))
    assert again.stats().source_boundary == 5
    assert again.advance(prefix, batch_size=40) == N
    hits, values = again.lookup(torch.arange(N))
    assert hits.all() and close(values, _reference(model, x, 6))
    assert again.advance(prefix) == 0  # nothing left to move
    # older levels were pruned: only the source (5) and the current level (6) remain
    names = sorted(p.name.split("-")[1] for p in tmp_path.glob("prefix-*.rows"))
    assert names == ["F005", "F006"]


def test_other_weights_or_shapes_never_hit(tmp_path: Path) -> None:
    spec = VIT
    x = _inputs(spec)
    a, b = FrozenPrefix.of(build_model(spec, seed=0)), FrozenPrefix.of(build_model(spec, seed=1))
    fa, fb = a.fingerprints(3), b.fingerprints(3)
    assert fa != fb and fa == FrozenPrefix.of(build_model(spec, seed=0)).fingerprints(3)
    cache = _cache(spec, tmp_path, rows_in_ram=N)
    cache.set_boundary(3, fa)
    cache.get_or_compute(torch.arange(N), x, a)
    cache.set_boundary(3, fb)  # e.g. resumed from a checkpoint that froze other weights
    assert torch.equal(cache.get_or_compute(torch.arange(N), x, b), b.compute(x, 3))
    assert cache.stats().hits == 0 and cache.stats().source_boundary is None
    # an in-place change of a frozen weight changes the fingerprint (no stale memo)
    with torch.no_grad():
        b.blocks[1].norm1.weight.add_(1.0)
    assert b.fingerprints(3)[1] == fb[1] and b.fingerprints(3)[2:] != fb[2:]
    # another data shape (e.g. another data set in the same folder) gets other files
    other = ActivationCache.for_model(tmp_path, spec, N + 1, ram_bytes=0, shared=True)
    other.set_boundary(3, fb, prune=False)
    assert not other.lookup(torch.arange(N))[0].any()


def test_stats_count_hits_and_misses(tmp_path: Path) -> None:
    spec = VIT
    prefix = FrozenPrefix.of(build_model(spec, seed=0))
    x = _inputs(spec)
    cache = _cache(spec, tmp_path, rows_in_ram=10)
    cache.set_boundary(2, prefix.fingerprints(2))
    idx = torch.tensor([0, 5, 20, 30, 5])  # a duplicate (padding repeats a sample)
    cache.get_or_compute(idx, x[idx], prefix)
    s = cache.stats()
    assert (s.hits, s.misses, s.computed, s.stored) == (0, 5, 5, 5)
    hits, values = cache.lookup(torch.tensor([0, 1, 20, 30, 40, 5]))
    assert hits.tolist() == [True, False, True, True, False, True] and len(values) == 4
    s = cache.stats()
    assert (s.hits_ram, s.hits_disk, s.misses) == (2, 2, 7)
    assert s.bytes_ram == 2 * cache.row_bytes and s.bytes_disk == 4 * cache.row_bytes
    assert s.hit_rate == pytest.approx(4 / 11)


def test_bad_calls_are_rejected(tmp_path: Path) -> None:
    spec = VIT
    prefix = FrozenPrefix.of(build_model(spec, seed=0))
    cache = _cache(spec, tmp_path, rows_in_ram=4)
    with pytest.raises(RuntimeError, match="set_boundary"):
        cache.lookup([0])
    with pytest.raises(ValueError, match="boundary must be >= 1"):
        cache.set_boundary(0, prefix.fingerprints(0))
    with pytest.raises(ValueError, match="fingerprints"):
        cache.set_boundary(2, prefix.fingerprints(1))
    cache.set_boundary(3, prefix.fingerprints(3))
    with pytest.raises(ValueError, match="never decreases"):
        cache.set_boundary(2, prefix.fingerprints(2))
    with pytest.raises(IndexError, match=r"\[0, 96\)"):
        cache.lookup([N])
    with pytest.raises(ValueError, match="dtype"):
        cache.store([0], torch.zeros(1, num_tokens(spec), spec.dim, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        cache.store([0, 1], torch.zeros(1, num_tokens(spec), spec.dim))


def test_policy_and_measured_decision(tmp_path: Path) -> None:
    assert not CachePolicy("off").should_use_cache(1.0, 0.0)
    assert CachePolicy("on").should_use_cache(0.0, 1.0)
    assert CachePolicy("auto").should_use_cache(1.0, 0.5)
    assert not CachePolicy("auto").should_use_cache(1.0, 0.9)  # needs min_speedup (1.2x)
    aug = CachePolicy("auto", augmentation=True)
    assert not aug.enabled and not aug.should_use_cache(1.0, 0.0)
    with pytest.raises(ValueError, match="augmentation"):
        CachePolicy("on", augmentation=True)
    with pytest.raises(ValueError, match="off, auto, on"):
        CachePolicy("sometimes")  # type: ignore[arg-type]

    spec = VIT
    prefix = FrozenPrefix.of(build_model(spec, seed=0))
    x = _inputs(spec, 32)
    off = decide_cache(aug, prefix, x, 3)
    assert not off.use and "augmentation" in off.reason and off.costs is None
    costs = measure_prefix_costs(prefix, x, 3, directory=tmp_path, repeats=2, pool_batches=2)
    assert costs.batch_size == 32 and costs.boundary == 3
    assert min(costs.compute_s, costs.ram_s, costs.disk_warm_s, costs.disk_s) > 0
    assert costs.lookup_s(1.0) == costs.ram_s and costs.lookup_s(0.0) == costs.disk_s
    decision = decide_cache(CachePolicy(), prefix, x, 3, directory=tmp_path, repeats=2)
    assert decision.costs is not None and "recompute" in decision.reason
    assert decision.use == CachePolicy().should_use_cache(
        decision.costs.compute_s, decision.costs.lookup_s(1.0)
    )
    assert list(tmp_path.iterdir()) == []  # the scratch cache is removed


def test_a_cache_decides_for_its_own_directory_and_ram_share(tmp_path: Path) -> None:
    # the worker's decision must measure the disk tier where the rows will live and expect the
    # RAM share this cache really has (10 of 96 rows here), not /tmp and "everything in RAM"
    spec = VIT
    prefix = FrozenPrefix.of(build_model(spec, seed=0))
    x = _inputs(spec, 32)
    cache = _cache(spec, tmp_path / "node-cache", rows_in_ram=10)
    assert cache.ram_fraction == pytest.approx(10 / N)
    decision = cache.decide(CachePolicy("auto"), prefix, x, 3)
    assert decision.directory == str(tmp_path / "node-cache")
    assert decision.ram_fraction == cache.ram_fraction
    costs = decision.costs
    assert costs is not None and "10% of rows in RAM" in decision.reason
    # what it needs and where, before it is turned on: 96 rows, 10 in RAM, the rest on disk
    row = num_tokens(spec) * spec.dim * 4
    assert decision.reason.startswith(
        f"needs {N * row / (1 << 20):.1f} MiB for 96 rows of {num_tokens(spec)}x{spec.dim} "
        f"float32 ({row / 1024:.1f} KiB each): 10 in RAM, 86 on disk, 0 recomputed; measured"
    )
    capped = _cache(spec, tmp_path / "small", rows_in_ram=10, disk_bytes=20 * row)
    assert capped.needs().endswith("10 in RAM, 10 on disk, 76 recomputed")
    assert f"cache {costs.lookup_s(cache.ram_fraction) * 1e3:.2f} ms" in decision.reason
    assert decision.use == CachePolicy("auto").should_use_cache(
        costs.compute_s, costs.lookup_s(cache.ram_fraction)
    )
    assert decision.as_dict()["directory"] == str(tmp_path / "node-cache")
    # the scratch cache it measured with is removed afterwards
    assert not list((tmp_path / "node-cache").glob("cache-measure-*"))


def test_servable_rows_need_no_inputs(tmp_path: Path) -> None:
    # what the worker checks before it stops reading inputs: a row held at the current level
    # (RAM or files, another process's too) or at the source level can be served from `None`
    spec = VIT
    prefix = FrozenPrefix.of(build_model(spec, seed=0))
    x = _inputs(spec)
    cache = _cache(spec, tmp_path, rows_in_ram=10)  # shared: every row also in the files
    cache.set_boundary(2, prefix.fingerprints(2))
    assert not cache.servable(np.arange(N)).any()
    cache.get_or_compute(np.arange(0, 60), x[:60], prefix)  # 10 rows in RAM, all in the files
    other = _cache(spec, tmp_path, rows_in_ram=0)  # another process of the node: the files
    other.set_boundary(2, prefix.fingerprints(2))
    for c in (cache, other):
        assert c.servable(np.arange(N)).tolist() == [True] * 60 + [False] * (N - 60)
    cache.get_or_compute(np.arange(60, N), x[60:], prefix)
    assert other.servable(np.arange(N)).all()
    # at the next boundary every row is at the source level, advanced without inputs
    cache.set_boundary(4, prefix.fingerprints(4))
    assert cache.servable(np.arange(N)).all()
    served = cache.get_or_compute(np.arange(N), None, prefix)
    assert cache.stats().advanced == N
    torch.testing.assert_close(served, prefix.compute(x, 4))  # advanced in other batches
    # a row beyond the files' capacity is never servable
    capped = _cache(spec, tmp_path / "capped", rows_in_ram=0, disk_bytes=0)
    capped.set_boundary(2, prefix.fingerprints(2))
    capped.get_or_compute(np.arange(N), x, prefix)
    assert not capped.servable(np.arange(N)).any()


def test_later_boundaries_measure_only_the_recomputation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # serving and storing a row costs the same at any boundary: a cache measures them once per
    # batch size, and a re-layout's decision at a new boundary writes no scratch files
    spec = VIT
    prefix = FrozenPrefix.of(build_model(spec, seed=0))
    x = _inputs(spec, 32)
    cache = _cache(spec, tmp_path / "node-cache", rows_in_ram=10)
    first = cache.decide(CachePolicy("auto"), prefix, x, 2).costs
    scratch: list[str] = []
    real_mkdtemp = __import__("tempfile").mkdtemp
    monkeypatch.setattr("tempfile.mkdtemp", lambda **kw: scratch.append(kw) or real_mkdtemp(**kw))
    later = cache.decide(CachePolicy("auto"), prefix, x, 4).costs
    assert scratch == [], "no scratch cache was written"
    assert later.boundary == 4 and later.compute_s > 0
    assert (later.ram_s, later.disk_s, later.disk_warm_s, later.store_s) == (
        first.ram_s,
        first.disk_s,
        first.disk_warm_s,
        first.store_s,
    )
    # another batch size (the replicas changed) is measured afresh
    other = cache.decide(CachePolicy("auto"), prefix, x[:16], 4).costs
    assert scratch and other.batch_size == 16
    with pytest.raises(ValueError, match="batch 32, not 16"):
        measure_prefix_costs(prefix, x[:16], 4, lookups=first)


def test_a_tensor_digest_tells_values_apart_not_copies() -> None:
    from pipetransformer.trainer.cache.prefix import tensor_digest

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g)
    d = tensor_digest(w)
    assert len(d) == 16 and tensor_digest(w.clone()) == d  # the values, not the tensor
    assert tensor_digest(w.t().contiguous().t()) == d  # nor its memory layout
    for i in (0, 7, w.numel() - 1):  # one element one ulp off: always another digest
        other = w.clone().view(-1)
        other[i] = torch.nextafter(other[i], torch.tensor(float("inf")))
        assert tensor_digest(other.view_as(w)) != d, i
    swapped = w.clone().view(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert tensor_digest(swapped.view_as(w)) != d  # positions count
    # every element width, and empty tensors
    for t in (w.bfloat16(), w.double(), torch.arange(5), torch.tensor([True, False])):
        assert len(tensor_digest(t)) == 16
    assert tensor_digest(w.bfloat16()) != tensor_digest(w.half())
    assert tensor_digest(torch.empty(0)) == b""


def test_a_prefix_moved_bit_for_bit_inherits_its_digests(tmp_path: Path) -> None:
    # an in-memory re-layout hands the frozen weights over unchanged: the new prefix takes the
    # old one's digests for the units both hold, and its fingerprints are what hashing gives
    spec = VIT
    old = FrozenPrefix.of(build_model(spec, seed=0))
    old.fingerprints(2)  # digests of embed, blocks 0 and 1 (frozen before)
    moved = build_model(spec, seed=1)
    moved.load_state_dict(build_model(spec, seed=0).state_dict())  # the same values, copied
    new = FrozenPrefix.of(moved)
    new.inherit_digests(FrozenPrefix(old.embed, {i: old.blocks[i] for i in range(2)}))
    assert len(new._digests) == 3  # embed, blocks 0 and 1: taken, not hashed
    assert new.fingerprints(4) == FrozenPrefix.of(build_model(spec, seed=0)).fingerprints(4)
    # the blocks frozen since are hashed from their own weights
    assert len(new._digests) == 5


# -- precision, memory tiers, devices ----------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_are_float32_and_served_exactly_under_either_precision(
    family: str, precision: str, tmp_path: Path
) -> None:
    spec = FAMILIES[family]
    model = build_model(spec, seed=5).train()
    prefix = FrozenPrefix.of(model, precision=precision)  # type: ignore[arg-type]
    x = _inputs(spec)
    boundary = 3
    out = prefix.compute(x[:16], boundary)
    assert prefix.precision == precision and out.dtype == torch.float32 and not out.requires_grad
    # the same numbers as the model's own stage forward under that precision (eval, no_grad):
    # the cached and the uncached path agree with what training would compute
    blocks = {i: model.blocks[str(i)] for i in range(boundary)}
    stage = StageModule(spec, 0, boundary, model.embed, blocks, precision=prefix.precision)
    stage.eval()
    with torch.no_grad():
        assert torch.equal(out, stage(x[:16]))
    model.train()
    fp32 = FrozenPrefix.of(model).compute(x[:16], boundary)
    if precision == "bf16":
        assert not torch.equal(out, fp32)  # autocast ran: bfloat16 products round differently
        assert torch.allclose(out, fp32, rtol=0.1, atol=0.1)
        # rows made under one precision never serve the other: every level's key differs
        fps, fps32 = prefix.fingerprints(boundary), FrozenPrefix.of(model).fingerprints(boundary)
        assert all(a != b for a, b in zip(fps, fps32, strict=True))
    else:
        assert torch.equal(out, fp32)
    batches = list(torch.randperm(N, generator=torch.Generator().manual_seed(7)).split(16))
    with _cache(spec, tmp_path, rows_in_ram=N // 3) as cache:  # both tiers serve
        cache.set_boundary(boundary, prefix.fingerprints(boundary))
        for _ in range(2):  # computed and stored, then every row a hit; the same batches
            for idx in batches:
                served = cache.get_or_compute(idx, x[idx], prefix)
                assert served.dtype == torch.float32
                assert torch.equal(served, prefix.compute(x[idx], boundary))
        s = cache.stats()
        assert s.computed == N and s.hits == N and s.hits_ram and s.hits_disk
    assert model.training and all(b.training for b in model.blocks.values())


def test_choose_memory() -> None:
    gib = 1 << 30
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # no CUDA needed to name one
    assert choose_memory(cpu, gib, None) == "host"
    assert choose_memory(cpu, gib, 100 * gib) == "host"  # the CPU never pins nor "devices"
    assert choose_memory(cuda, gib, 2 * gib) == "device"  # fits in half the free memory
    assert choose_memory("cuda:1", gib, 3 * gib) == "device"
    assert choose_memory(cuda, gib + 1, 2 * gib) == "pinned"  # more than half
    assert choose_memory(cuda, gib, None) == "pinned"  # free memory unknown


def test_memory_argument_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="memory must be one of 'host', 'pinned', 'device'"):
        ActivationCache(tmp_path, N, 4, 8, memory="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory='device' needs the device"):
        ActivationCache(tmp_path, N, 4, 8, memory="device")
    default = ActivationCache(tmp_path, N, 4, 8)
    assert default.memory == "host" and default.device is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("memory", ["pinned", "device"])
def test_pinned_and_device_memory_need_cuda(memory: str, tmp_path: Path) -> None:
    for device in ("cuda", None) if memory == "pinned" else ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match=rf"memory='{memory}' needs CUDA.*memory='host'"):
            ActivationCache(tmp_path, N, 4, 8, memory=memory, device=device)  # type: ignore


def test_device_memory_on_the_cpu_is_the_host_tier(tmp_path: Path) -> None:
    spec = VIT
    prefix = FrozenPrefix.of(build_model(spec, seed=0))
    x = _inputs(spec)
    cache = _cache(spec, tmp_path, rows_in_ram=N // 2, memory="device", device="cpu")
    assert cache.memory == "host" and cache.tier_device == torch.device("cpu")
    cache.set_boundary(2, prefix.fingerprints(2))
    out = cache.get_or_compute(torch.arange(N), x, prefix)
    assert out.device.type == "cpu" and torch.equal(out, prefix.compute(x, 2))
    hits, values = cache.lookup(torch.arange(N))
    assert hits.all() and values.device.type == "cpu" and torch.equal(values, out)
    assert cache.stats().hits_ram == N // 2 and cache.stats().hits_disk == N // 2


def test_prefix_of_meta_modules_reports_where_they_are_materialised() -> None:
    # the trainer builds modules on the meta device and materialises them afterwards: a prefix
    # made before that must follow the modules, not remember "meta"
    spec = VIT
    boundary = 3
    with torch.device("meta"):
        embed = empty_unit(spec, "embed")
        blocks = {i: empty_unit(spec, f"blocks.{i}") for i in range(boundary)}
        stage = StageModule(spec, 0, boundary, embed, blocks)
    prefix = FrozenPrefix.of(stage)
    assert prefix.device.type == "meta"
    with pytest.raises(RuntimeError, match="meta device"):
        prefix.fingerprints(boundary)  # no weights yet: nothing to fingerprint
    reference = build_stage(spec, seed=3, start=0, end=boundary)
    stage.to_empty(device="cpu")
    stage.load_state_dict(reference.state_dict())
    assert prefix.device == torch.device("cpu")
    x = _inputs(spec, 16)
    expected = FrozenPrefix.of(reference)
    assert torch.equal(prefix.compute(x, boundary), expected.compute(x, boundary))
    assert prefix.fingerprints(boundary) == expected.fingerprints(boundary)
    # an embedding without parameters: the device is the lowest block's
    bare = FrozenPrefix(torch.nn.Identity(), {1: blocks[1], 0: blocks[0]})
    assert bare.device == torch.device("cpu")


# -- two processes of one node sharing the cache directory ------------------------------------


def _worker(rank: int, directory: str, barrier, results) -> None:
    torch.set_num_threads(1)
    spec = VIT
    model = build_model(spec, seed=4)
    prefix = FrozenPrefix.of(model)
    x = _inputs(spec)
    cache = _cache(spec, Path(directory), rows_in_ram=N // 2)  # RAM tier: rows 0 .. 47
    cache.set_boundary(2, prefix.fingerprints(2))
    mine = torch.arange(rank, N, 2)  # disjoint samples, interleaved across both tiers
    for idx in mine.split(16):
        cache.get_or_compute(idx, x[idx], prefix)
    barrier.wait()
    hits, values = cache.lookup(torch.arange(N))
    ok2 = bool(hits.all()) and close(values, _reference(model, x, 2))  # batches of 16 vs 96
    # F grows: each process advances its own half of the other's rows too (eager, disjoint)
    barrier.wait()
    cache.set_boundary(4, prefix.fingerprints(4))
    advanced = cache.advance(prefix, indices=torch.arange(1 - rank, N, 2))
    barrier.wait()
    hits, values = cache.lookup(torch.arange(N))
    ok4 = bool(hits.all()) and close(values, _reference(model, x, 4))
    s = cache.stats()
    results.put((rank, ok2, ok4, advanced, s.computed, s.hits_ram, s.hits_disk))
    cache.close()


@pytest.mark.slow
def test_two_processes_share_one_cache(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path), barrier, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank, ok2, ok4, advanced, computed, hits_ram, hits_disk in got:
        assert ok2 and ok4, f"rank {rank} saw missing or wrong rows"
        assert advanced == N // 2 and computed == N // 2
        # the other process's rows in this one's RAM range came from the files, then RAM
        assert hits_disk > 0 and hits_ram > 0
    assert np.unique([g[3] for g in got]).tolist() == [N // 2]
