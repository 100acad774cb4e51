"""A pipelined Hugging Face model computes what `transformers` computes (issue 23's correctness
requirement; docs/architecture.md, Invariants 1, 2, 5, 8): on the same weights and batch, the logits of
the rank pipelines (real gloo processes under 1x1, 2x1 and 1x2, and 2x1 with a frozen prefix
served from an attached AutoCache) equal the `transformers` model's own forward, and a few
optimizer steps from the same start (the project's AdamW, LR schedule, clipping and masked loss)
give the weights, losses and gradient norms of a plain single-process loop over that model.

Both a BERT sequence-pair classifier (padded pairs of varied length: the attention mask travels
as an extra channel) and a ViT image classifier run in the same processes, small as in
tests/test_hf_jobs.py (hidden 32, 3 layers); the models and data are made here.

Dropout: the checkpoints here set every dropout probability to 0 in their config.json (BERT's
defaults are 0.1; ViT's are already 0), which both sides read. Both then train in train mode, the
pipeline as the Trainer runs it. Dropout cannot be compared otherwise: every rank draws its masks
from its own stream (`trainer.trainer.dropout_seed`), so no layout can reproduce a single
process's masks; eval mode instead would switch off the train-mode path under test."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pipetransformer.core.partition import uniform_partition
from pipetransformer.core.sampler import ElasticSampler
from pipetransformer.core.spec import JobSpec, parse_spec
from pipetransformer.core.state import Layout
from pipetransformer.orchestrator.sources import resolve_submission
from pipetransformer.trainer.cache import ActivationCache
from pipetransformer.trainer.data import load_dataset
from pipetransformer.trainer.optim import build_optimizer
from pipetransformer.trainer.pipeline import build_rank_pipeline
from tests.equivalence import checkpoint_name, reference_steps, served_logits, train_steps
from tests.mp import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import assets  # noqa: E402  (examples/assets.py, shared with the CPU examples)

# float results compared across computations: run again under other kernels (scripts/test.sh)
pytestmark = pytest.mark.numerics

KINDS = ("bert", "vit")
SEED = 0
SAMPLES = 40  # training samples of each model
BATCH = 16  # global batch; 40 / 16: the 3rd step's batch is padded, the 4th starts epoch 2
STEPS = 4
MICROBATCHES = 2
TRAINING = {
    "global_batch_size": BATCH,
    "lr": 2e-3,
    "warmup_steps": 2,  # lr_at ramps up, then decays (total_steps = STEPS)
    "weight_decay": 0.05,
    "grad_clip": 0.3,  # below some of the gradient norms here: clipping acts (checked)
}
FROZEN = 1  # freeze boundary of the AutoCache run: the embeddings and block 0
# Logits: float32 on both sides, the same `transformers` modules and SDPA kernel; only the batch
# shapes differ (micro-batches of 4 or 8 rows against the whole batch of 16, one thread against
# several), which can change the summation order inside a matrix product: rounding, measured at
# most 1e-8 on logits of order 0.1-1. A wrong mask, weight or layer is off by 1e-3 or more.
LOGITS_TOL = {"rtol": 1e-5, "atol": 1e-5}
# Weights after STEPS steps: the gradients are float32 sums taken in another order (micro-batches,
# the replicas' all-reduce, the clip norm summed per block). AdamW divides by sqrt(v), so a
# gradient that is pure rounding noise moves its weight by noise-sized steps that differ between
# the two sides: the attention's key biases, whose gradient is exactly 0 in exact arithmetic
# (softmax ignores a shift shared by all keys), differ by up to 2e-6 (measured, ViT); every other
# weight by at most 2e-7, while training moves the weights by about 5e-3 (checked below).
WEIGHTS_TOL = {"rtol": 1e-4, "atol": 1e-5}
# losses and gradient norms, per step: sums of a few hundred float32 terms (measured: 4e-7)
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}

# -- models and data ---------------------------------------------------------------------------


def _without_dropout(directory: Path) -> Path:
    """Set every dropout probability of the checkpoint's config.json to 0 (see the docstring)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key in config:
        if "dropout" in key and config[key] is not None:
            config[key] = 0.0
    path.write_text(json.dumps(config, indent=2))
    return directory


def _pairs(root: Path) -> Path:
    """Sentence pairs of varied length (some truncated at seq_len), so that the padding and thus
    the attention mask differ between samples."""
    import datasets

    rng = np.random.default_rng(7)
    words = assets.VOCAB_WORDS
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", SAMPLES), ("test", 8)):
        rows = {
            "sentence1": [" ".join(rng.choice(words, rng.integers(1, 12))) for _ in range(n)],
            "sentence2": [" ".join(rng.choice(words, rng.integers(1, 14))) for _ in range(n)],
            "label": [int(v) for v in rng.integers(0, 2, n)],
        }
        datasets.Dataset.from_dict(rows).to_parquet(str(root / f"{split}.parquet"))
    return root


