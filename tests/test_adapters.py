"""LoRA adapters (`model.adapters`) in one process: the units carry `peft`'s own LoRA layers,
only the adapters (and a new head's output layer) train, a job starts from the pretrained model
exactly, training the adapters matches a plain `peft` model step for step, a merged block is the
unmerged one, a checkpoint holds only what trains, and the export is PEFT's format (or, merged,
a plain model) with the job's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pipetransformer.core.spec import parse_spec
from pipetransformer.models.adapters import is_adapter, is_merged, merge, peft_key
from pipetransformer.models.decoder import stack_lm_inputs
from pipetransformer.models.stage import StageModule
from pipetransformer.models.units import architecture, initial_units
from pipetransformer.orchestrator.sources import resolve_pretrained
from pipetransformer.trainer.checkpoint import (
    load_checkpoint,
    model_tensors,
    save_checkpoint,
)
from pipetransformer.trainer.export import export
from tests.equivalence import peft_model_of
from tests.lm_assets import make_lm

T = 16
# float32 on the CPU: the same sums in another order (peft's forward against the units') differ
# in the last bits; a few steps of AdamW carry that through as ~1e-5 relative
TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lm(tmp_path_factory.mktemp("lm") / "llama")


def _spec(checkpoint: Path, root: Path, adapters: dict | None = None):  # noqa: ANN202
    raw = {
        "name": "lm",
        "model": {
            "pretrained": str(checkpoint),
            "seq_len": T,
            "adapters": adapters if adapters is not None else {"rank": 4, "alpha": 8},
        },
        "data": {"dataset": "table", "train": "a.jsonl", "test": "b.jsonl"},
    }
    return resolve_pretrained(parse_spec(raw), root)


def _whole(spec, units: dict) -> StageModule:  # noqa: ANN001
    blocks = {i: units[f"blocks.{i}"] for i in range(spec.model.depth)}
    return StageModule(spec.model, 0, spec.model.depth, units["embed"], blocks, units["head"])


def _units(spec, seed: int = 0) -> dict:  # noqa: ANN001
    return initial_units(spec.model, seed, architecture(spec.model).unit_names())


def _ids(seed: int = 1, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, 200, (rows, T), generator=torch.Generator().manual_seed(seed))


def test_only_the_adapters_train_and_the_job_starts_from_the_pretrained_model(
    llama: Path, tmp_path: Path
) -> None:
    spec = _spec(llama, tmp_path)
    units = _units(spec)
    trainable = [
        f"{u}.{n}" for u, m in units.items() for n, p in m.named_parameters() if p.requires_grad
    ]
    assert trainable and all(is_adapter(n) for n in trainable)
    # every block's seven projections, two matrices each
    assert len(trainable) == spec.model.depth * 7 * 2
    assert all(n.startswith("blocks.") for n in trainable)
    # B starts at zero: the logits are the pretrained model's
    reference = AutoModelForCausalLM.from_pretrained(llama).eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(
            _whole(spec, units).eval()(stack_lm_inputs(ids)),
            reference(input_ids=ids).logits,
            **TOL,
        )
    # the same seed draws the same adapters on every rank; another seed others
    again, other = _units(spec), _units(spec, seed=1)
    a = "model.layers.1.self_attn.q_proj.lora_A.default.weight"
    assert torch.equal(units["blocks.1"].get_parameter(a), again["blocks.1"].get_parameter(a))
    assert not torch.equal(units["blocks.1"].get_parameter(a), other["blocks.1"].get_parameter(a))


def test_training_the_adapters_is_a_peft_model_step_for_step(llama: Path, tmp_path: Path) -> None:
    """The units with adapters against `peft.get_peft_model` on the `transformers` model, given
    the same adapter values: 3 AdamW steps on the same batch give the same logits."""
    spec = _spec(
        llama, tmp_path, {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}
    )
    units = _units(spec)
    ours = _whole(spec, units)
    peft_model = peft_model_of(spec.model, units)
    mine = [p for u in units.values() for p in u.parameters() if p.requires_grad]
    assert len(mine) == sum(p.requires_grad for p in peft_model.parameters())
    opts = [torch.optim.AdamW(mine, lr=1e-2), torch.optim.AdamW(
        [p for p in peft_model.parameters() if p.requires_grad], lr=1e-2
    )]  # fmt: skip
    ids = _ids(rows=3)
    labels = ids[:, 1:].reshape(-1)
    for _ in range(3):
        for opt, forward in (
            (opts[0], lambda: ours(stack_lm_inputs(ids))),
            (opts[1], lambda: peft_model(input_ids=ids).logits),
        ):
            logits = forward()[:, :-1].reshape(-1, spec.model.num_classes)
            torch.nn.functional.cross_entropy(logits, labels).backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(stack_lm_inputs(ids)), peft_model(input_ids=ids).logits, **TOL
        )


def test_a_merged_block_computes_what_the_unmerged_one_does(llama: Path, tmp_path: Path) -> None:
    spec = _spec(llama, tmp_path)
    units = _units(spec)
    with torch.no_grad():
        for unit in units.values():
            for name, p in unit.named_parameters():
                if is_adapter(name):
                    p.normal_(0, 0.05)  # trained adapters: B no longer zero
    model = _whole(spec, units).eval()
    ids = stack_lm_inputs(_ids())
    kept = {k: v.clone() for k, v in model_tensors(units["blocks.0"]).items()}
    with torch.no_grad():
        before = model(ids)
        merge(units["blocks.0"])
        assert is_merged(units["blocks.0"]) and not is_merged(units["blocks.1"])
        assert not any(p.requires_grad for p in units["blocks.0"].parameters())
        torch.testing.assert_close(model(ids), before, **TOL)
    # what a checkpoint, a re-layout or the export takes of a merged block: its adapters, the
    # same values bit for bit as before the merge
    after = model_tensors(units["blocks.0"])
    assert set(after) == set(kept) and all(is_adapter(n) for n in after)
    assert all(torch.equal(after[k], kept[k]) for k in kept)


def _holder(units: dict) -> torch.nn.Module:
    """The units under the names a rank's model gives them (`embed`, `blocks.<i>`, `head`)."""
    holder = torch.nn.Module()
    holder.add_module("embed", units["embed"])
    blocks = {n.split(".")[1]: u for n, u in units.items() if n.startswith("blocks.")}
    holder.add_module("blocks", torch.nn.ModuleDict(blocks))
    holder.add_module("head", units["head"])
    return holder


