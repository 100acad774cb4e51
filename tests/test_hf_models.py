"""Hugging Face checkpoints as the pipeline's units (trainer/hf): tiny ViT, DeiT, BERT and RoBERTa
models made here with `save_pretrained`, then loaded unit by unit and compared with the
`transformers` model's own forward."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForImageClassification,
    AutoModelForQuestionAnswering,
    BertConfig,
    BertForMaskedLM,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    DeiTConfig,
    DeiTForImageClassification,
    PreTrainedModel,
    RobertaConfig,
    RobertaForSequenceClassification,
    ViTConfig,
    ViTForImageClassification,
    ViTModel,
)

import pipetransformer.models.hf as hf_load
from pipetransformer.core.families import Architecture
from pipetransformer.edge.hf_files import read_architecture
from pipetransformer.models.bert import stack_text_inputs
from pipetransformer.models.hf import load_units

SIZES = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64)
IMAGE = dict(image_size=16, patch_size=4, num_channels=3)
TEXT = dict(vocab_size=100, max_position_embeddings=40, type_vocab_size=2)

MODELS = {
    "vit": (ViTConfig, ViTForImageClassification, IMAGE),
    "deit": (DeiTConfig, DeiTForImageClassification, IMAGE),
    "bert": (BertConfig, BertForSequenceClassification, TEXT),
    "roberta": (RobertaConfig, RobertaForSequenceClassification, TEXT),
    "bert-qa": (BertConfig, BertForQuestionAnswering, TEXT),
    # checkpoints without a usable head: a base model (keys without the `vit.` prefix) and a
    # pretraining head (masked language modelling)
    "vit-body": (ViTConfig, ViTModel, IMAGE),
    "bert-mlm": (BertConfig, BertForMaskedLM, TEXT),
}
TOL = dict(rtol=0, atol=1e-5)  # fp32: same kernels, same order -> equal up to rounding


def make_checkpoint(kind: str, root: Path, num_labels: int = 3) -> Path:
    config_cls, model_cls, extra = MODELS[kind]
    if kind == "bert-qa":
        num_labels = 2  # start and end
    torch.manual_seed(0)
    config = config_cls(**SIZES, **extra, num_labels=num_labels)
    model = model_cls(config)
    with torch.no_grad():  # non-trivial LayerNorm affine values and biases
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    directory = root / kind
    model.save_pretrained(directory)
    return directory


def reference(directory: Path, kind: str, attn: str = "sdpa") -> PreTrainedModel:
    model_cls = MODELS[kind][1]
    return model_cls.from_pretrained(directory, attn_implementation=attn).eval()


def text_batch(pairs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, attention mask (padding at the end of row 1 and 2), token type ids (the second
    sentence of a pair is type 1)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    ids[mask == 0] = 1  # the pad id of bert (0) or roberta (1): any id, masked out anyway
    types = torch.zeros_like(ids)
    if pairs:
        types[:, 4:] = 1
        types[mask == 0] = 0
    return ids, mask, types


def inputs_and_logits(kind: str, model: PreTrainedModel, pairs: bool = False):
    """(the first stage's one input tensor, the reference logits)."""
    if kind in ("vit", "deit"):
        pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            return pixels, model(pixel_values=pixels).logits
    ids, mask, types = text_batch(pairs)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    logits = (
        torch.stack([out.start_logits, out.end_logits], -1) if kind == "bert-qa" else out.logits
    )
    return stack_text_inputs(ids, mask, types), logits


def run(units: dict[str, torch.nn.Module], names: list[str], x: torch.Tensor) -> torch.Tensor:
    for name in names:
        x = units[name](x)
    return x


CASES = [
    ("vit", False, "sdpa"),
    ("deit", False, "sdpa"),
    ("bert", False, "sdpa"),
    ("bert", True, "sdpa"),
    ("bert", True, "eager"),
    ("roberta", False, "sdpa"),
    ("roberta", True, "eager"),
    ("bert-qa", True, "sdpa"),
]


@pytest.mark.numerics
@pytest.mark.parametrize("kind,pairs,attn", CASES)
def test_units_compose_to_the_transformers_forward(tmp_path, kind, pairs, attn):
    directory = make_checkpoint(kind, tmp_path)
    arch = read_architecture(directory)
    x, expected = inputs_and_logits(kind, reference(directory, kind, attn), pairs)
    loaded = load_units(directory, arch, arch.unit_names(), attn_implementation=attn)
    assert loaded.skipped == []
    for unit in loaded.units.values():
        unit.eval()
    names = arch.unit_names()
    with torch.no_grad():
        whole = run(loaded.units, names, x)
        # a 2x1 pipeline: embed + the first blocks on one stage, the rest + head on the other,
        # each stage's units loaded on their own
        cut = 1 + arch.depth // 2
        first = load_units(directory, arch, names[:cut], attn_implementation=attn).units
        second = load_units(directory, arch, names[cut:], attn_implementation=attn).units
        for unit in [*first.values(), *second.values()]:
            unit.eval()
        boundary = run(first, names[:cut], x)
        split = run(second, names[cut:], boundary)
    if arch.is_text:
        assert boundary.shape == (3, 12, arch.hidden_size + 1)  # the mask channel
        assert torch.equal(boundary[..., -1], x[:, 2].float())
    assert whole.shape == expected.shape
    torch.testing.assert_close(whole, expected, **TOL)
    torch.testing.assert_close(split, expected, **TOL)


def test_architecture_read_from_config_json(tmp_path):
    vit = read_architecture(make_checkpoint("vit", tmp_path))
    assert vit == Architecture(
        family="vit",
        task="image-classification",
        architecture="ViTForImageClassification",
        depth=3,
        hidden_size=32,
        heads=4,
        intermediate_size=64,
        num_labels=3,
        image_size=16,
        patch_size=4,
        num_channels=3,
    )
    qa = read_architecture(make_checkpoint("bert-qa", tmp_path))
    assert (qa.family, qa.task, qa.num_labels) == ("bert", "question-answering", 2)
    assert (qa.vocab_size, qa.max_position_embeddings, qa.type_vocab_size) == (100, 40, 2)
    assert qa.unit_names() == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]


