"""Models: both families (ViT, BERT-style) from one block abstraction, stage splits that compose to
the full model exactly, stable parameter names, the synthetic text task, and activation
recomputation (same gradients, less saved memory)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetransformer.core.spec import DataSpec, ModelSpec, SpecError, parse_spec
from pipetransformer.models.seeded import Block, PatchEmbed, TextEmbed, build_model, build_stage
from pipetransformer.models.stage import (
    num_tokens,
    stage_input_dtype,
    stage_input_shape,
    stage_output_shape,
)
from pipetransformer.trainer.data import load_dataset, synthetic_text

# float results compared across computations: run again under other kernels (scripts/test.sh)
pytestmark = pytest.mark.numerics

VIT = ModelSpec(family="vit", image_size=8, patch_size=2, channels=1, dim=32, depth=4, heads=4)
BERT = ModelSpec(family="bert", vocab_size=40, seq_len=12, dim=32, depth=4, heads=4, num_classes=4)
FAMILIES = {"vit": VIT, "bert": BERT}
PARTITIONS = [[(0, 4)], [(0, 1), (1, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)]]


def _inputs(spec: ModelSpec, batch: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = stage_input_shape(spec, 0, batch)
    if stage_input_dtype(spec, 0) == torch.int64:
        return torch.randint(0, spec.vocab_size, shape, generator=gen)
    return torch.randn(shape, generator=gen)


@pytest.mark.parametrize("family", FAMILIES)
def test_both_families_build_and_shapes_agree(family: str) -> None:
    spec = FAMILIES[family]
    model = build_model(spec, seed=0)
    embed_cls = TextEmbed if family == "bert" else PatchEmbed
    assert isinstance(model.embed, embed_cls)
    assert all(isinstance(b, Block) for b in model.blocks.values())
    x = _inputs(spec, 5)
    assert x.dtype == stage_input_dtype(spec, 0)
    hidden = model.embed(x)
    assert hidden.shape == stage_input_shape(spec, 1, 5) == stage_output_shape(spec, 1, 5)
    assert hidden.shape[1] == num_tokens(spec)
    assert model(x).shape == stage_output_shape(spec, spec.depth, 5) == (5, spec.num_classes)
    for start in range(1, spec.depth):
        assert stage_input_dtype(spec, start) == torch.float32


def test_token_counts_and_dtypes() -> None:
    assert num_tokens(VIT) == (8 // 2) ** 2 + 1
    assert num_tokens(BERT) == BERT.seq_len + 1
    assert stage_input_shape(BERT, 0, 3) == (3, BERT.seq_len)
    assert stage_input_shape(VIT, 0, 3) == (3, 1, 8, 8)
    assert stage_input_dtype(BERT, 0) == torch.int64
    assert stage_input_dtype(VIT, 0) == torch.float32


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cuts", PARTITIONS, ids=str)
def test_stages_compose_to_the_full_model_exactly(family: str, cuts) -> None:
    spec = FAMILIES[family]
    full = build_model(spec, seed=3).eval()
    x = _inputs(spec, 6)
    with torch.no_grad():
        expected = full(x)
        h = x
        for start, end in cuts:
            h = build_stage(spec, 3, start, end).eval()(h)
    # exact: the stages run the very same modules on the same batch shapes, hence the same kernels
    assert torch.equal(h, expected)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cuts", PARTITIONS[1:], ids=str)
def test_stage_parameter_names_partition_the_model(family: str, cuts) -> None:
    spec = FAMILIES[family]
    full = dict(build_model(spec, seed=1).named_parameters())
    seen: dict[str, torch.Tensor] = {}
    for start, end in cuts:
        for name, p in build_stage(spec, 1, start, end).named_parameters():
            assert name not in seen, f"{name} in two stages"
            seen[name] = p
    assert set(seen) == set(full)
    assert all(torch.equal(seen[n], full[n]) for n in full)
    prefixes = {n.split(".")[0] for n in full}
    assert prefixes == {"embed", "blocks", "head"}


def test_recompute_keeps_parameter_names() -> None:
    for spec in FAMILIES.values():
        plain = [n for n, _ in build_stage(spec, 0, 0, 2).named_parameters()]
        remat = [n for n, _ in build_stage(spec, 0, 0, 2, recompute=True).named_parameters()]
        assert plain == remat


# --- spec validation ------------------------------------------------------------------------


def _problems(model: dict, data: dict | None = None) -> dict[str, str]:
    raw = {"name": "x", "model": model, "parallel": {"stages": 1}}
    if data is not None:
        raw["data"] = data
    with pytest.raises(SpecError) as info:
        parse_spec(raw)
    return dict(info.value.problems)


@pytest.mark.parametrize(
    ("model", "field", "phrase"),
    [
        ({"family": "bert", "seq_len": 16}, "model.vocab_size", "required when family is 'bert'"),
        ({"family": "bert", "vocab_size": 16}, "model.seq_len", "required when family is 'bert'"),
        ({"family": "bert", "vocab_size": 16, "seq_len": 0}, "model.seq_len", "greater than 0"),
        ({"family": "bert", "vocab_size": -1, "seq_len": 8}, "model.vocab_size", "greater than 0"),
        ({"family": "bert", "vocab_size": 8, "seq_len": 8, "dim": 30}, "model", "must divide dim"),
        ({"family": "gpt"}, "model.family", "choose one of vit, bert, deit, roberta"),
        ({"family": "deit"}, "model", "comes from a checkpoint: set model.pretrained"),
    ],
)
def test_bad_bert_specs_name_the_field(model: dict, field: str, phrase: str) -> None:
    problems = _problems(model)
    assert field in problems, problems
    assert phrase in problems[field]


def test_other_familys_fields_are_ignored() -> None:
    # a bert spec does not care about patches, a vit spec does not need vocab/seq_len
    bert = ModelSpec(family="bert", vocab_size=8, seq_len=8, image_size=7, patch_size=2)
    assert bert.family == "bert"
    assert ModelSpec(family="vit").vocab_size is None
    # a dumped spec (every field present) parses back to the same thing
    assert ModelSpec.model_validate_json(bert.model_dump_json()) == bert


def test_data_and_model_must_match() -> None:
    text = DataSpec(dataset="synthetic-text")
    with pytest.raises(ValueError, match="needs model.family 'bert'"):
        load_dataset(text, VIT)
    with pytest.raises(ValueError, match="needs model.family 'vit'"):
        load_dataset(DataSpec(dataset="digits"), BERT)
    small_vocab = BERT.model_copy(update={"vocab_size": BERT.num_classes})
    with pytest.raises(ValueError, match=r"model.vocab_size \(4\) must exceed"):
        load_dataset(text, small_vocab)
    short = BERT.model_copy(update={"seq_len": 5})
    with pytest.raises(ValueError, match=r"model.seq_len \(5\) must be at least"):
        load_dataset(text, short)


def test_wrong_sequence_length_is_a_clear_error() -> None:
    model = build_model(BERT, seed=0)
    with pytest.raises(ValueError, match="model.seq_len"):
        model(torch.zeros(2, BERT.seq_len + 1, dtype=torch.int64))


# --- synthetic text ---------------------------------------------------------------------------


def test_synthetic_text_is_deterministic_and_stratified() -> None:
    data = DataSpec(dataset="synthetic-text", synthetic_samples=600, seed=7)
    a, b = load_dataset(data, BERT), load_dataset(data, BERT)
    for x, y in ((a.train, b.train), (a.test, b.test)):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.labels, y.labels)
    other = load_dataset(data.model_copy(update={"seed": 8}), BERT)
    assert not torch.equal(a.train.inputs, other.train.inputs)
    assert len(a.train) + len(a.test) == 600
    assert set(a.test.labels.tolist()) == set(range(BERT.num_classes))
    assert a.train.inputs.dtype == torch.int64 and a.train.inputs.shape[1] == BERT.seq_len
    assert int(a.train.inputs.min()) >= 0 and int(a.train.inputs.max()) < BERT.vocab_size


def test_synthetic_text_label_is_the_strict_majority_keyword() -> None:
    k = 5
    ids, labels = synthetic_text(500, k, vocab_size=30, seq_len=20, seed=1)
    counts = torch.stack([(torch.from_numpy(ids) == c).sum(1) for c in range(k)], dim=1)
    top2 = counts.topk(2, dim=1).values
    assert torch.equal(counts.argmax(1), torch.from_numpy(labels))
    assert bool((top2[:, 0] > top2[:, 1]).all())  # no ties
    assert len(set(labels.tolist())) == k


def test_small_bert_learns_synthetic_text() -> None:
    spec = ModelSpec(
        family="bert", vocab_size=32, seq_len=16, dim=32, depth=2, heads=4, num_classes=4
    )
    data = load_dataset(DataSpec(dataset="synthetic-text", synthetic_samples=1536), spec)
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    # 6 epochs: the task has a sudden transition whose epoch depends on the initial draw (4
    # epochs reached it for seeds 1-3 but not 0 under per-unit seeding; 6 did for seeds 0-3)
    for _ in range(6):
        order = torch.randperm(len(data.train), generator=gen)
        for idx in order.split(64):
            loss = nn.functional.cross_entropy(
                model(data.train.inputs[idx]), data.train.labels[idx]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        acc = (model.eval()(data.test.inputs).argmax(-1) == data.test.labels).float().mean()
    assert acc >= 0.9, f"held-out accuracy {acc:.3f}"


# --- activation recomputation ---------------------------------------------------------------


def _step(spec: ModelSpec, recompute: bool, start: int = 0, end: int | None = None):
    """One forward/backward of stage [start, end) in training mode; returns the gradients and
    the bytes kept alive for backward (tensors saved by autograd, plus the block inputs a
    recomputing stage holds to replay each block), counted once per storage."""
    end = spec.depth if end is None else end
    stage = build_stage(spec, 0, start, end, recompute=recompute).train()
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(stage_input_shape(spec, start, 8), generator=gen)
    x = _inputs(spec, 8) if start == 0 else hidden
    kept: dict[tuple[int, int], int] = {}

    def keep(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        kept[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep(t)
        return t

    hooks = []
    if recompute:
        hooks = [
            b.register_forward_pre_hook(lambda _m, args: keep(args[0]))
            for b in stage.blocks.values()
        ]
    torch.manual_seed(123)  # same dropout masks in both runs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
    for h in hooks:
        h.remove()
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    return grads, sum(kept.values())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_recompute_gives_the_same_gradients(family: str, dropout: float) -> None:
    spec = FAMILIES[family].model_copy(update={"dropout": dropout})
    for start, end in [(0, spec.depth), (1, 3)]:
        plain, _ = _step(spec, False, start, end)
        remat, _ = _step(spec, True, start, end)
        assert plain.keys() == remat.keys()
        for name in plain:
            torch.testing.assert_close(remat[name], plain[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_saves_less_activation_memory(family: str) -> None:
    spec = FAMILIES[family]
    _, plain = _step(spec, False)
    _, remat = _step(spec, True)
    assert remat < plain / 2, (plain, remat)


def test_recompute_is_off_outside_training() -> None:
    stage = build_stage(BERT, 0, 0, BERT.depth, recompute=True).eval()
    x = _inputs(BERT, 4)
    with torch.no_grad():  # exact: the same forward (recomputation only changes backward)
        assert torch.equal(stage(x), build_model(BERT, 0).eval()(x))


def test_digits_are_cached_and_read_back_identically(tmp_path, monkeypatch) -> None:
    from pipetransformer.core.spec import DataSpec, ModelSpec
    from pipetransformer.trainer.data import load_dataset

    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path))
    first = load_dataset(DataSpec(), ModelSpec())
    cached = list((tmp_path / "data").glob("digits-sklearn-*.npz"))
    assert len(cached) == 1 and not list((tmp_path / "data").glob("*.tmp.*"))
    again = load_dataset(DataSpec(), ModelSpec())
    assert torch.equal(first.train.inputs, again.train.inputs)
    assert torch.equal(first.test.labels, again.test.labels)
    cached[0].write_bytes(b"torn")  # an unreadable cache is rebuilt, not trusted
    assert torch.equal(load_dataset(DataSpec(), ModelSpec()).train.labels, first.train.labels)