def test_bf16_weights_keep_float32_masters_of_the_adapters_alone(
    llama: Path, tmp_path: Path
) -> None:
    """Under `bf16-weights` the model computes in bf16 and the optimizer steps float32 masters:
    with adapters, masters of the training state only (the base is never updated)."""
    from pipetransformer.models.adapters import in_state
    from pipetransformer.trainer.optim import MasterWeights

    holder = _holder(_units(_spec(llama, tmp_path)))
    master = MasterWeights(holder, torch.bfloat16, keep=in_state)
    mastered = [n for n, _ in master.module.named_parameters()]
    assert mastered and mastered == [n for n, _ in holder.named_parameters() if is_adapter(n)]
    assert {p.dtype for p in holder.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in master.module.parameters()} == {torch.float32}


def _checkpointed(units: dict, root: Path) -> Path:
    """The units, their adapters moved as training moves them, checkpointed as a 1x1 job
    writes them (optimizer state for what trains)."""
    holder = _holder(units)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if is_adapter(name):
                p.normal_(0, 0.05)
    trained = [p for p in holder.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.0)
    for p in trained:
        p.grad = torch.randn_like(p)
    optimizer.step()  # state for every adapter, nothing moved
    step = root / "checkpoints" / "step-00000001"
    save_checkpoint(step, holder, optimizer, {"step": 1})
    return step


