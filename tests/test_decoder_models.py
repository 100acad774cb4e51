"""Decoder-only language models (Llama, Qwen2, Qwen3, Mistral, GPT-2) as the pipeline's units
(core/families/decoder.py, models/decoder.py): tiny checkpoints made here with `save_pretrained`
(random weights; grouped-query attention, a head width other than dim / heads, sliding windows,
tied and untied embeddings), loaded unit by unit and compared with the `transformers`
`*ForCausalLM` of the same directory: single-document rows, packed rows (several documents in
one row, each as if alone), bf16, the tied pair, the export (loaded back with
`AutoModelForCausalLM`, greedy `generate()`), parameter counts and FLOPs, and what config.json
is refused.

Tolerance (fp32): both sides run the same `transformers` modules and kernels on the same batch,
so they agree up to float32 rounding (measured: bit-equal for single-document rows; packed rows
against each document run alone differ in shape, hence in summation order: a few 1e-7 on logits
of order 1). A wrong mask, position or weight is off by 1e-2 or more."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pipetransformer.core.families import Architecture, checkpoint_family, parse_architecture
from pipetransformer.core.flops import training_flops_per_sample
from pipetransformer.core.spec import ModelSpec, SpecError, parse_spec
from pipetransformer.core.tasks import task_of
from pipetransformer.edge.hf_files import read_architecture
from pipetransformer.models.decoder import (
    DecoderBlock,
    document_ids,
    document_positions,
    stack_lm_inputs,
)
from pipetransformer.models.hf import load_units
from pipetransformer.models.stage import StageModule, stage_input_shape, stage_output_shape
from pipetransformer.models.units import initial_units
from pipetransformer.orchestrator.sources import resolve_pretrained
from pipetransformer.trainer.checkpoint import load_checkpoint, save_checkpoint, tied_names
from pipetransformer.trainer.export import export

TOL = dict(rtol=0, atol=1e-5)  # fp32 (module docstring)
VOCAB, T = 120, 12
LLAMA = dict(
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=48,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)
GPT2 = dict(
    n_embd=32,
    n_layer=3,
    n_head=4,
    vocab_size=VOCAB,
    n_positions=64,
    attn_pdrop=0.0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
)
# no special tokens: greedy generate() then runs its full length (no end-of-sequence stop)
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)

MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {**LLAMA, "num_key_value_heads": 2}),
    "llama-tied": (
        LlamaConfig,
        LlamaForCausalLM,
        {**LLAMA, "num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {**LLAMA, "num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
    # layers 1 and 2 attend within a window of 4 tokens, layer 0 to everything before
    "qwen2-window": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {
            **LLAMA,
            "num_key_value_heads": 2,
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
        },
    ),
    # heads x head_dim (64) is not the hidden size (32)
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {**LLAMA, "num_key_value_heads": 2, "head_dim": 16}),
    "mistral": (
        MistralConfig,
        MistralForCausalLM,
        {**LLAMA, "num_key_value_heads": 1, "sliding_window": 4},
    ),
    "gpt2": (GPT2Config, GPT2LMHeadModel, GPT2),
    "gpt2-untied": (GPT2Config, GPT2LMHeadModel, {**GPT2, "tie_word_embeddings": False}),
}
KINDS = list(MODELS)


def make_checkpoint(kind: str, root: Path, model_cls: type | None = None) -> Path:
    """A tiny random checkpoint of `kind` (or its base model, `model_cls`) in root / kind."""
    config_cls, causal_lm, sizes = MODELS[kind]
    torch.manual_seed(0)
    config = config_cls(**sizes, **NO_SPECIAL, initializer_range=0.2)
    model = (model_cls or causal_lm)(config)
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    directory = root / kind
    model.save_pretrained(directory)
    return directory


def reference(directory: Path, kind: str, attn: str = "sdpa") -> PreTrainedModel:
    return MODELS[kind][1].from_pretrained(directory, attn_implementation=attn).eval()


def causal_lm(directory: Path) -> Architecture:
    return read_architecture(directory).for_task("causal-lm", 0)


def units_of(directory: Path, arch: Architecture, attn: str = "sdpa") -> dict:
    loaded = load_units(directory, arch, arch.unit_names(), attn_implementation=attn)
    assert loaded.skipped == [] and loaded.new == []
    return {name: unit.eval() for name, unit in loaded.units.items()}


def run(units: dict, names: list[str], x: torch.Tensor) -> torch.Tensor:
    for name in names:
        x = units[name](x)
    return x


def model_spec(directory: Path, arch: Architecture) -> ModelSpec:
    fields = arch.family_info.spec_fields(arch)
    pretrained = {"source": str(directory), "path": str(directory)}
    return ModelSpec(**fields, seq_len=T, pretrained=pretrained)


def stages(spec: ModelSpec, units: dict, cuts: list[int], **kwargs) -> list[StageModule]:
    """The model as len(cuts) + 1 StageModules, the blocks cut before each of `cuts`."""
    bounds = [0, *cuts, spec.depth]
    blocks = {i: units[f"blocks.{i}"] for i in range(spec.depth)}
    return [
        StageModule(spec, a, b, units["embed"], blocks, units["head"], **kwargs).eval()
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def batch(seed: int = 1, rows: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoders")
    return {kind: make_checkpoint(kind, root) for kind in KINDS}


# -- the forward -------------------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("kind", KINDS)
def test_units_and_stages_give_the_transformers_logits(checkpoints, kind):
    directory = checkpoints[kind]
    arch = causal_lm(directory)
    ids = batch()
    with torch.no_grad():
        want = reference(directory, kind)(input_ids=ids).logits
    units = units_of(directory, arch)
    spec = model_spec(directory, arch)
    x = stack_lm_inputs(ids)
    assert x.shape == spec.family_info.input_shape(spec, 3) == (3, 2, T)
    assert task_of(spec).target_shape(3, spec.tokens) == (3, T)
    with torch.no_grad():
        got = run(units, arch.unit_names(), x)
        hidden = run(units, ["embed", "blocks.0"], x)  # what crosses a stage boundary
        torch.testing.assert_close(got, want, **TOL)
        assert hidden.shape == (3, T, spec.width) == stage_input_shape(spec, 1, 3)
        assert spec.width == arch.hidden_size + 1
        assert torch.equal(hidden[..., -1], x[:, 1].float())  # the flag channel
        for cuts in ([], [1], [1, 2]):  # 1, 2 and 3 stages
            y = x
            for stage in stages(spec, units, cuts):
                y = stage(y)
            assert y.shape == (3, T, VOCAB) == stage_output_shape(spec, spec.depth, 3)
            torch.testing.assert_close(y, want, **TOL)


def _packed() -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, int]]]]:
    """Rows of packed documents: [A (5) B (7)], one document, [1, 3, 5, 3 tokens]."""
    documents = [[(0, 5), (5, 12)], [(0, 12)], [(0, 1), (1, 4), (4, 9), (9, 12)]]
    starts = torch.zeros(3, T, dtype=torch.long)
    for row, docs in enumerate(documents):
        for begin, _ in docs:
            starts[row, begin] = 1
    return batch(seed=2), starts, documents


@pytest.mark.numerics
@pytest.mark.parametrize(
    "kind,attn",
    [(kind, "sdpa") for kind in KINDS] + [("llama", "eager")],
)
def test_a_packed_document_is_computed_as_if_alone(checkpoints, kind, attn):
    """Each document of a packed row gets the logits of that document run alone through the
    `transformers` model: positions restart at its start, no attention crosses into it (and,
    with a sliding window, the window stays inside it)."""
    directory = checkpoints[kind]
    arch = causal_lm(directory)
    ids, starts, documents = _packed()
    ref = reference(directory, kind, attn)
    units = units_of(directory, arch, attn)
    with torch.no_grad():
        got = run(units, arch.unit_names(), stack_lm_inputs(ids, starts))
        for row, docs in enumerate(documents):
            for begin, end in docs:
                alone = ref(input_ids=ids[row : row + 1, begin:end]).logits[0]
                torch.testing.assert_close(got[row, begin:end], alone, **TOL)


def test_single_document_rows_keep_the_causal_kernel(checkpoints):
    """One document per row: the blocks pass no mask (sdpa's is_causal path, no dense mask);
    packed rows: the bool [B, 1, T, T] mask, causal within each document."""
    directory = checkpoints["llama"]
    arch = causal_lm(directory)
    units = units_of(directory, arch)
    block = units["blocks.0"]
    assert isinstance(block, DecoderBlock)
    masks: list = []
    make = block.make_mask
    block.make_mask = lambda **kw: masks.append(make(**kw)) or masks[-1]
    ids, starts, documents = _packed()
    with torch.no_grad():
        run(units, arch.unit_names(), stack_lm_inputs(ids))
        run(units, arch.unit_names(), stack_lm_inputs(ids, starts))
    single, packed = masks
    assert single is None
    assert packed.dtype == torch.bool and packed.shape == (3, 1, T, T)
    doc = document_ids(starts.bool())
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    want = (k <= q) & (doc[:, :, None] == doc[:, None, :])
    assert torch.equal(packed[:, 0], want)


def test_positions_and_documents_from_the_flags():
    ids = torch.arange(2 * 6).view(2, 6)
    x = stack_lm_inputs(ids, torch.tensor([[0, 0, 1, 0, 0, 1], [1, 0, 0, 0, 0, 0]]))
    assert x.dtype == torch.int64 and x.shape == (2, 2, 6)
    starts = x[:, 1].bool()
    assert x[:, 1, 0].tolist() == [1, 1]  # a row begins a document
    assert document_positions(starts).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert document_ids(starts).tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert torch.equal(stack_lm_inputs(ids)[:, 1], torch.tensor([[1, 0, 0, 0, 0, 0]] * 2))


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["llama-tied", "qwen3", "mistral", "gpt2"])
def test_bf16_is_close(checkpoints, kind):
    """bf16 autocast and bf16 weights run (the flag channel exact, the rotary frequencies
    float32) and stay close to float32: matrix products with 8-bit mantissas over 3 blocks
    (measured: up to 4 % of the logits' range; a wrong mask or position is off by tens of %)."""
    directory = checkpoints[kind]
    arch = causal_lm(directory)
    spec = model_spec(directory, arch)
    ids, starts, _ = _packed()
    x = stack_lm_inputs(ids, starts)
    units = units_of(directory, arch)
    with torch.no_grad():
        want = run(units, arch.unit_names(), x)
        scale = float(want.abs().max())
        autocast = stages(spec, units, [2], precision="bf16")
        bf16 = {name: copy.deepcopy(unit).to(torch.bfloat16) for name, unit in units.items()}
        weights = stages(spec, bf16, [2], precision="bf16-weights")
        for parts in (autocast, weights):
            hidden = parts[0](x)
            assert hidden.dtype == torch.float32  # what crosses a stage boundary
            assert torch.equal(hidden[..., -1], starts.float())
            got = parts[1](hidden)
            assert got.dtype == torch.float32 and torch.isfinite(got).all()
            assert float((got - want).abs().max()) < 0.1 * scale
    block = bf16["blocks.1"]
    assert next(block.parameters()).dtype == torch.bfloat16
    if block.rotary is not None:
        assert block.rotary.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("kind", ["llama-tied", "gpt2"])
def test_backward_reaches_both_tied_copies_and_not_the_flags(checkpoints, kind):
    directory = checkpoints[kind]
    arch = causal_lm(directory)
    units = units_of(directory, arch)
    for unit in units.values():
        unit.train()
    ids, starts, _ = _packed()
    boundary = run(units, ["embed", "blocks.0"], stack_lm_inputs(ids, starts))
    boundary.retain_grad()
    run(units, arch.unit_names()[2:], boundary).square().mean().backward()
    assert torch.count_nonzero(boundary.grad[..., -1]) == 0  # the flag channel
    assert boundary.grad[..., :-1].abs().sum() > 0
    (_, source), (_, tied) = arch.family_info.tied_parameters(arch)
    embedding = units["embed"].get_parameter(source)
    projection = units["head"].get_parameter(tied)
    assert embedding is not projection  # two copies, each with its own gradient
    assert embedding.grad.abs().sum() > 0 and projection.grad.abs().sum() > 0
    assert not torch.equal(embedding.grad, projection.grad)


def test_units_refuse_other_inputs(checkpoints):
    arch = causal_lm(checkpoints["llama"])
    embed = units_of(checkpoints["llama"], arch)["embed"]
    with pytest.raises(ValueError, match=r"\[batch, 2, seq_len\].*stack_lm_inputs"):
        embed(batch())


# -- the tied pair, loading ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_tied_pair_is_named_and_loaded_from_the_embedding(checkpoints, kind):
    directory = checkpoints[kind]
    arch = causal_lm(directory)
    family = arch.family_info
    stored = load_file(directory / "model.safetensors")
    units = units_of(directory, arch)
    embedding_key = (
        "transformer.wte.weight" if kind.startswith("gpt2") else "model.embed_tokens.weight"
    )
    projection = units["head"].state_dict()["lm_head.weight"]
    embedding = units["embed"].state_dict()[embedding_key]
    assert arch.tie_embeddings == (kind in ("llama-tied", "qwen2", "gpt2"))
    # the job's spec says the same (what the pipeline asks)
    assert family.tied_parameters(model_spec(directory, arch)) == family.tied_parameters(arch)
    if arch.tie_embeddings:
        assert family.tied_parameters(arch) == (
            ("embed", embedding_key),
            ("head", "lm_head.weight"),
        )
        assert "lm_head.weight" not in stored  # save_pretrained wrote the pair once
        assert torch.equal(projection, embedding)
        assert projection.data_ptr() != embedding.data_ptr()  # a copy of its own
    else:
        assert family.tied_parameters(arch) is None
        assert torch.equal(projection, stored["lm_head.weight"])
        assert not torch.equal(projection, embedding)


@pytest.mark.numerics
@pytest.mark.parametrize(
    "kind,base", [("llama", LlamaModel), ("gpt2", GPT2Model)], ids=["llama", "gpt2"]
)
def test_a_base_model_is_a_body_that_gets_its_head(tmp_path, kind, base):
    """`LlamaModel` (keys without `model.`, no lm_head): a new output projection; `GPT2Model`
    (tied): the projection is its embedding, nothing new. Both then give the logits of
    `transformers`' causal LM read from that directory (with the same new projection)."""
    directory = make_checkpoint(kind, tmp_path, model_cls=base)
    checkpoint = read_architecture(directory)
    assert checkpoint.task == "body"
    arch = checkpoint.for_task("causal-lm", 0)
    assert not arch.same_head(checkpoint) and arch.architecture == MODELS[kind][1].__name__
    torch.manual_seed(0)
    loaded = load_units(directory, arch, arch.unit_names())
    assert loaded.new == ([] if arch.tie_embeddings else ["lm_head.weight"])
    ref = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval()
    with torch.no_grad():
        ref.lm_head.weight.copy_(loaded.units["head"].lm_head.weight)
        ids = batch()
        want = ref(input_ids=ids).logits
        got = run(
            {k: u.eval() for k, u in loaded.units.items()}, arch.unit_names(), stack_lm_inputs(ids)
        )
    torch.testing.assert_close(got, want, **TOL)


def test_old_gpt2_mask_buffers_are_ignored(checkpoints, tmp_path):
    """The hub's GPT-2 holds each layer's causal-mask buffer (`h.<i>.attn.bias`), which
    `transformers` ignores when it loads it: so do the units."""
    directory = tmp_path / "old-gpt2"
    directory.mkdir()
    (directory / "config.json").write_text((checkpoints["gpt2"] / "config.json").read_text())
    tensors = load_file(checkpoints["gpt2"] / "model.safetensors")
    tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}  # as on the hub
    tensors["h.1.attn.bias"] = torch.ones(1, 1, 64, 64)
    tensors["h.1.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    arch = causal_lm(directory)
    loaded = load_units(directory, arch, ["blocks.1", "head"])
    assert loaded.skipped == [] and loaded.new == []
    assert torch.equal(loaded.units["head"].lm_head.weight, tensors["wte.weight"])


# -- parameters and FLOPs --------------------------------------------------------------------


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_parameter_counts_and_flops_are_the_models(checkpoints, kind):
    """The family's counts are the units' exactly; the `transformers` model holds a tied pair
    once, the units twice (the head's copy). FLOPs: 2 T per weight of each matrix, attention's
    4 T^2 heads x head_dim, the output projection at every token."""
    directory = checkpoints[kind]
    arch = causal_lm(directory)
    spec = model_spec(directory, arch)
    family = spec.family_info
    units = units_of(directory, arch)
    assert family.embed_params(spec) == _numel(units["embed"])
    assert family.head_params(spec) == _numel(units["head"])
    for i in range(spec.depth):
        assert family.block_params(spec) == _numel(units[f"blocks.{i}"])
    total = sum(_numel(unit) for unit in units.values())
    hf_total = _numel(reference(directory, kind))  # parameters(): a tied tensor once
    assert total == hf_total + (VOCAB * spec.dim if spec.tie_embeddings else 0)

    matrices = sum(p.numel() for p in units["blocks.0"].parameters() if p.dim() == 2)
    q = spec.heads * (spec.head_dim or spec.dim // spec.heads)
    assert family.block_flops(spec) == 2 * T * matrices + 4 * T * T * q
    assert family.head_flops(spec) == 2 * T * spec.dim * VOCAB
    assert family.embed_flops(spec) == 0
    forward = spec.depth * family.block_flops(spec) + family.head_flops(spec)
    assert training_flops_per_sample(spec) == 3 * forward
    assert training_flops_per_sample(spec, boundary=1, cached=True) == 3 * (
        forward - family.block_flops(spec)
    )


# -- config.json, the spec ----------------------------------------------------------------------


def _config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def test_config_json_fields_become_the_spec(checkpoints):
    gpt2 = read_architecture(checkpoints["gpt2"])  # n_embd, n_layer, n_head, n_positions
    assert (gpt2.task, gpt2.hidden_size, gpt2.depth, gpt2.heads) == ("causal-lm", 32, 3, 4)
    assert (gpt2.intermediate_size, gpt2.max_position_embeddings) == (128, 64)  # n_inner: 4 d
    assert gpt2.tie_embeddings and gpt2.num_labels == VOCAB
    family = gpt2.family_info
    assert family.max_seq_len(gpt2) == 64
    assert family.spec_fields(gpt2) == {
        "family": "gpt2",
        "task": "causal-lm",
        "dim": 32,
        "depth": 3,
        "heads": 4,
        "mlp_ratio": 4.0,
        "vocab_size": VOCAB,
        "num_classes": VOCAB,
        "kv_heads": 4,
        "head_dim": 8,
        "tie_embeddings": True,
        "max_positions": 64,
    }
    qwen3 = read_architecture(checkpoints["qwen3"])
    assert (qwen3.kv_heads, qwen3.head_dim, qwen3.tie_embeddings) == (2, 16, False)
    spec = model_spec(checkpoints["qwen3"], qwen3)
    assert (spec.tokens, spec.width, spec.task) == (T, 33, "causal-lm")
    assert spec.family_info.input_dtype(spec) == "int64"
    with pytest.raises(ValueError, match="num_classes is vocab_size"):
        ModelSpec(**{**spec.model_dump(), "num_classes": 10})
    too_long = {**model_spec(checkpoints["gpt2"], gpt2).model_dump(), "seq_len": 65}
    with pytest.raises(ValueError, match=r"max_positions 64"):
        ModelSpec(**too_long)
    raw = _config(checkpoints["qwen3"])
    del raw["head_dim"]  # Qwen3Config's default
    assert parse_architecture(raw).head_dim == 128


def test_a_job_spec_resolves_from_a_causal_lm_checkpoint(checkpoints, tmp_path):
    spec = _job_spec(checkpoints["mistral"], tmp_path)
    m = spec.model
    assert (m.family, m.task, m.num_classes, m.vocab_size, m.seq_len) == (
        "mistral",
        "causal-lm",
        VOCAB,
        VOCAB,
        64,  # the default 128, cut to the checkpoint's position table
    )
    assert (m.kv_heads, m.head_dim, m.tie_embeddings, m.max_positions) == (1, 8, False, None)


def test_a_spec_contradicting_the_decoder_is_named_and_a_base_model_needs_no_classes(
    checkpoints, tmp_path
):
    """A spec field the checkpoint decides (grouped-query heads, tying) that says otherwise is
    an error naming it; a base model (`LlamaModel`) trains causal-lm without num_classes (its
    outputs are its vocabulary)."""
    for field, value, config in (
        ("kv_heads", 4, "num_key_value_heads"),
        ("tie_embeddings", True, "tie_word_embeddings"),
    ):
        raw = {
            "name": "lm",
            "model": {"pretrained": str(checkpoints["llama"]), field: value},
            "data": {"dataset": "table", "train": "a.jsonl", "test": "b.jsonl"},
        }
        with pytest.raises(SpecError, match=f"model.{field}: .* config.json {config} gives"):
            resolve_pretrained(parse_spec(raw), tmp_path)
    base = tmp_path / "base"
    LlamaModel(AutoConfig.from_pretrained(checkpoints["llama"])).save_pretrained(base)
    raw = {
        "name": "lm",
        "model": {"pretrained": str(base), "task": "causal-lm"},
        "data": {"dataset": "table", "train": "a.jsonl", "test": "b.jsonl"},
    }
    model = resolve_pretrained(parse_spec(raw), tmp_path).model
    assert (model.task, model.num_classes) == ("causal-lm", VOCAB)


@pytest.mark.parametrize(
    "kind,change,field",
    [
        ("llama", {"model_type": "t5"}, "`model_type`"),
        ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "`architectures`"),
        ("gpt2", {"architectures": ["GPT2DoubleHeadsModel"]}, "`architectures`"),
        ("llama", {"num_key_value_heads": 3}, "`num_key_value_heads`"),
        ("mistral", {"sliding_window": 0}, "`sliding_window`"),
        ("qwen2-window", {"sliding_window": "4"}, "`sliding_window`"),
        ("qwen2", {"use_sliding_window": "yes"}, "`use_sliding_window`"),
        ("llama", {"tie_word_embeddings": 1}, "`tie_word_embeddings`"),
        ("gpt2", {"n_embd": 30}, "`n_embd` 30 is not a multiple of `n_head` 4"),
        ("gpt2", {"add_cross_attention": True}, "`add_cross_attention`"),
    ],
)
def test_unsupported_config_is_refused_by_name(checkpoints, kind, change, field):
    raw = {**_config(checkpoints[kind]), **change}
    with pytest.raises(ValueError, match=field):
        checkpoint_family(raw).parse_config(raw)


def test_a_decoder_trains_only_causal_lm(checkpoints):
    arch = read_architecture(checkpoints["llama"])
    with pytest.raises(ValueError, match="'classification' is not available for llama"):
        arch.for_task("classification", 3)


# -- the export -----------------------------------------------------------------------------------


def _job_spec(directory: Path, root: Path):  # noqa: ANN202
    raw = {
        "name": "lm",
        "model": {"pretrained": str(directory)},
        "data": {
            "dataset": "table",
            "train": "train.parquet",
            "test": "test.parquet",
            "columns": {"text": "text"},
        },
    }
    return resolve_pretrained(parse_spec(raw), root)


def _greedy(module: StageModule, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    ids = prompt
    for _ in range(steps):
        logits = module(stack_lm_inputs(ids))
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return ids


def _checkpointed(directory: Path, root: Path):  # noqa: ANN202
    """A checkpoint of a causal-lm job on `directory`, written as the pipeline writes one after
    training moved every weight (a tied pair's copies alike): (the spec, the model, its units,
    the checkpoint's directory, the optimizer)."""
    spec = _job_spec(directory, root)
    names = spec.model.family_info.parse_config(_config(directory)).unit_names()
    units = initial_units(spec.model, 0, names)
    model = stages(spec.model, units, [])[0]
    tied = spec.model.family_info.tied_parameters(spec.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        if tied is not None:
            (_, source), (_, copy_name) = tied
            units["head"].get_parameter(copy_name).copy_(units["embed"].get_parameter(source))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # state for every parameter, nothing moved
    step = root / "checkpoints" / "step-00000001"
    save_checkpoint(step, model, optimizer, {"step": 1}, tied=tied_names(spec.model))
    return spec, model, units, step, optimizer


def _exported(directory: Path, root: Path):  # noqa: ANN202
    """`_checkpointed`'s checkpoint exported: (the job's model, its units, the export's result)."""
    spec, model, units, step, _ = _checkpointed(directory, root)
    return model, units, export(step, spec, root / "exported")


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["llama-tied", "gpt2", "qwen3"])
def test_the_export_is_the_causal_lm(checkpoints, tmp_path, kind):
    """The export of a causal-lm job's checkpoint is the family's *ForCausalLM: a tied pair
    written once, the same logits as the units, and greedy `generate()` (with its KV cache)
    picks the tokens the units pick."""
    model, units, done = _exported(checkpoints[kind], tmp_path)
    out = done.directory
    assert done.left_out == []
    config = _config(out)
    assert config["architectures"] == [MODELS[kind][1].__name__]
    assert "id2label" not in config and config["vocab_size"] == VOCAB
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        written = set(f.keys())
    assert ("lm_head.weight" in written) == (kind == "qwen3")  # qwen3's is untied
    assert done.tensors == len(written)
    exported = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    assert type(exported).__name__ == MODELS[kind][1].__name__
    ids = batch(seed=2)[1:2]
    with torch.no_grad():
        want = model(stack_lm_inputs(ids))
        torch.testing.assert_close(exported(input_ids=ids).logits, want, **TOL)
        torch.testing.assert_close(
            exported.lm_head.weight, units["head"].lm_head.weight, rtol=0, atol=0
        )
        prompt = ids[:, :3]
        generated = exported.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False
        )
        assert generated.shape == (1, 9)
        assert torch.equal(generated, _greedy(model, prompt, 6))


@pytest.mark.parametrize("kind", ["llama-tied", "gpt2", "qwen3"])
def test_a_checkpoint_holds_the_tied_pair_once(checkpoints, tmp_path, kind):
    """A tied pair's weights and optimizer state are one tensor each in the checkpoint (the
    untied head's projection its own); a rank holding only the head (the last stage of a
    pipeline) loads its copy, and the copy's optimizer state, from it."""
    spec, model, units, step, saved = _checkpointed(checkpoints[kind], tmp_path)
    stored = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    sizes = {k: v.size.numel() for k, v in stored.items()}
    tied = tied_names(spec.model)
    unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    vocab_x_width = VOCAB * spec.model.dim
    if tied is None:
        assert not any("+" in k for k in sizes)
        assert sum(v for k, v in sizes.items() if k.startswith("model.")) == unique
        return
    key = f"embed+{tied[0].partition('.')[2]}"
    assert sizes[f"model.{key}"] == vocab_x_width
    assert sum(v for k, v in sizes.items() if k.startswith("model.")) == unique - vocab_x_width
    moments = [k for k in sizes if k.startswith(f"optim.{key}")]
    assert sizes[moments[0]] == 2 * vocab_x_width + 1  # exp_avg, exp_avg_sq, step: once

    names = spec.model.family_info.parse_config(_config(checkpoints[kind])).unit_names()
    head = torch.nn.Module()  # the last stage's rank: the head alone, under its state name
    head.add_module("head", initial_units(spec.model, 1, names[-1:])["head"])
    optimizer = torch.optim.AdamW(head.parameters(), lr=0.0)
    load_checkpoint(step, head, optimizer, tied=tied)
    (_, source), (_, copy_name) = spec.model.family_info.tied_parameters(spec.model)
    want = units["embed"].get_parameter(source)
    got = head.get_parameter(f"head.{copy_name}")
    assert torch.equal(got, want)
    assert torch.equal(optimizer.state[got]["exp_avg"], saved.state[want]["exp_avg"])


def test_fine_tuning_from_another_decoder_names_what_differs(checkpoints, tmp_path):
    """`init.checkpoint` from a job of another decoder: the grouped-query width and the tied
    pair (which changes the checkpoint's keys) are named, as the encoders' fields are."""
    from pipetransformer.orchestrator.pretrained import architecture_mismatch

    untied = _job_spec(checkpoints["llama"], tmp_path / "a").model
    tied = _job_spec(checkpoints["llama-tied"], tmp_path / "b").model
    assert architecture_mismatch(untied.model_dump(), untied, []) == []
    named = architecture_mismatch(tied.model_dump(), untied, [])
    assert "model.tie_embeddings: True there, False here" in named
    wider = {**untied.model_dump(), "kv_heads": 4}  # a checkpoint of 4 KV heads, not 2
    assert architecture_mismatch(wider, untied, []) == ["model.kv_heads: 4 there, 2 here"]


def test_both_tied_copies_on_one_rank_resume_with_state_of_their_own(checkpoints, tmp_path):
    """1x1 holds both copies: loaded from the one tensor, each gets its own weights and moments
    (shared moments would be stepped twice), and a step after the resume keeps them equal."""
    spec, _, _, step, _ = _checkpointed(checkpoints["llama-tied"], tmp_path)
    names = spec.model.family_info.parse_config(_config(checkpoints["llama-tied"])).unit_names()
    model = stages(spec.model, initial_units(spec.model, 3, names), [])[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_checkpoint(step, model, optimizer, tied=tied_names(spec.model))
    embed, head = (model.get_parameter(n) for n in tied_names(spec.model))
    assert torch.equal(embed, head) and embed.data_ptr() != head.data_ptr()
    for key in ("exp_avg", "exp_avg_sq", "step"):
        a, b = optimizer.state[embed][key], optimizer.state[head][key]
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), key
    grad = torch.randn_like(embed)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    embed.grad.copy_(grad)
    head.grad.copy_(grad)  # as TiedGrads leaves them: both the sum
    optimizer.step()
    assert torch.equal(embed, head)
    assert float(optimizer.state[embed]["step"]) == float(optimizer.state[head]["step"]) == 2.0