def _specs(root: Path) -> dict[str, JobSpec]:
    bert = _without_dropout(
        assets.make_bert(root / "bert", hidden=32, layers=3, heads=2, max_positions=32)
    )
    pairs = _pairs(root / "pairs")
    # ten labels, as many as the image folder's classes: the checkpoint's own head is used
    vit = _without_dropout(
        assets.make_vit(
            root / "vit", image_size=16, patch_size=4, hidden=32, layers=3, heads=2, num_labels=10
        )
    )
    images = assets.make_digit_images(root / "images", per_class=5, size=16)
    raw = {
        "bert": {
            "model": {"pretrained": str(bert), "seq_len": 24},
            "data": {
                "dataset": "table",
                "train": str(pairs / "train.parquet"),
                "test": str(pairs / "test.parquet"),
                "columns": {"text": "sentence1", "text_pair": "sentence2"},
            },
        },
        "vit": {
            "model": {"pretrained": str(vit)},
            "data": {
                "dataset": "image-folder",
                "train": str(images / "train"),
                "test": str(images / "test"),
            },
        },
    }
    return {
        kind: resolve_submission(parse_spec({"name": kind, "training": TRAINING, **spec}))
        for kind, spec in raw.items()
    }


def _case(spec: JobSpec) -> dict:
    """What a worker needs of one model: its spec and the training split read whole (what the
    Feed gives the first stage: [N, 3, T] token ids / types / mask, or [N, 3, H, W] pixels)."""
    train = load_dataset(spec.data, spec.model).train
    assert len(train) == SAMPLES
    return {
        "spec": spec.to_json(),
        "inputs": train.read(np.arange(SAMPLES)),
        "labels": train.labels.clone(),
    }


# -- the pipelines (in the worker processes) ---------------------------------------------------


def _layout(stages: int, replicas: int, boundary: int = 0) -> Layout:
    ranges = [(a + boundary, b + boundary) for a, b in uniform_partition(3 - boundary, stages)]
    return Layout.build(
        ranges,
        num_blocks=3,
        replicas=replicas,
        microbatches=MICROBATCHES,
        freeze_boundary=boundary,
    )


def _pipeline_runs(rank: int, world: int, layouts: dict[str, str], cases: dict, cache: str) -> dict:
    """Each layout in turn in the same processes (its training groups destroyed after it, as at
    a re-layout), every model under each: {layout name: {"replica", model: results}}."""
    return {
        name: _pipeline_run(rank, Layout.model_validate_json(layout), cases, f"{cache}/{name}")
        for name, layout in layouts.items()
    }


def _pipeline_run(rank: int, layout: Layout, cases: dict, cache_root: str) -> dict:
    replica = layout.placement(rank)[1]
    per = BATCH // layout.replicas
    out: dict = {"replica": replica}
    for kind, case in cases.items():
        spec = JobSpec.model_validate_json(case["spec"])
        x, y = case["inputs"], case["labels"]
        pipe = build_rank_pipeline(spec.model, SEED, layout, rank, per)
        got: dict = {}
        prefix = pipe.model.prefix
        if prefix is not None:  # AutoCache, attached as the Trainer attaches one it decided on
            cache = ActivationCache.for_model(f"{cache_root}/{kind}-{rank}", spec.model, SAMPLES)
            cache.set_boundary(layout.freeze_boundary, prefix.fingerprints(layout.freeze_boundary))
            pipe.cache = cache

        # logits of this replica's share of the first BATCH samples
        share = np.arange(replica * per, (replica + 1) * per)
        first_in = x[share] if pipe.is_first else None
        last_y = y[share] if pipe.is_last else None
        if layout.freeze_boundary:
            got["logits"] = served_logits(pipe, first_in, last_y, share)  # misses: computed
            got["logits_hit"] = served_logits(pipe, first_in, last_y, share)  # served
        else:
            got["logits"] = pipe.forward_only(first_in, last_y)

        # training: the Trainer's step (trainer/trainer.py Trainer.step)
        opt = build_optimizer(pipe.model, spec.training)
        assert pipe.model.training
        # without per-sample weights a batch's loss count is its real samples (global_valid)
        losses, norms = train_steps(pipe, opt, spec.training, layout.replicas, replica, x, y, STEPS)
        got |= {
            "losses": losses,
            "norms": norms,
            "params": {k: v.detach().clone() for k, v in pipe.model.state_dict().items()},
            "cache": pipe.cache.stats() if pipe.cache is not None else None,
        }
        pipe.destroy_groups()
        out[kind] = got
    return out