def test_a_checkpoint_holds_the_adapters_not_the_base_and_resumes(
    llama: Path, tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp

    spec = _spec(llama, tmp_path)
    units = _units(spec)
    step = _checkpointed(units, tmp_path)
    stored = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    held = sum(v.size.numel() for k, v in stored.items() if k.startswith("model."))
    adapters = sum(
        p.numel() for u in units.values() for n, p in u.named_parameters() if is_adapter(n)
    )
    assert held == adapters  # no base weight, no embedding, no head
    # a fresh build (base from the pretrained checkpoint, adapters drawn anew) resumes from it
    fresh = _units(spec, seed=5)
    holder = _holder(fresh)
    optimizer = torch.optim.AdamW([p for p in holder.parameters() if p.requires_grad], lr=0.0)
    load_checkpoint(step, holder, optimizer)
    ids = stack_lm_inputs(_ids())
    with torch.no_grad():
        torch.testing.assert_close(
            _whole(spec, fresh).eval()(ids), _whole(spec, units).eval()(ids), rtol=0, atol=0
        )


@pytest.mark.parametrize("merged", [False, True])
def test_the_export_is_peft_s_format_or_a_merged_model_with_the_job_s_logits(
    llama: Path, tmp_path: Path, merged: bool
) -> None:
    from peft import PeftModel

    spec = _spec(llama, tmp_path)
    units = _units(spec)
    step = _checkpointed(units, tmp_path)
    done = export(step, spec, tmp_path / "out", merge=merged)
    out = done.directory
    ids = _ids()
    with torch.no_grad():
        want = _whole(spec, units).eval()(stack_lm_inputs(ids))
    if merged:
        assert not (out / "adapter_config.json").exists() and (out / "model.safetensors").exists()
        model = AutoModelForCausalLM.from_pretrained(out).eval()
        assert not any("lora" in n for n, _ in model.named_parameters())
    else:
        assert sorted(p.name for p in out.iterdir() if "adapter" in p.name) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
        assert keys == {
            peft_key(f"{n}")
            for u in units.values()
            for n, _ in u.named_parameters()
            if is_adapter(n)
        }
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), out).eval()
    assert (out / "tokenizer.json").exists()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, **TOL)


def test_an_encoder_with_a_new_head_trains_its_classifier_beside_the_adapters(
    tmp_path: Path,
) -> None:
    """A BERT checkpoint (a masked-LM body) fine-tuned to classify 3 labels with adapters on
    query and value: the new classifier trains whole (the pooler stays the checkpoint's), the
    export names it in PEFT's `modules_to_save`, and `PeftModel` on
    `BertForSequenceClassification` of 3 labels gives the units' logits."""
    import sys

    from peft import PeftModel
    from transformers import BertForSequenceClassification

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from assets import make_bert

    bert = make_bert(tmp_path / "bert", hidden=32, layers=2, heads=2, max_positions=32)
    raw = {
        "name": "bert",
        "model": {
            "pretrained": str(bert),
            "num_classes": 3,
            "seq_len": 16,
            "adapters": {"rank": 4, "targets": ["query", "value"]},
        },
        "data": {
            "dataset": "table",
            "train": "a.jsonl",
            "test": "b.jsonl",
            "columns": {"text": "text"},
        },
    }
    spec = resolve_pretrained(parse_spec(raw), tmp_path)
    units = _units(spec)
    trains = {u: [n for n, p in m.named_parameters() if p.requires_grad] for u, m in units.items()}
    assert trains["embed"] == []
    assert sorted(trains["head"]) == ["classifier.bias", "classifier.weight"]
    assert all(is_adapter(n) for u in ("blocks.0", "blocks.1") for n in trains[u])
    assert len(trains["blocks.0"]) == 4  # query and value, A and B
    with torch.no_grad():
        for p in units["head"].parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)  # a trained classifier
    step = _checkpointed(units, tmp_path)
    done = export(step, spec, tmp_path / "out")
    config = json.loads((done.directory / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["classifier"] and config["task_type"] == "SEQ_CLS"
    base = BertForSequenceClassification.from_pretrained(
        bert, num_labels=3, ignore_mismatched_sizes=True
    )  # its classifier is the adapter's (modules_to_save)
    model = PeftModel.from_pretrained(base, done.directory).eval()
    inputs = torch.randint(
        5, spec.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)
    )
    first = torch.stack([inputs, torch.zeros_like(inputs), torch.ones_like(inputs)], dim=1)
    blocks = {i: units[f"blocks.{i}"] for i in range(spec.model.depth)}
    ours = StageModule(spec.model, 0, spec.model.depth, units["embed"], blocks, units["head"])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=inputs).logits, ours.eval()(first), **TOL)