@pytest.mark.parametrize(
    "change,field",
    [
        ({"model_type": "t5"}, "`model_type`"),
        ({"architectures": ["BertForTokenClassification"]}, "`architectures`"),
        ({"architectures": None}, "`architectures`"),
    ],
)
def test_unsupported_config_is_refused_by_name(tmp_path, change, field):
    directory = make_checkpoint("bert", tmp_path)
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(ValueError, match=field) as info:
        read_architecture(directory)
    assert "allowed" in str(info.value)


@pytest.mark.parametrize("kind", ["vit", "bert"])
def test_one_block_reads_only_its_own_tensors(tmp_path, monkeypatch, kind):
    directory = make_checkpoint(kind, tmp_path)
    arch = read_architecture(directory)
    read: list[str] = []
    real_safe_open = hf_load.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            read.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(hf_load, "safe_open", Spy)
    block = load_units(directory, arch, ["blocks.1"]).units["blocks.1"]
    prefix = f"{arch.family}.encoder.layer.1."
    state = block.state_dict()
    checkpoint = load_file(directory / "model.safetensors")
    own = sorted(k for k in checkpoint if k.startswith(prefix))
    assert sorted(state) == own
    assert sorted(read) == own  # nothing else was read
    assert sorted(n for n, _ in block.named_parameters()) == own  # one name per parameter
    for key in own:
        assert torch.equal(state[key], checkpoint[key]), key


def test_sharded_checkpoint(tmp_path):
    directory = make_checkpoint("bert", tmp_path)
    model = reference(directory, "bert")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    arch = read_architecture(sharded)
    units = load_units(sharded, arch, arch.unit_names()).units
    expected = dict(model.state_dict())
    for unit in units.values():
        for key, value in unit.state_dict().items():
            assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("kind", ["vit", "bert", "roberta"])
def test_new_label_count_skips_and_reinitialises_the_head(tmp_path, kind):
    directory = make_checkpoint(kind, tmp_path, num_labels=3)
    arch = read_architecture(directory)
    new = dataclasses.replace(arch, num_labels=50)
    torch.manual_seed(3)
    loaded = load_units(directory, new, ["head"])
    out = {"vit": "classifier", "bert": "classifier", "roberta": "classifier.out_proj"}[kind]
    assert loaded.skipped == [f"{out}.bias", f"{out}.weight"]
    head = loaded.units["head"]
    weight, bias = head.get_submodule(out).weight, head.get_submodule(out).bias
    assert weight.shape == (50, 32) and bias.shape == (50,)
    assert torch.count_nonzero(bias) == 0
    std = loaded.config.initializer_range  # 0.02; 1600 samples: the estimate is within ~4%
    assert abs(weight.mean().item()) < 3 * std / 40
    assert 0.85 * std < weight.std().item() < 1.15 * std
    checkpoint = load_file(directory / "model.safetensors")
    for key, value in head.state_dict().items():  # the rest of the head is the checkpoint's
        if not key.startswith(out + "."):
            assert torch.equal(value, checkpoint[key]), key