# -- the `transformers` side (this process) ----------------------------------------------------


def _hf_model(spec: JobSpec):  # noqa: ANN202
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    auto = (
        AutoModelForSequenceClassification
        if spec.model.is_text
        else AutoModelForImageClassification
    )
    model = auto.from_pretrained(spec.model.pretrained.path, attn_implementation="sdpa")
    assert model.dtype == torch.float32 and all(
        v == 0 for k, v in model.config.to_dict().items() if "dropout" in k and v is not None
    )
    return model


def _hf_forward(model, spec: JobSpec, inputs: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    if not spec.model.is_text:
        return model(pixel_values=inputs).logits
    ids, types, mask = inputs.unbind(1)
    return model(input_ids=ids, token_type_ids=types, attention_mask=mask).logits


def _frozen_name(name: str, family: str, boundary: int) -> bool:
    """Whether checkpoint parameter `name` lies in the frozen prefix (embeddings, blocks < F)."""
    if name.startswith(f"{family}.embeddings."):
        return boundary > 0
    layer = f"{family}.encoder.layer."
    return name.startswith(layer) and int(name[len(layer) :].split(".")[0]) < boundary


def _reference(spec: JobSpec, case: dict, boundary: int, scratch: Path) -> dict:
    """A plain loop over the `transformers` model: the same global batches (real samples only),
    mean cross-entropy, AdamW with build_optimizer's groups and hyper-parameters, the same LR
    schedule, torch.nn.utils.clip_grad_norm_."""
    tspec, x, y = spec.training, case["inputs"], case["labels"]
    model = _hf_model(spec)
    with torch.no_grad():
        logits = _hf_forward(model.eval(), spec, x[:BATCH])
    model.train()
    base = getattr(model, spec.model.family)
    layers = base.encoder.layer if hasattr(base, "encoder") else base.layers  # ViT: transformers 5
    for module in [base.embeddings, *layers[:boundary]] if boundary else []:
        module.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": tspec.weight_decay},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=tspec.lr,
    )
    losses, norms = reference_steps(
        lambda real: F.cross_entropy(_hf_forward(model, spec, x[real]), y[real]),
        trainable,
        opt,
        tspec,
        SAMPLES,
        STEPS,
    )
    return {
        "start": load_file(Path(spec.model.pretrained.path) / "model.safetensors"),
        "logits": logits,
        "losses": losses,
        "norms": norms,
        "params": _as_saved(model, scratch),
    }


