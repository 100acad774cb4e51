"""`pipetransformer export`: a committed checkpoint of a job on a Hugging Face model written as a
directory `transformers` loads (config.json with the job's labels, model.safetensors, the
tokenizer or image processor), checked against the checkpoint itself and the project's own
units; and what it refuses (an unknown step, a seeded model, a torn checkpoint, a non-empty
destination). Real short jobs through the CLI on tiny models made by examples/assets.py."""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import safe_open

from pipetransformer.core.spec import JobSpec
from pipetransformer.edge.manifest import CheckpointError
from pipetransformer.models.bert import stack_text_inputs
from pipetransformer.models.hf import load_units
from pipetransformer.models.units import architecture
from pipetransformer.store import Store, sqlite_url
from pipetransformer.trainer.checkpoint import _MetadataUnpickler
from pipetransformer.trainer.export import ExportError, export
from tests.fixtures_run import REPO, cli

sys.path.insert(0, str(REPO / "examples"))
import assets  # noqa: E402  (examples/assets.py, shared with the CPU examples)

TRAIN = {
    "training": {
        "epochs": 1,
        "global_batch_size": 16,
        "lr": 0.002,
        "warmup_steps": 1,
        "max_steps": 4,
    },
    "parallel": {"stages": 2, "microbatches": 2},
    # two committed checkpoints: step 2 and step 4 (the last)
    "checkpoint": {"every_epochs": None, "every_steps": 2, "keep": 3},
}


def _run(root: Path, name: str, model: dict, data: dict) -> Path:
    """A finished job `name` in the workdir `root / name` (returned)."""
    workdir = root / name
    spec = root / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({"name": name, "model": model, "data": data, **TRAIN}))
    res = cli("run", str(spec), "--workdir", str(workdir), "--job-id", name, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return workdir


@pytest.fixture(scope="module")
def bert_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export-bert")
    bert = assets.make_bert(root / "bert", hidden=32, layers=2, heads=2, max_positions=32)
    pairs = assets.make_pairs(root / "pairs", train=96, test=32)
    data = {
        "dataset": "table",
        "train": str(pairs / "train.parquet"),
        "test": str(pairs / "test.parquet"),
        "columns": {"text": "sentence1", "text_pair": "sentence2"},
        "loader_workers": 0,
    }
    return _run(root, "bert", {"pretrained": str(bert), "seq_len": 16}, data)


@pytest.fixture(scope="module")
def vit_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export-vit")
    vit = assets.make_vit(
        root / "vit", image_size=16, patch_size=4, hidden=32, layers=2, heads=2, num_labels=5
    )
    images = assets.make_digit_images(root / "images", per_class=6, size=16)
    data = {
        "dataset": "image-folder",
        "train": str(images / "train"),
        "test": str(images / "test"),
        "loader_workers": 0,
    }
    # 10 classes: a new head (the checkpoint has 5)
    return _run(root, "vit", {"pretrained": str(vit), "num_classes": 10}, data)


def _store(workdir: Path) -> Store:
    return Store.open(sqlite_url(workdir / "store.db"), migrate=False)


def _export(workdir: Path, job: str, out: Path, *more: str) -> str:
    res = cli("export", job, "--workdir", str(workdir), "--to", str(out), *more)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res.stdout


def _assert_exported_is_the_checkpoint(out: Path, checkpoint: str) -> dict[str, torch.Tensor]:
    """model.safetensors holds exactly the checkpoint's model tensors, bit for bit: each unit's
    flat tensor in the checkpoint (trainer/checkpoint.py: members in parameter-name order) is
    the concatenation of the exported tensors of that unit, read back independently of the
    export's own unpacking."""
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}
        assert f.metadata()["format"] == "pt"  # transformers wants it
        assert f.metadata()["source"].startswith("pipetransformer job ")
    with open(Path(checkpoint) / ".metadata", "rb") as f:
        stored = _MetadataUnpickler(f).load().state_dict_metadata
    flats = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in stored.items()
        if key.startswith("model.")
    }
    with warnings.catch_warnings():  # "assuming ... a single process": indeed
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flats, checkpoint_id=checkpoint, no_dist=True)
    units = {key.removeprefix("model."): [] for key in flats}
    for name in exported:
        layer = name.split("encoder.layer.")
        unit = f"blocks.{layer[1].split('.')[0]}" if len(layer) == 2 else None
        if unit is None:
            unit = "embed" if ".embeddings." in name else "head"
        units[unit].append(f"{unit}.{name}")
    for unit, names in units.items():
        joined = torch.cat(
            [exported[n.removeprefix(unit + ".")].reshape(-1) for n in sorted(names)]
        )
        assert torch.equal(joined, flats[f"model.{unit}"]), unit
    assert all(t.dtype == torch.float32 for t in exported.values())
    return exported