def test_missing_and_unexpected_keys_are_named(tmp_path):
    directory = make_checkpoint("bert", tmp_path)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    tensors["bert.encoder.layer.1.extra.weight"] = torch.zeros(1)
    del tensors["bert.encoder.layer.1.output.dense.bias"]
    save_file(tensors, path, metadata={"format": "pt"})
    arch = read_architecture(directory)
    with pytest.raises(ValueError) as info:
        load_units(directory, arch, ["blocks.1"])
    message = str(info.value)
    assert "missing keys [bert.encoder.layer.1.output.dense.bias]" in message
    assert "unexpected keys [bert.encoder.layer.1.extra.weight]" in message
    load_units(directory, arch, ["blocks.0", "head"])  # the other units are untouched


@pytest.mark.parametrize("kind", ["bert", "roberta", "vit", "deit"])
def test_backward_reaches_the_embedding_and_not_the_mask(tmp_path, kind):
    directory = make_checkpoint(kind, tmp_path)
    arch = read_architecture(directory)
    units = load_units(directory, arch, arch.unit_names()).units
    for unit in units.values():
        unit.train()
    block = units["blocks.0"]
    assert block.layer.training  # the layer a ViT block holds unregistered follows train()
    x, _ = inputs_and_logits(kind, reference(directory, kind), pairs=True)
    names = arch.unit_names()
    boundary = run(units, names[:2], x)  # what crosses a stage boundary
    boundary.retain_grad()
    run(units, names[2:], boundary).square().sum().backward()
    for name, p in units["embed"].named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert boundary.grad[..., : arch.hidden_size].abs().sum() > 0
    if arch.is_text:
        assert torch.count_nonzero(boundary.grad[..., -1]) == 0  # the mask channel
    block.eval()
    assert not block.layer.training


@pytest.mark.numerics
@pytest.mark.parametrize(
    "kind,task,auto",
    [
        ("vit-body", "classification", AutoModelForImageClassification),
        ("bert-mlm", "question-answering", AutoModelForQuestionAnswering),
        ("bert", "question-answering", AutoModelForQuestionAnswering),
    ],
)
def test_a_checkpoint_without_the_head_gets_a_new_one(tmp_path, kind, task, auto):
    """What users start from: `google/vit-base-patch16-224-in21k` is a `ViTModel` (keys without
    the prefix), `bert-large-uncased` a `BertForMaskedLM`; or a classifier fine-tuned for another
    task. The body is read as `transformers` reads it, the head is new and said so, and with the
    same head weights the units give the `transformers` task model's logits."""
    directory = make_checkpoint(kind, tmp_path)
    checkpoint = read_architecture(directory)
    arch = checkpoint.for_task(task, 3)
    assert not arch.same_head(checkpoint)
    torch.manual_seed(0)
    loaded = load_units(directory, arch, arch.unit_names())
    head = loaded.units["head"]
    out = "qa_outputs" if task == "question-answering" else "classifier"
    assert {k.rpartition(".")[0] for k in loaded.new} >= {out}
    if kind == "vit-body":  # the base model's final norm is the head's, read from the checkpoint
        assert "vit.layernorm.weight" not in loaded.new
        stored = load_file(directory / "model.safetensors")
        assert torch.equal(head.state_dict()["vit.layernorm.weight"], stored["layernorm.weight"])
    if kind == "bert":  # the classifier's head is not the question-answering one
        assert loaded.skipped == [] and "bert.pooler.dense.weight" not in dict(
            head.named_parameters()
        )
    ref = auto.from_pretrained(directory, attn_implementation="sdpa", num_labels=arch.num_labels)
    getattr(ref, out).load_state_dict(head.get_submodule(out).state_dict())
    ref_kind = "bert-qa" if task == "question-answering" else "vit"
    x, expected = inputs_and_logits(ref_kind, ref.eval(), pairs=True)
    for unit in loaded.units.values():
        unit.eval()
    with torch.no_grad():
        got = run(loaded.units, arch.unit_names(), x)
    torch.testing.assert_close(got, expected, **TOL)


def test_legacy_layernorm_names_are_read(tmp_path):
    """Older BERT checkpoints (the hub's `bert-base-uncased`) name LayerNorm parameters
    `gamma`/`beta`, as `transformers` still reads them."""
    directory = make_checkpoint("bert", tmp_path)
    arch = read_architecture(directory)
    want = load_units(directory, arch, ["embed", "blocks.0"]).units
    path = directory / "model.safetensors"
    tensors = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in load_file(path).items()
    }
    assert any(k.endswith("LayerNorm.gamma") for k in tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    got = load_units(directory, arch, ["embed", "blocks.0"]).units
    for name in want:
        for (k, a), (_, b) in zip(
            want[name].state_dict().items(), got[name].state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), k


def test_an_image_model_cannot_answer_questions(tmp_path):
    arch = read_architecture(make_checkpoint("vit", tmp_path))
    with pytest.raises(ValueError, match="model.task"):
        arch.for_task("question-answering", 2)
