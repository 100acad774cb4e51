"""AutoCache on a GPU: with the memory tier in pinned host memory or on the device, every batch
served equals `FrozenPrefix.compute` of that batch, a second pass is all hits, bf16 rows are
float32, rows come back from the files (restart) and advance from a lower level on the device,
and a prefix materialised on the GPU from meta modules reports that device and fingerprints its
weights as on the CPU. Skipped without CUDA (run on a GPU node: `pytest -m cuda`).

Tolerances: a hit is compared bit for bit with what was served when the row was computed (the
stored bits). Against `prefix.compute` of a batch the comparison has a tolerance, because GPU
kernels (cuBLAS GEMMs, attention) may choose batch-size-dependent algorithms (tile shapes,
split-K), which sum in another order; see `TOL`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetransformer.core.spec import ModelSpec
from pipetransformer.models.seeded import build_model, build_stage, empty_unit
from pipetransformer.models.stage import StageModule, model_input_shape, num_tokens
from pipetransformer.trainer.cache import ActivationCache, FrozenPrefix, choose_memory

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SPEC = ModelSpec(family="vit", image_size=32, patch_size=4, channels=3, dim=192, depth=4,
                 heads=3, mlp_ratio=4.0, num_classes=10, dropout=0.1)  # fmt: skip
N = 96  # training samples
ROW_BYTES = num_tokens(SPEC) * SPEC.dim * 4  # float32 rows under either precision
MEMORIES = ["pinned", "device"]
PRECISIONS = ["fp32", "bf16"]

# Recomputation in another batch against a served row:
# - fp32: a few float32 ulps per operation, compounded over at most 4 blocks with LayerNorm, stay
#   far below 1e-4 of the hidden values (|x| <= ~4 here) and 1e-4 absolute near zero;
# - bf16: the matrix products round to bfloat16 (8 significant bits, a step of up to 1.6e-2 at
#   |x| ~ 4), so a kernel that sums in another order can move a product by a bfloat16 step, and
#   the float32 residual stream carries a few such steps over 4 blocks.
# A wrong row (another sample, another boundary, stale weights) differs by more than 1.
TOL = {"fp32": dict(rtol=1e-4, atol=1e-4), "bf16": dict(rtol=2e-2, atol=5e-2)}


@pytest.fixture(autouse=True)
def _full_fp32_matmuls():
    # TF32 would round fp32 products to 10 mantissa bits, beyond the fp32 tolerance above
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


@pytest.fixture
def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _inputs(n: int = N, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(model_input_shape(SPEC, n), generator=gen)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, precision: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL[precision])


def _batches(seed: int, size: int) -> list[torch.Tensor]:
    return list(torch.randperm(N, generator=torch.Generator().manual_seed(seed)).split(size))


def _prefix(dev: torch.device, precision: str, seed: int = 0) -> FrozenPrefix:
    model = build_model(SPEC, seed=seed).to(dev).train()
    prefix = FrozenPrefix.of(model, precision=precision)  # type: ignore[arg-type]
    assert prefix.device == dev
    return prefix


def _cache(directory: Path, dev: torch.device, memory: str, **kw) -> ActivationCache:
    # half of the samples in the memory tier (rows 0 .. 47), the rest only in the files
    return ActivationCache.for_model(
        directory, SPEC, N, ram_bytes=(N // 2) * ROW_BYTES, memory=memory, device=dev, **kw
    )


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("memory", MEMORIES)
def test_served_rows_equal_recomputation(
    memory: str, precision: str, shared: bool, dev: torch.device, tmp_path: Path
) -> None:
    prefix = _prefix(dev, precision)
    x = _inputs()  # on the host: only the misses' inputs travel, moved by the prefix
    boundary = 2
    cache = _cache(tmp_path, dev, memory, shared=shared)
    assert cache.memory == memory and cache.device == dev and cache.ram_rows == N // 2
    cache.set_boundary(boundary, prefix.fingerprints(boundary))
    stored = torch.empty((N, num_tokens(SPEC), SPEC.dim), device=dev)
    for idx in _batches(seed=0, size=16):  # fill: every row computed, then stored
        out = cache.get_or_compute(idx, x[idx], prefix)
        assert out.device == dev and out.dtype == torch.float32 and not out.requires_grad
        _assert_close(out, prefix.compute(x[idx], boundary), precision)
        stored[idx.to(dev)] = out
    s = cache.stats()
    assert (s.computed, s.misses, s.hits, s.stored) == (N, N, 0, N)
    assert s.bytes_ram == (N // 2) * ROW_BYTES
    assert s.bytes_disk == (N if shared else N // 2) * ROW_BYTES
    tier = cache._ram_tensor()
    if memory == "device":
        assert tier.device == dev
    else:
        assert tier.device.type == "cpu" and tier.is_pinned()
    # second pass in other batches, plus one batch wholly from the memory tier and one wholly
    # from the files: every row a hit, exactly the bits stored, and equal to recomputation
    second = [*_batches(seed=1, size=24), torch.arange(0, 16), torch.arange(N - 16, N)]
    for idx in second:
        out = cache.get_or_compute(idx, x[idx], prefix)
        assert out.device == dev and out.dtype == torch.float32
        assert torch.equal(out, stored[idx.to(dev)])
        _assert_close(out, prefix.compute(x[idx], boundary), precision)
    s2 = cache.stats()
    served = sum(len(idx) for idx in second)
    assert s2.misses == N and s2.computed == N and s2.hits == served  # no new misses
    assert s2.hits_ram == N // 2 + 16 and s2.hits_disk == N // 2 + 16
    # lookup: values on the tier's device (the GPU for "device", pinned host memory for "pinned")
    hits, values = cache.lookup(torch.arange(N))
    assert hits.all() and hits.device.type == "cpu"
    if memory == "device":
        assert values.device == dev
    else:
        assert values.device.type == "cpu" and values.is_pinned()
    assert torch.equal(values.to(dev), stored)
    cache.close()


@pytest.mark.parametrize("memory", MEMORIES)
def test_restart_reads_the_files_and_refills_the_memory_tier(
    memory: str, dev: torch.device, tmp_path: Path
) -> None:
    prefix = _prefix(dev, "fp32", seed=1)
    x = _inputs()
    fps = prefix.fingerprints(3)
    cache = _cache(tmp_path, dev, memory)  # shared: every row written through to the files
    cache.set_boundary(3, fps)
    expected = cache.get_or_compute(torch.arange(N), x, prefix)
    cache.close()
    again = _cache(tmp_path, dev, memory)  # a new process: empty memory tier, same files
    again.set_boundary(3, fps)
    hits, values = again.lookup(torch.arange(N))
    assert hits.all() and torch.equal(values.to(dev), expected)
    s = again.stats()
    assert (s.hits_ram, s.hits_disk) == (0, N) and s.bytes_ram == (N // 2) * ROW_BYTES
    # rows 0 .. 47 were promoted into the memory tier; a mixed batch gathers from both tiers
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(2))[:40]
    out = again.get_or_compute(idx, x[idx], prefix)
    assert out.device == dev and torch.equal(out, expected[idx.to(dev)])
    s = again.stats()
    assert s.hits_ram == int((idx < N // 2).sum()) and s.hits_disk == N + int((idx >= N // 2).sum())
    assert s.misses == 0
    again.close()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("memory", MEMORIES)
def test_rows_advance_from_a_lower_level(
    memory: str, precision: str, dev: torch.device, tmp_path: Path
) -> None:
    prefix = _prefix(dev, precision, seed=2)
    x = _inputs().to(dev)  # inputs already on the device this time
    cache = _cache(tmp_path, dev, memory)
    cache.set_boundary(1, prefix.fingerprints(1))
    for idx in _batches(seed=3, size=32):
        cache.get_or_compute(idx, x[idx.to(dev)], prefix)
    cache.set_boundary(3, prefix.fingerprints(3))  # rows of level 1 run blocks 1 and 2 only
    for idx in _batches(seed=4, size=16):
        out = cache.get_or_compute(idx, x[idx.to(dev)], prefix)
        assert out.device == dev and out.dtype == torch.float32
        _assert_close(out, prefix.compute(x[idx.to(dev)], 3), precision)
    s = cache.stats()
    assert s.source_boundary == 1 and s.advanced == N and s.computed == N  # N at level 1
    hits, _ = cache.lookup(torch.arange(N))
    assert hits.all()
    cache.close()


def test_prefix_materialised_on_the_gpu_from_meta_modules(dev: torch.device) -> None:
    boundary = 3
    with torch.device("meta"):
        embed = empty_unit(SPEC, "embed")
        blocks = {i: empty_unit(SPEC, f"blocks.{i}") for i in range(boundary)}
        stage = StageModule(SPEC, 0, boundary, embed, blocks)
    prefix = FrozenPrefix.of(stage)
    assert prefix.device.type == "meta"
    reference = build_stage(SPEC, seed=5, start=0, end=boundary)  # on the CPU
    stage.to_empty(device=dev)
    stage.load_state_dict(reference.state_dict())
    assert prefix.device == dev
    on_cpu = FrozenPrefix.of(reference)
    # fingerprints sum the weights' bits where they live (integer sums, in any order): the
    # same on any device
    assert prefix.fingerprints(boundary) == on_cpu.fingerprints(boundary)
    x = _inputs(16)
    out = prefix.compute(x, boundary)
    assert out.device == dev
    # CPU and GPU kernels sum in different orders: equal within float32 rounding
    _assert_close(out.cpu(), on_cpu.compute(x, boundary), "fp32")


def test_choose_memory_with_the_free_device_memory(dev: torch.device) -> None:
    free, _ = torch.cuda.mem_get_info(dev)
    assert choose_memory(dev, N * ROW_BYTES, free) == "device"
    assert choose_memory(dev, free, free) == "pinned"
    assert choose_memory(torch.device("cpu"), N * ROW_BYTES, free) == "host"