def _as_saved(model, directory: Path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """The model's weights under the checkpoint's names, as `save_pretrained` writes them
    (transformers 5 holds ViT layers under other names in memory than in its checkpoints)."""
    model.save_pretrained(directory)
    return load_file(directory / "model.safetensors")


# -- runs --------------------------------------------------------------------------------------

LAYOUTS = {"1x1": (1, 1, 0), "2x1": (2, 1, 0), "1x2": (1, 2, 0), f"2x1 F={FROZEN}": (2, 1, FROZEN)}


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, JobSpec]:
    return _specs(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def cases(specs: dict[str, JobSpec]) -> dict[str, dict]:
    return {kind: _case(specs[kind]) for kind in KINDS}


@pytest.fixture(scope="module")
def runs(cases: dict[str, dict], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every layout's run, merged per model: logits (replica order) and replica 0's weights."""
    layouts = {name: _layout(*shape) for name, shape in LAYOUTS.items()}
    by_world: dict[int, dict[str, str]] = {}
    for name, layout in layouts.items():
        by_world.setdefault(layout.world_size, {})[name] = layout.model_dump_json()
    results = {}
    for world, group in by_world.items():  # one set of processes per world size
        cache_root = str(tmp_path_factory.mktemp("cache"))
        ranks = run_distributed(_pipeline_runs, world, group, cases, cache_root)
        results |= {name: [r[name] for r in ranks] for name in group}
    out = {}
    for name in LAYOUTS:
        merged = {}
        for kind in KINDS:
            mine = [(r["replica"], r[kind]) for r in results[name]]
            positions = layouts[name].pipeline_ranks
            last = sorted((rep, got) for rep, got in mine if got["losses"][0] is not None)
            merged[kind] = {
                "logits": torch.cat([got["logits"] for _, got in last]),
                "logits_hit": [got.get("logits_hit") for _, got in last],
                # the global mean loss: the replicas' shares summed (as Trainer.step reports it)
                "losses": [sum(got["losses"][s] for _, got in last) for s in range(STEPS)],
                "norms": [got["norms"] for _, got in mine],
                "params": {
                    checkpoint_name(k): v
                    for rep, got in mine
                    if rep == 0
                    for k, v in got["params"].items()
                },
                "caches": [got["cache"] for _, got in mine if got["cache"] is not None],
                # each rank's weights by its pipeline position (rank = replica * P + position)
                "by_position": [
                    (rank % positions, got["params"]) for rank, (_, got) in enumerate(mine)
                ],
            }
        out[name] = merged
    return out


@pytest.fixture(scope="module")
def references(
    specs: dict[str, JobSpec], cases: dict[str, dict], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int], dict]:
    return {
        (kind, boundary): _reference(
            specs[kind], cases[kind], boundary, tmp_path_factory.mktemp(f"{kind}-{boundary}")
        )
        for kind in KINDS
        for boundary in sorted({b for _, _, b in LAYOUTS.values()})
    }


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_equal_the_transformers_forward(runs, references, layout: str, kind: str) -> None:
    got, want = runs[layout][kind], references[(kind, 0)]["logits"]
    torch.testing.assert_close(got["logits"], want, **LOGITS_TOL)
    if LAYOUTS[layout][2]:  # the second pass, served from the cache, gives the same logits
        for served in got["logits_hit"]:
            assert served is not None
        torch.testing.assert_close(torch.cat(got["logits_hit"]), want, **LOGITS_TOL)


def _expected_cache_use(seed: int) -> tuple[int, int]:
    """(hits, misses) of replica 0's cache in the AutoCache run: the logits passes (the first
    BATCH samples computed, then served), then the training steps' batches (padding entries
    repeat real samples, and count as lookups too); a sample is a hit once it was seen."""
    seen = set(range(BATCH))
    hits, misses = BATCH, BATCH
    sampler = ElasticSampler(SAMPLES, BATCH, seed)
    epoch, cursor = 0, 0
    for _ in range(STEPS):
        b = sampler.batch(epoch, cursor, 1, 0)
        new = [int(i) not in seen for i in b.indices]
        hits, misses = hits + new.count(False), misses + new.count(True)
        seen |= {int(i) for i in b.indices}
        cursor = b.next_cursor
        if cursor >= SAMPLES:
            epoch, cursor = epoch + 1, 0
    return hits, misses


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_frozen_prefix_was_served_from_the_cache(runs, specs, kind: str) -> None:
    """The AutoCache run really went through an attached cache: the first logits pass computed
    the rows, the second was served from it, and so was every sample training saw again."""
    (stats,) = runs[f"2x1 F={FROZEN}"][kind]["caches"]  # one cache: replica 0's first stage
    hits, misses = _expected_cache_use(specs[kind].training.seed)
    assert stats.boundary == FROZEN
    assert (stats.hits, stats.misses) == (hits, misses), stats
    assert stats.hits > 2 * BATCH  # the second epoch's step was served too
    assert stats.computed == misses and stats.advanced == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_equals_a_transformers_loop(runs, references, layout: str, kind: str) -> None:
    boundary = LAYOUTS[layout][2]
    got, want = runs[layout][kind], references[(kind, boundary)]
    assert set(got["params"]) == set(want["params"])  # the checkpoint's names, every one
    for name, value in got["params"].items():
        torch.testing.assert_close(value, want["params"][name], **WEIGHTS_TOL, msg=name)
    torch.testing.assert_close(got["losses"], want["losses"], **LOSS_TOL)
    for norms in got["norms"]:  # every rank clipped by the whole model's norm
        torch.testing.assert_close(norms, want["norms"], **LOSS_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_replicas_hold_identical_weights(runs, kind: str) -> None:
    """Under 1x2 both replicas end with the same weights, bit for bit (their gradients were
    summed over both before the same optimizer step)."""
    (_, first), (_, second) = runs["1x2"][kind]["by_position"]
    assert set(first) == set(second)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("boundary", [0, FROZEN])
def test_the_reference_moved(references, specs, kind: str, boundary: int) -> None:
    """Guards: the comparisons above would be vacuous if training changed nothing, or if
    clipping never acted; the frozen prefix stays exactly as it was."""
    ref = references[(kind, boundary)]
    family = specs[kind].model.family
    assert set(ref["params"]) == set(ref["start"])
    frozen, still = [], []
    for name, value in ref["params"].items():
        if _frozen_name(name, family, boundary):
            assert torch.equal(value, ref["start"][name]), name
            frozen.append(name)
        elif (value - ref["start"][name]).abs().max() < 100 * WEIGHTS_TOL["atol"]:
            still.append(name)
    assert bool(frozen) == (boundary > 0)
    # every trained tensor moved by 100 times the tolerance, but the key biases (no gradient)
    assert all(name.endswith("key.bias") for name in still), still
    assert max(ref["norms"]) > TRAINING["grad_clip"]
