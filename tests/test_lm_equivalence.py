"""A pipelined decoder-only language model trains as `transformers` does (issue 47): on packed
sequences of a tiny corpus (several documents per row, each attending to itself from position
0), the rank pipelines (real gloo processes under 1x1, 2x1, 3x1 and 1x2, and 2x1 with a frozen
prefix served from an attached AutoCache) give the logits of the `*ForCausalLM` forward of the
same checkpoint, and a few optimizer steps give the losses,
gradient norms and weights of a plain single-process loop whose loss is the sum of the global
batch's token cross-entropies divided by its counted tokens (not a mean of micro-batch means).
A tied pair (the output projection tied to the input embedding) keeps both copies equal bit for
bit after every step, wherever the embedding and the head are, and equals the reference's one
tensor.

Models: Llama-shaped (grouped-query attention, untied) and GPT-2 (learned positions, tied), 3
layers of width 32, random weights, made here with a tokenizer trained here
(tests/lm_assets.py); dropout is 0 on both sides."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipetransformer.core.sampler import IGNORE
from pipetransformer.core.spec import JobSpec, parse_spec
from pipetransformer.core.state import Layout
from pipetransformer.models.decoder import document_positions
from pipetransformer.orchestrator.sources import resolve_submission
from pipetransformer.trainer.cache import ActivationCache
from pipetransformer.trainer.data import load_dataset
from pipetransformer.trainer.optim import build_optimizer
from pipetransformer.trainer.pipeline import build_rank_pipeline
from tests.equivalence import (
    checkpoint_name,
    reference_steps,
    served_logits,
    train_steps,
    uniform_layout,
)
from tests.lm_assets import make_lm, write_text
from tests.mp import run_distributed

pytestmark = pytest.mark.numerics

KINDS = {"llama": ("llama", False), "gpt2-tied": ("gpt2", True)}
SEED, DEPTH, SEQ_LEN = 0, 3, 24
BATCH, STEPS, MICROBATCHES = 8, 3, 2
TRAINING = {
    "global_batch_size": BATCH,
    "lr": 3e-3,
    "warmup_steps": 1,
    "weight_decay": 0.05,
    "grad_clip": 1.0,
}
# float32 on both sides through the same `transformers` layers; the batch shapes (micro-batches
# against the whole batch) and thread counts change summation orders only: rounding, far below
# what a wrong mask, position or weight gives (1e-3 or more). Weights: AdamW divides by sqrt(v),
# so a gradient of rounding noise moves its weight by a noise-sized step that differs between the
# sides (measured: 1.4e-5 on one element of 4096, GPT-2 under 1x2), while each step moves the
# weights by about the learning rate (3e-3); a wrong gradient is off by that much.
LOGITS_TOL = {"rtol": 1e-5, "atol": 2e-5}
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
WEIGHTS_TOL = {"rtol": 1e-4, "atol": 5e-5}
LAYOUTS = {"1x1": (1, 1), "2x1": (2, 1), "3x1": (3, 1), "1x2": (1, 2)}
FROZEN = 1  # the frozen-prefix run: the embedding (the tied pair with it) and block 0
CACHED = f"2x1 F={FROZEN}"


def _spec(root: Path, kind: str) -> JobSpec:
    family, tied = KINDS[kind]
    model = make_lm(root / kind, family=family, depth=DEPTH, tied=tied)
    corpus = root / "corpus"
    corpus.mkdir(exist_ok=True)
    train, test = (
        write_text(corpus / "train.jsonl", 0, 30),
        write_text(corpus / "test.jsonl", 99, 5),
    )
    raw = {
        "name": kind,
        "model": {"pretrained": str(model), "task": "causal-lm", "seq_len": SEQ_LEN},
        "data": {"dataset": "table", "train": str(train), "test": str(test)},
        "training": TRAINING,
    }
    return resolve_submission(parse_spec(raw))


def _case(spec: JobSpec) -> dict:
    """The spec and the packed training split read whole: inputs [N, 2, T] (ids, document
    starts), labels [N, T], counted tokens per sequence."""
    train = load_dataset(spec.data, spec.model).train
    n = len(train)
    everything = np.arange(n)
    return {
        "spec": spec.to_json(),
        "inputs": train.read(everything),
        "labels": train.labels[everything],
        "tokens": train.tokens.copy(),
    }


def _runs(rank: int, world: int, layouts: dict[str, str], cases: dict, cache: str) -> dict:
    return {
        name: _run(rank, Layout.model_validate_json(layout), cases, f"{cache}/{name}")
        for name, layout in layouts.items()
    }


def _run(rank: int, layout: Layout, cases: dict, cache_root: str) -> dict:
    replica = layout.placement(rank)[1]
    per = BATCH // layout.replicas
    out: dict = {"replica": replica}
    for kind, case in cases.items():
        spec = JobSpec.model_validate_json(case["spec"])
        x, y, tokens = case["inputs"], case["labels"], case["tokens"]
        n = len(tokens)
        pipe = build_rank_pipeline(spec.model, SEED, layout, rank, per)
        share = np.arange(replica * per, (replica + 1) * per)
        first_in = x[share] if pipe.is_first else None
        last_y = y[share] if pipe.is_last else None
        if layout.freeze_boundary:  # AutoCache, attached as the Trainer attaches one
            prefix = pipe.model.prefix
            if prefix is not None:
                cache = ActivationCache.for_model(f"{cache_root}/{kind}-{rank}", spec.model, n)
                cache.set_boundary(layout.freeze_boundary, prefix.fingerprints(FROZEN))
                pipe.cache = cache
            out[kind] = {
                "computed": served_logits(pipe, first_in, last_y, share),  # misses
                "served": served_logits(pipe, first_in, last_y, share),  # hits
                "cache": pipe.cache.stats() if pipe.cache is not None else None,
            }
            pipe.destroy_groups()
            continue
        got: dict = {"logits": pipe.forward_only(first_in, last_y)}
        opt = build_optimizer(pipe.model, spec.training)
        tied: list[dict] = []

        def keep_tied(pipe=pipe, tied=tied) -> None:  # noqa: ANN001
            state = pipe.model.state_dict()
            tied.append({k: v.clone() for k, v in state.items() if _tied_name(k)})

        losses, norms = train_steps(
            pipe, opt, spec.training, layout.replicas, replica, x, y, STEPS, tokens, keep_tied
        )
        got |= {
            "losses": losses,
            "norms": norms,
            "tied": tied,
            "params": {k: v.detach().clone() for k, v in pipe.model.state_dict().items()},
        }
        pipe.destroy_groups()
        out[kind] = got
    return out


def _tied_name(key: str) -> bool:
    return key.endswith(("lm_head.weight", "embed_tokens.weight", "wte.weight"))


def _reference(spec: JobSpec, case: dict) -> dict:
    """A plain loop over `AutoModelForCausalLM`: the same global batches (real rows only), the
    packed documents given as restarting position ids (which `transformers` masks as separate
    sequences; without a key-value cache, which turns that off), the summed token loss over the batch's counted tokens."""
    from transformers import AutoModelForCausalLM

    tspec, x, y, tokens = spec.training, case["inputs"], case["labels"], case["tokens"]
    model = AutoModelForCausalLM.from_pretrained(
        spec.model.pretrained.path, attn_implementation="sdpa"
    )

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        ids, starts = inputs.unbind(1)
        positions = document_positions(starts != 0)
        # no cache: with one, `transformers` does not read restarting positions as packing
        return model(input_ids=ids, position_ids=positions, use_cache=False).logits

    with torch.no_grad():
        logits = forward(x[:BATCH])
    model.train()
    params = list(model.parameters())  # a tied pair is one parameter here
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": tspec.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=tspec.lr,
    )

    def loss_of(real: np.ndarray) -> torch.Tensor:
        return F.cross_entropy(
            forward(x[real]).flatten(0, 1), y[real].flatten(), ignore_index=IGNORE, reduction="sum"
        ) / int(tokens[real].sum())

    losses, norms = reference_steps(loss_of, params, opt, tspec, len(tokens), STEPS, tokens)
    return {
        "logits": logits,
        "losses": losses,
        "norms": norms,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("lm")
    return {kind: _case(_spec(root, kind)) for kind in KINDS}


@pytest.fixture(scope="module")
def runs(cases: dict[str, dict], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    layouts = {name: uniform_layout(DEPTH, *shape, MICROBATCHES) for name, shape in LAYOUTS.items()}
    layouts[CACHED] = uniform_layout(DEPTH, 2, 1, MICROBATCHES, FROZEN)
    by_world: dict[int, dict[str, str]] = {}
    for name, layout in layouts.items():
        by_world.setdefault(layout.world_size, {})[name] = layout.model_dump_json()
    results = {}
    for world, group in by_world.items():  # one set of processes per world size
        cache = str(tmp_path_factory.mktemp("cache"))
        ranks = run_distributed(_runs, world, group, cases, cache)
        results |= {name: [r[name] for r in ranks] for name in group}
    return results


@pytest.fixture(scope="module")
def references(cases: dict[str, dict]) -> dict[str, dict]:
    return {
        kind: _reference(JobSpec.model_validate_json(c["spec"]), c) for kind, c in cases.items()
    }


def test_the_packed_corpus_has_several_documents_per_row(cases: dict[str, dict]) -> None:
    starts = cases["llama"]["inputs"][:, 1]
    assert (starts.sum(1) > 1).any()  # the masks and positions under test are really exercised
    assert (cases["llama"]["labels"] == IGNORE).any()  # a document's end predicts nothing


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_training_equal_a_transformers_loop(
    runs: dict, references: dict, layout: str, kind: str
) -> None:
    ranks = runs[layout]
    want = references[kind]
    last = sorted((r["replica"], r[kind]) for r in ranks if r[kind]["losses"][0] is not None)
    torch.testing.assert_close(
        torch.cat([got["logits"] for _, got in last]), want["logits"], **LOGITS_TOL
    )
    losses = [sum(got["losses"][s] for _, got in last) for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want["losses"]), **LOSS_TOL)
    for r in ranks:  # every rank computes the same global norm
        torch.testing.assert_close(
            torch.tensor(r[kind]["norms"]), torch.tensor(want["norms"]), **LOSS_TOL
        )
    params = {}
    for r in ranks:
        if r["replica"] == 0:
            params |= {checkpoint_name(k): v for k, v in r[kind]["params"].items()}
    assert set(want["params"]) == set(params), set(want["params"]) ^ set(params)
    for name, value in want["params"].items():
        torch.testing.assert_close(
            params[name], value, **WEIGHTS_TOL, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_frozen_prefix_served_from_the_cache_gives_the_transformers_logits(
    runs: dict, references: dict, kind: str
) -> None:
    """2x1 with the embedding (a tied pair with it) and block 0 frozen and their outputs kept
    in an attached AutoCache, one row per packed sequence: the pass that computed the rows and
    the pass served from them both give the `transformers` logits."""
    ranks = runs[CACHED]
    (last,) = [r[kind] for r in ranks if r[kind]["computed"] is not None]
    want = references[kind]["logits"]
    torch.testing.assert_close(last["computed"], want, **LOGITS_TOL)
    torch.testing.assert_close(last["served"], want, **LOGITS_TOL)
    (stats,) = [r[kind]["cache"] for r in ranks if r[kind]["cache"] is not None]
    assert stats.boundary == FROZEN and (stats.hits, stats.misses) == (BATCH, BATCH), stats


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tied_copies_stay_equal_bit_for_bit(runs: dict, layout: str) -> None:
    """The embedding's and the head's copies of a tied pair, after every step, wherever they
    are (one rank or two): identical."""
    ranks = runs[layout]
    for replica in {r["replica"] for r in ranks}:
        for step in range(STEPS):
            copies = {}
            for r in ranks:
                if r["replica"] == replica:
                    copies |= r["gpt2-tied"]["tied"][step]
            embed, head = copies["embed.transformer.wte.weight"], copies["head.lm_head.weight"]
            assert torch.equal(embed, head), (layout, replica, step)
