"""Admission: the resource estimate against the real models and data, and the refusals."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pipetransformer.core.spec import JobSpec, ModelSpec, load_spec, parse_spec
from pipetransformer.models.seeded import Block, build_model
from pipetransformer.models.stage import num_tokens
from pipetransformer.orchestrator.admission import (
    GIB,
    activation_element_bytes,
    admit,
    block_activation_bytes,
    block_params,
    data_size,
    embed_params,
    estimate,
    head_params,
    host_memory_bytes,
    model_params,
)
from pipetransformer.trainer.data import load_dataset

REPO = Path(__file__).resolve().parents[1]

SHAPES = [
    {"family": "vit"},
    {"family": "vit", "image_size": 32, "patch_size": 4, "channels": 3, "dim": 96, "heads": 6},
    {"family": "vit", "dim": 48, "depth": 3, "heads": 3, "mlp_ratio": 2.7, "num_classes": 7},
    {"family": "bert", "vocab_size": 128, "seq_len": 48, "num_classes": 8},
    {"family": "bert", "vocab_size": 1000, "seq_len": 16, "dim": 32, "depth": 2, "mlp_ratio": 4},
]


def _spec(**sections: Any) -> JobSpec:
    return parse_spec({"name": "x", **sections})


@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_count_matches_the_models(shape: dict) -> None:
    spec = ModelSpec(**shape)
    model = build_model(spec, seed=0)
    assert model_params(spec) == sum(p.numel() for p in model.parameters())
    assert embed_params(spec) == sum(p.numel() for p in model.embed.parameters())
    assert head_params(spec) == sum(p.numel() for p in model.head.parameters())
    assert block_params(spec) == sum(p.numel() for p in model.blocks["0"].parameters())


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward, parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values())


@pytest.mark.parametrize(
    "shape",
    [*SHAPES, {"dropout": 0.1}, {"dropout": 0.1, "image_size": 32, "dim": 128, "heads": 8}],
)
@pytest.mark.parametrize("precision", ["fp32", "bf16-weights"])
def test_activation_estimate_bounds_what_a_block_keeps(shape: dict, precision: str) -> None:
    spec, batch = ModelSpec(**shape), 8
    dtype = torch.bfloat16 if precision == "bf16-weights" else torch.float32
    torch.manual_seed(0)
    block = Block(spec).train().to(dtype)
    x = torch.randn(batch, num_tokens(spec), spec.dim, dtype=dtype, requires_grad=True)
    measured = _saved_bytes(block, x)
    estimated = block_activation_bytes(spec, batch, activation_element_bytes(precision))
    assert measured <= estimated <= 1.1 * measured, (measured, estimated)


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"test_fraction": 0.5},
        {"classes": [1, 2]},
        {"classes": [5, 6, 7, 8, 9], "test_fraction": 0.05},
    ],
)
def test_digits_training_split_is_exact(data: dict) -> None:
    classes = len(data["classes"]) if "classes" in data else 10
    spec = _spec(data=data, model={"num_classes": classes})
    assert data_size(spec).train == len(load_dataset(spec.data, spec.model).train)


@pytest.mark.parametrize(("samples", "fraction"), [(100, 0.2), (64, 0.5), (2048, 0.1)])
def test_synthetic_training_split_is_close(samples: int, fraction: float) -> None:
    spec = _spec(
        data={"dataset": "synthetic", "synthetic_samples": samples, "test_fraction": fraction}
    )
    size, real = data_size(spec), len(load_dataset(spec.data, spec.model).train)
    assert size.train_at_least <= real
    assert abs(size.train - real) <= spec.model.num_classes


def test_batch_larger_than_the_training_split_is_refused() -> None:
    problems = dict(admit(_spec(training={"global_batch_size": 2048}), None))
    msg = problems["training.global_batch_size"]
    assert "2048 is larger than the training split (1438 samples" in msg
    assert "at most 1438" in msg
    spec = _spec(
        data={"dataset": "synthetic", "synthetic_samples": 100},
        training={"global_batch_size": 96},
    )
    assert (
        "larger than the training split (80 samples"
        in dict(admit(spec, None))["training.global_batch_size"]
    )
    tiny = _spec(
        data={"dataset": "synthetic", "synthetic_samples": 12}, training={"global_batch_size": 4}
    )
    assert "may leave no training sample" in dict(admit(tiny, None))["data.synthetic_samples"]


@pytest.mark.parametrize(
    ("sections", "field", "phrases"),
    [
        (
            {"model": {"depth": 1024, "dim": 4096, "heads": 32}, "parallel": {"stages": 8}},
            "model",
            [
                "17.2G on one worker at 28 bytes each",
                "lower model.depth (1024) or model.dim (4096)",
            ],
        ),
        (
            {"model": {"dim": 8192, "heads": 64, "depth": 64}, "parallel": {"stages": 2}},
            "model",
            ["at 28 bytes each with AdamW", "or raise parallel.stages"],
        ),
        (
            {
                "model": {"image_size": 1024, "patch_size": 4, "channels": 3},
                "data": {"dataset": "synthetic", "synthetic_samples": 1000},
            },
            "training.global_batch_size",
            ["micro-batches of 16 samples x 65537 tokens", "parallel.recompute"],
        ),
        (
            {
                "model": {"image_size": 64, "patch_size": 8, "channels": 3},
                "data": {"dataset": "synthetic", "synthetic_samples": 10_000_000},
            },
            "data.synthetic_samples",
            ["10.0M samples", "held by every worker"],
        ),
    ],
)
def test_a_job_larger_than_the_machine_is_refused(
    sections: dict, field: str, phrases: list[str]
) -> None:
    problems = dict(admit(_spec(**sections), 16 * GIB))
    assert field in problems, problems
    msg = problems[field]
    assert "the job needs about" in msg and "but this machine has 16.0 GiB" in msg
    for phrase in phrases:
        assert phrase in msg, msg


def test_per_worker_capacity_counts_one_worker() -> None:
    """A device's memory (per worker) against the largest worker; a machine's (shared) against
    all of them and the processes around them."""
    spec = _spec(model={"dim": 1024, "depth": 16, "heads": 16}, parallel={"stages": 4})
    est = estimate(spec)
    assert est.job_bytes > sum(r.peak_bytes for r in est.ranks) > est.worker_peak_bytes
    fits = est.worker_peak_bytes
    assert admit(spec, fits, per_worker=True, where="the GPU") == []
    assert "this machine has" in admit(spec, fits)[0][1]
    ((field, msg),) = admit(spec, fits - 1, per_worker=True, where="the GPU")
    assert field == "model"
    assert "its largest worker (pipeline rank 0)" in msg and "but the GPU has" in msg


def test_layout_placement_and_in_flight() -> None:
    zbv = estimate(
        _spec(
            model={"depth": 8},
            parallel={"stages": 2, "virtual_stages": 2, "schedule": "zbv", "microbatches": 4},
        )
    )
    assert [s.rank for s in zbv.stages] == [0, 1, 1, 0]  # V-shaped
    assert [r.stages for r in zbv.ranks] == [(0, 3), (1, 2)]
    one = estimate(
        _spec(model={"depth": 8}, parallel={"stages": 4, "schedule": "1f1b", "microbatches": 8})
    )
    assert [s.in_flight for s in one.stages] == [4, 3, 2, 1]
    assert sum(s.blocks[1] - s.blocks[0] for s in one.stages) == 8


def test_recompute_and_microbatches_lower_activations() -> None:
    base = {"model": {"depth": 8}, "training": {"global_batch_size": 256}}
    plain = estimate(_spec(**base, parallel={"stages": 2}))
    remat = estimate(_spec(**base, parallel={"stages": 2, "recompute": True}))
    assert remat.ranks[0].activation_bytes < plain.ranks[0].activation_bytes / 2
    assert plain.microbatch == 256 // 4


def test_the_cache_tier_is_counted_only_where_a_prefix_can_leave_the_pipeline() -> None:
    first = {
        (cache, relayout): estimate(
            _spec(freeze={"policy": "schedule", "cache": cache, "relayout": relayout})
        ).ranks[0]
        for cache in ("auto", "off")
        for relayout in ("elastic", "off")
    }
    assert first["auto", "elastic"].other_bytes > first["off", "elastic"].other_bytes
    # frozen blocks stay in their stages: nothing for AutoCache to serve
    assert first["auto", "off"].other_bytes == first["off", "elastic"].other_bytes


def test_examples_fit_a_small_machine() -> None:
    for path in sorted((REPO / "examples").glob("*.yaml")):
        spec = load_spec(path)
        if spec.runtime.device == "cuda":  # checked per GPU, and any data-centre GPU has 16 GiB
            assert admit(spec, 16 * GIB, per_worker=True, where="each GPU") == [], path.name
        else:
            assert admit(spec, 4 * GIB) == [], path.name
        assert estimate(spec) == estimate(spec)  # deterministic


def test_host_memory_is_the_machines() -> None:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < host_memory_bytes() <= total