def _latest(workdir: Path, job: str):  # noqa: ANN202
    store = _store(workdir)
    try:
        return store.get_job(job).spec, store.checkpoints(job)
    finally:
        store.close()


@pytest.mark.slow  # a real job through the CLI
def test_a_text_job_exports_as_a_transformers_model(bert_job: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    spec, committed = _latest(bert_job, "bert")
    assert [c.step for c in committed] == [4, 2]
    out = tmp_path / "bert-export"
    said = _export(bert_job, "bert", out)
    assert "step 4" in said and "exported" in said

    _assert_exported_is_the_checkpoint(out, committed[0].path)
    pretrained = Path(spec.model.pretrained.path)
    assert {"tokenizer.json", "tokenizer_config.json", "vocab.txt"} <= {
        p.name for p in out.iterdir()
    }
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}

    model, info = AutoModelForSequenceClassification.from_pretrained(
        out, attn_implementation="sdpa", output_loading_info=True
    )
    assert not any(info.values()), info  # every weight from the file, none left over
    tokenizer = AutoTokenizer.from_pretrained(out)
    original = AutoTokenizer.from_pretrained(pretrained)
    first = ["the cat is red .", "a box is on the old house ."]
    second = ["a red dog is on the box .", "the big tree is green ."]
    batch = tokenizer(first, second, padding=True, return_tensors="pt")
    assert torch.equal(
        batch["input_ids"], original(first, second, padding=True, return_tensors="pt")["input_ids"]
    )
    assert batch["attention_mask"].sum(1).min() < batch["input_ids"].shape[1]  # mask matters
    with torch.no_grad():
        got = model.eval()(**batch).logits

    # The same weights (bit for bit, above) in the project's own units, the model the job
    # trained: fp32 on the CPU, the same kernels in another composition (the mask travels as a
    # channel), so only rounding differs: atol 1e-5.
    arch = architecture(spec.model)
    units = load_units(out, arch, arch.unit_names()).units
    x = stack_text_inputs(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    with torch.no_grad():
        for unit in units.values():
            x = unit.eval()(x)
    torch.testing.assert_close(got, x, rtol=0, atol=1e-5)

    # an older committed step, into the now non-empty directory (--force; refused without it:
    # test_a_torn_checkpoint_or_a_used_destination_is_refused)
    (out / "stale.bin").write_bytes(b"from before")
    said = _export(bert_job, "bert", out, "--step", "2", "--force")
    assert not (out / "stale.bin").exists()  # replaced whole, not merged into
    assert "step 2" in said
    _assert_exported_is_the_checkpoint(out, committed[1].path)


@pytest.mark.slow  # a real job through the CLI
def test_an_image_job_exports_with_its_processor_and_labels(vit_job: Path, tmp_path: Path) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    spec, committed = _latest(vit_job, "vit")
    out = tmp_path / "vit-export"
    _export(vit_job, "vit", out)
    _assert_exported_is_the_checkpoint(out, committed[0].path)
    assert (out / "preprocessor_config.json").is_file()
    model, info = AutoModelForImageClassification.from_pretrained(
        out, attn_implementation="sdpa", output_loading_info=True
    )
    assert not any(info.values()), info
    # the new head's labels are the image folder's classes, in the data set's order
    assert model.config.id2label == {i: str(i) for i in range(10)}
    assert model.config.label2id == {str(i): i for i in range(10)}

    processor = AutoImageProcessor.from_pretrained(out)
    files = sorted(Path(spec.data.test[0]).glob("*/*.png"))[:4]
    pixels = processor([Image.open(f).convert("RGB") for f in files], return_tensors="pt")
    with torch.no_grad():
        got = model.eval()(**pixels).logits
    assert got.shape == (4, 10)
    # the project's units on the same weights (see the text case): rounding only
    arch = architecture(spec.model)
    units = load_units(out, arch, arch.unit_names()).units
    x = pixels["pixel_values"]
    with torch.no_grad():
        for unit in units.values():
            x = unit.eval()(x)
    torch.testing.assert_close(got, x, rtol=0, atol=1e-5)


@pytest.mark.slow  # a real job through the CLI
def test_an_unknown_step_or_job_names_what_exists(bert_job: Path, tmp_path: Path) -> None:
    res = cli(
        "export", "bert", "--workdir", str(bert_job), "--to", str(tmp_path / "x"), "--step", "3"
    )
    assert res.returncode == 2
    assert "no committed checkpoint at step 3" in res.stderr and "2, 4" in res.stderr
    res = cli("export", "bret", "--workdir", str(bert_job), "--to", str(tmp_path / "x"))
    assert res.returncode == 2 and "bret" in res.stderr and "bert" in res.stderr
    assert not (tmp_path / "x").exists()


def test_a_seeded_model_is_refused(tmp_path: Path) -> None:
    workdir = tmp_path / "runs"
    workdir.mkdir()
    store = Store.open(sqlite_url(workdir / "store.db"))
    store.create_job("seeded", JobSpec(name="seeded"), str(workdir))
    store.close()
    res = cli("export", "seeded", "--workdir", str(workdir), "--to", str(tmp_path / "x"))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "model.pretrained" in res.stderr and "seeded" in res.stderr


@pytest.mark.slow  # a real job through the CLI
def test_a_torn_checkpoint_or_a_used_destination_is_refused(bert_job: Path, tmp_path: Path) -> None:
    spec, committed = _latest(bert_job, "bert")
    copy = tmp_path / "ckpt"
    shutil.copytree(committed[0].path, copy)
    shard = sorted(copy.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="differ from the manifest"):
        export(copy, spec, tmp_path / "out", checksum=committed[0].checksum)
    assert not (tmp_path / "out").exists()
    # a destination that holds anything only with force, and never one holding the checkpoint
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"not empty \(notes.txt\).*--force"):
        export(committed[0].path, spec, tmp_path / "used", checksum=committed[0].checksum)
    assert (tmp_path / "used" / "notes.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="would replace"):
        export(copy, spec, copy.parent, checksum=committed[0].checksum, force=True)


@pytest.mark.parametrize(
    "architecture,model,want,labels",
    [  # a classifier given a new question-answering head; a base model given a classifier
        (
            "BertForSequenceClassification",
            {"family": "bert", "task": "question-answering", "num_classes": 2},
            "BertForQuestionAnswering",
            2,
        ),
        ("ViTModel", {"family": "vit", "num_classes": 7}, "ViTForImageClassification", 7),
    ],
)
def test_the_exported_config_names_the_class_the_job_trained(
    architecture: str, model: dict, want: str, labels: int
) -> None:
    """`transformers` builds the head from `architectures` and `id2label`: they must be what the
    job trained, not what the pretrained checkpoint was (else loading fails on the head's shape)."""
    from pipetransformer.trainer.export import export_config

    original = {
        "model_type": model["family"],
        "architectures": [architecture],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "id2label": {str(i): f"colour {i}" for i in range(6)},
        "vocab_size": 40,
        "max_position_embeddings": 32,
        "image_size": 16,
        "patch_size": 4,
    }
    spec = JobSpec.model_validate(
        {
            "name": "x",
            "model": {
                **model,
                "pretrained": {"source": "/m", "path": "/m", "fingerprint": "f"},
                "dim": 32,
                "depth": 2,
                "heads": 2,
                "mlp_ratio": 2.0,
                "seq_len": 16,
                "vocab_size": 40,
                "image_size": 16,
                "patch_size": 4,
                "channels": 3,
            },
            "data": {"dataset": "table" if model["family"] == "bert" else "image-folder"}
            | {"train": "/t", "test": "/v"},
        }
    )
    config = export_config(spec, original)
    assert config["architectures"] == [want]
    assert len(config["id2label"]) == len(config["label2id"]) == labels
