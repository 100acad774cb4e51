"""A pipelined decoder with LoRA adapters (`model.adapters`) trains as a single-process `peft`
model does: on packed sequences, the rank pipelines (real gloo processes under 1x1, 2x1 and 1x2,
and 2x1 with block 0 frozen, its adapters merged into its weights and its output served from an
attached AutoCache) give, after a few AdamW steps of the adapters alone, the losses, gradient
norms and adapter weights of `peft.get_peft_model` on the `transformers` model with the same
adapters, trained by a plain loop (block 0's adapters left untrained where the pipeline froze
it). Only the adapters have gradients; the base weights are the checkpoint's after training.

Model: Llama-shaped, 3 layers of width 32, random weights, made here (tests/lm_assets.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipetransformer.core.sampler import IGNORE
from pipetransformer.core.spec import JobSpec, parse_spec
from pipetransformer.core.state import Layout
from pipetransformer.models.adapters import is_adapter, is_merged
from pipetransformer.models.decoder import document_positions
from pipetransformer.models.units import architecture, initial_units
from pipetransformer.orchestrator.sources import resolve_submission
from pipetransformer.trainer.cache import ActivationCache
from pipetransformer.trainer.checkpoint import model_tensors
from pipetransformer.trainer.data import load_dataset
from pipetransformer.trainer.optim import build_optimizer
from pipetransformer.trainer.pipeline import build_rank_pipeline
from tests.equivalence import (
    checkpoint_name,
    peft_model_of,
    reference_steps,
    train_steps,
    uniform_layout,
)
from tests.lm_assets import make_lm, write_text
from tests.mp import run_distributed

pytestmark = [pytest.mark.numerics, pytest.mark.slow]

SEED, DEPTH, SEQ_LEN = 0, 3, 24
BATCH, STEPS, MICROBATCHES = 8, 3, 2
TRAINING = {"global_batch_size": BATCH, "lr": 1e-2, "warmup_steps": 1, "grad_clip": 1.0}
ADAPTERS = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "up_proj", "down_proj"]}
# float32 on both sides through the same layers; micro-batches against the whole batch change
# summation orders only (see tests/test_lm_equivalence.py): rounding, far below a wrong gradient
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
WEIGHTS_TOL = {"rtol": 1e-4, "atol": 5e-5}
LAYOUTS = {"1x1": (1, 1, 0), "2x1": (2, 1, 0), "1x2": (1, 2, 0), "2x1 F=1": (2, 1, 1)}


def _spec(root: Path) -> JobSpec:
    model = make_lm(root / "llama", depth=DEPTH)
    train = write_text(root / "train.jsonl", 0, 30)
    test = write_text(root / "test.jsonl", 99, 5)
    raw = {
        "name": "lora",
        "model": {
            "pretrained": str(model),
            "task": "causal-lm",
            "seq_len": SEQ_LEN,
            "adapters": ADAPTERS,
        },
        "data": {"dataset": "table", "train": str(train), "test": str(test)},
        "training": TRAINING,
    }
    return resolve_submission(parse_spec(raw))


def _runs(rank: int, world: int, layouts: dict[str, str], case: dict, cache: str) -> dict:
    return {
        name: _run(rank, Layout.model_validate_json(shape), case, f"{cache}/{name}")
        for name, shape in layouts.items()
    }


def _run(rank: int, layout: Layout, case: dict, cache_root: str) -> dict:
    spec = JobSpec.model_validate_json(case["spec"])
    x, y, tokens = case["inputs"], case["labels"], case["tokens"]
    n = len(tokens)
    replica = layout.placement(rank)[1]
    pipe = build_rank_pipeline(spec.model, SEED, layout, rank, BATCH // layout.replicas)
    pipe.model.merge_frozen()  # as build_training does once the adapters hold their values
    if pipe.model.prefix is not None:  # AutoCache, attached as the Trainer attaches one
        cache = ActivationCache.for_model(f"{cache_root}/{rank}", spec.model, n)
        cache.set_boundary(layout.freeze_boundary, pipe.model.prefix.fingerprints(1))
        pipe.cache = cache
    merged = [is_merged(b) for i, b in pipe.model.blocks.items() if int(i) < layout.freeze_boundary]
    trains = [n for n, p in pipe.model.named_parameters() if p.requires_grad]
    opt = build_optimizer(pipe.model, spec.training)
    losses, norms = train_steps(
        pipe, opt, spec.training, layout.replicas, replica, x, y, STEPS, weights=tokens
    )
    out = {
        "replica": replica,
        "losses": losses,
        "norms": norms,
        "trains": trains,
        "merged": merged,
        "adapters": {k: v.detach().clone() for k, v in model_tensors(pipe.model).items()},
        "cache": pipe.cache.stats() if pipe.cache is not None else None,
    }
    pipe.destroy_groups()
    return out


def _reference(spec: JobSpec, case: dict, frozen: int) -> dict:
    """`peft.get_peft_model` over `AutoModelForCausalLM`, its adapters set to the job's initial
    ones (drawn from the job's seed), trained by a plain loop on the same global batches (the
    packed documents as restarting position ids), blocks below `frozen` left untrained."""
    tspec, x, y, tokens = spec.training, case["inputs"], case["labels"], case["tokens"]
    ours = initial_units(spec.model, SEED, architecture(spec.model).unit_names())
    model = peft_model_of(spec.model, ours, attn_implementation="sdpa")
    for name, p in model.named_parameters():
        if any(f".layers.{i}." in name for i in range(frozen)):
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tspec.lr, weight_decay=tspec.weight_decay)
    model.train()

    def loss_of(real: np.ndarray) -> torch.Tensor:
        ids, starts = x[real].unbind(1)
        positions = document_positions(starts != 0)
        out = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        return F.cross_entropy(
            out.flatten(0, 1), y[real].flatten(), ignore_index=IGNORE, reduction="sum"
        ) / int(tokens[real].sum())

    losses, norms = reference_steps(loss_of, params, opt, tspec, len(tokens), STEPS, tokens)
    adapters = {
        k.removeprefix("base_model.model."): v.detach().clone()
        for k, v in model.named_parameters()
        if is_adapter(k)
    }
    return {"losses": losses, "norms": norms, "adapters": adapters}


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict:
    spec = _spec(tmp_path_factory.mktemp("lora"))
    train = load_dataset(spec.data, spec.model).train
    everything = np.arange(len(train))
    return {
        "spec": spec.to_json(),
        "inputs": train.read(everything),
        "labels": train.labels[everything],
        "tokens": train.tokens.copy(),
    }


@pytest.fixture(scope="module")
def runs(case: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    by_world: dict[int, dict[str, str]] = {}
    for name, shape in LAYOUTS.items():
        built = uniform_layout(DEPTH, *shape[:2], MICROBATCHES, shape[2])
        by_world.setdefault(built.world_size, {})[name] = built.model_dump_json()
    results = {}
    for world, group in by_world.items():  # one set of processes per world size
        ranks = run_distributed(_runs, world, group, case, str(tmp_path_factory.mktemp("c")))
        results |= {name: [r[name] for r in ranks] for name in group}
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adapters_train_as_a_peft_model_does(runs: dict, case: dict, layout: str) -> None:
    frozen = LAYOUTS[layout][2]
    want = _reference(JobSpec.model_validate_json(case["spec"]), case, frozen)
    ranks = runs[layout]
    for r in ranks:  # only adapters train, and no frozen block's
        assert r["trains"] and all(is_adapter(n) for n in r["trains"]), r["trains"]
        assert not any(f".layers.{i}." in n for n in r["trains"] for i in range(frozen))
        assert all(r["merged"])
    last = [r for r in ranks if r["losses"][0] is not None]
    losses = [sum(r["losses"][s] for r in last) for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), **LOSS_TOL)
    for r in ranks:
        torch.testing.assert_close(
            torch.tensor(r["norms"]), torch.tensor(want["norms"]), **LOSS_TOL
        )
    got = {}
    for r in ranks:
        if r["replica"] == 0:
            got |= {checkpoint_name(k): v for k, v in r["adapters"].items()}
    assert set(got) == set(want["adapters"]), set(got) ^ set(want["adapters"])
    for name, value in want["adapters"].items():
        torch.testing.assert_close(
            got[name], value, **WEIGHTS_TOL, msg=lambda m, name=name: f"{name}: {m}"
        )
    if frozen:  # every row's frozen, merged prefix went through the cache (a row's first
        # pass computes and keeps it; a row seen again in these 3 steps is served)
        (stats,) = [r["cache"] for r in ranks if r["cache"] is not None]
        assert stats.boundary == frozen and stats.misses > 0
        assert stats.hits + stats.misses == STEPS * BATCH, stats