@pytest.mark.parametrize("merged", [False, True])
def test_a_vit_s_adapters_train_as_peft_s_and_export_under_transformers_names(
    tmp_path: Path, merged: bool
) -> None:
    """A ViT checkpoint keeps its older names (`attention.attention.query`) while
    `transformers` 5 and so `peft` name its modules `attention.q_proj`, `mlp.fc1`: the units
    take the default targets by the new names, 3 AdamW steps match `peft.get_peft_model` on
    `ViTForImageClassification`, and the export, PEFT's format under the new names or merged,
    gives the units' logits."""
    import sys

    from peft import PeftModel
    from transformers import ViTForImageClassification

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from assets import make_vit

    vit = make_vit(tmp_path / "vit", image_size=16, patch_size=4, hidden=32, layers=2, heads=2)
    raw = {
        "name": "vit",
        "model": {"pretrained": str(vit), "adapters": {"rank": 4}},
        "data": {"dataset": "image-folder", "train": "/im/train", "test": "/im/test"},
    }
    spec = resolve_pretrained(parse_spec(raw), tmp_path)
    units = _units(spec)
    trained = [n for n, p in units["blocks.1"].named_parameters() if p.requires_grad]
    assert len(trained) == 12 and all(is_adapter(n) for n in trained)  # 6 projections, A and B
    assert "vit.encoder.layer.1.attention.attention.query.lora_A.default.weight" in trained
    assert not any(p.requires_grad for u in ("embed", "head") for p in units[u].parameters())
    theirs = peft_model_of(spec.model, units, ViTForImageClassification)
    ours = _whole(spec, units)
    pixels = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 4, 9])
    forwards = (lambda: ours(pixels), lambda: theirs(pixel_values=pixels).logits)
    models = (ours, theirs)
    for model, forward in zip(models, forwards, strict=True):
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        for _ in range(3):
            torch.nn.functional.cross_entropy(forward(), labels).backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        want = ours.eval()(pixels)
        torch.testing.assert_close(theirs.eval()(pixel_values=pixels).logits, want, **TOL)
    done = export(_saved(units, tmp_path), spec, tmp_path / "out", merge=merged)
    if merged:
        model = ViTForImageClassification.from_pretrained(done.directory)
    else:
        config = json.loads((done.directory / "adapter_config.json").read_text())
        assert sorted(config["target_modules"]) == [
            "fc1",
            "fc2",
            "k_proj",
            "o_proj",
            "q_proj",
            "v_proj",
        ]
        base = ViTForImageClassification.from_pretrained(vit)
        model = PeftModel.from_pretrained(base, done.directory)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(pixel_values=pixels).logits, want, **TOL)


def _saved(units: dict, root: Path) -> Path:
    """The units as they are, checkpointed as a 1x1 job writes them."""
    holder = _holder(units)
    trained = [p for p in holder.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.0)
    step = root / "checkpoints" / "step-00000001"
    save_checkpoint(step, holder, optimizer, {"step": 1})
    return step
