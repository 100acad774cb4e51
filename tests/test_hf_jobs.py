"""Jobs on Hugging Face checkpoints and users' files: `model.pretrained` resolved at submission
(a directory or a cached hub id; config.json decides the architecture; a contradicting field is
an error naming it), the rank's model share built from the checkpoint's units equal to the
`transformers` model, and real jobs through the CLI on an image folder and a parquet table of
sentence pairs, with freezing, re-layout and AutoCache (off under augmentation). The models and
data are made here by examples/assets.py (nothing is downloaded)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipetransformer.core.spec import SpecError, parse_spec
from pipetransformer.core.state import StageLayout
from pipetransformer.models.units import CheckpointChanged, architecture
from pipetransformer.orchestrator.sources import resolve_submission
from pipetransformer.store import Store, sqlite_url
from pipetransformer.trainer.pipeline import RankModel
from tests.fixtures_run import REPO, cli, run_job

sys.path.insert(0, str(REPO / "examples"))
import assets  # noqa: E402  (examples/assets.py, shared with the CPU examples)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("assets")
    return {
        "vit": assets.make_vit(
            root / "vit", image_size=16, patch_size=4, hidden=32, layers=3, heads=2, num_labels=5
        ),
        "images": assets.make_digit_images(root / "images", per_class=12, size=16),
        "bert": assets.make_bert(root / "bert", hidden=32, layers=3, heads=2, max_positions=32),
        "pairs": assets.make_pairs(root / "pairs", train=96, test=32),
        # 25 questions: the held-out's last batch is mostly padding (a replica may get none)
        "squad": assets.make_squad(root / "squad", train=64, test=25),
    }


def _spec(model: dict, data: dict | None = None, **sections) -> dict:
    return {"name": "hf", "model": model, "data": data or {}, **sections}


def _image_data(made: dict[str, Path]) -> dict:
    return {
        "dataset": "image-folder",
        "train": str(made["images"] / "train"),
        "test": str(made["images"] / "test"),
    }


def _squad_data(made: dict[str, Path], **more: object) -> dict:
    return {
        "dataset": "table",
        "train": str(made["squad"] / "train.parquet"),
        "test": str(made["squad"] / "test.parquet"),
        **more,
    }


def _pair_data(made: dict[str, Path]) -> dict:
    return {
        "dataset": "table",
        "train": str(made["pairs"] / "train.parquet"),
        "test": str(made["pairs"] / "test.parquet"),
        "columns": {"text": "sentence1", "text_pair": "sentence2"},
    }


# -- submission -------------------------------------------------------------------------------


def test_config_json_decides_the_architecture(made: dict[str, Path]) -> None:
    raw = _spec({"pretrained": str(made["vit"]), "num_classes": 10}, _image_data(made))
    pending = parse_spec(raw)
    assert pending.model.pending  # parsed before the checkpoint is read: nothing checked yet
    spec = resolve_submission(pending)
    m = spec.model
    assert (m.family, m.dim, m.depth, m.heads, m.mlp_ratio) == ("vit", 32, 3, 2, 4.0)
    assert (m.image_size, m.patch_size, m.channels, m.num_classes) == (16, 4, 3, 10)
    assert m.tokens == 17 and m.width == 32
    assert m.pretrained.path == str(made["vit"]) and len(m.pretrained.fingerprint) == 32
    assert resolve_submission(spec) == spec  # idempotent: a stored spec is never re-resolved
    again = parse_spec(json.loads(spec.to_json()))
    assert again == spec and not again.model.pending


def test_text_checkpoint_gets_a_sequence_length(made: dict[str, Path]) -> None:
    spec = resolve_submission(
        parse_spec(_spec({"pretrained": str(made["bert"])}, _pair_data(made)))
    )
    m = spec.model
    assert (m.family, m.seq_len, m.num_classes, m.tokens, m.width) == ("bert", 32, 2, 32, 33)
    with pytest.raises(SpecError) as err:
        resolve_submission(
            parse_spec(_spec({"pretrained": str(made["bert"]), "seq_len": 33}, _pair_data(made)))
        )
    assert err.value.problems[0][0] == "model.seq_len"


@pytest.mark.parametrize(
    "model,data,field,phrase",
    [
        ({"dim": 64}, None, "model.dim", "hidden_size gives 32"),
        ({"depth": 3, "heads": 4}, None, "model.heads", "num_attention_heads gives 2"),
        ({"family": "bert"}, None, "model.family", "model_type gives 'vit'"),
        ({}, {"train": "nowhere/train"}, "data.train", "no such file or directory"),
        ({"pretrained": "./not-here"}, None, "model.pretrained.source", "no such directory"),
        ({"pretrained": "org/absent"}, None, "model.pretrained.source", "hf download org/absent"),
    ],
)
def test_a_spec_that_contradicts_or_misses_names_the_field(
    made: dict[str, Path],
    model: dict,
    data: dict | None,
    field: str,
    phrase: str,
    tmp_path,
    monkeypatch,
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    raw = _spec({"pretrained": str(made["vit"]), **model}, {**_image_data(made), **(data or {})})
    with pytest.raises(SpecError) as err:
        resolve_submission(parse_spec(raw))
    fields = dict(err.value.problems)
    assert field in fields and phrase in fields[field], err.value.problems


def test_a_base_model_needs_the_label_count_and_a_task_may_change(
    made: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint without a classification head (here a `ViTModel`, as the hub's ImageNet-21k
    ViT is) gets a new one: the spec must say for how many labels. A classifier may be given
    another task (a new head) but an image model cannot answer questions."""
    from transformers import AutoConfig, ViTModel

    body = tmp_path / "vit-body"
    ViTModel(AutoConfig.from_pretrained(made["vit"])).save_pretrained(body)
    with pytest.raises(SpecError) as err:
        resolve_submission(parse_spec(_spec({"pretrained": str(body)}, _image_data(made))))
    assert "no classification head" in dict(err.value.problems)["model.num_classes"]
    spec = resolve_submission(
        parse_spec(_spec({"pretrained": str(body), "num_classes": 10}, _image_data(made)))
    )
    assert (spec.model.task, spec.model.num_classes, spec.model.depth) == ("classification", 10, 3)
    qa = resolve_submission(
        parse_spec(
            _spec(
                {"pretrained": str(made["bert"]), "task": "question-answering"}, _squad_data(made)
            )
        )
    )
    assert (qa.model.task, qa.model.num_classes) == ("question-answering", 2)
    with pytest.raises(SpecError) as err:
        resolve_submission(
            parse_spec(
                _spec(
                    {"pretrained": str(made["vit"]), "task": "question-answering"},
                    _image_data(made),
                )
            )
        )
    assert "is not available for vit models" in dict(err.value.problems)["model.task"]


def test_a_data_source_needs_a_pretrained_model(made: dict[str, Path]) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(_spec({}, _image_data(made)))
    assert "needs model.pretrained" in str(err.value)


def test_a_hub_id_resolves_from_the_local_cache(
    made: dict[str, Path], tmp_path, monkeypatch
) -> None:
    """The cache layout huggingface_hub writes: refs/<branch> names a snapshot's commit."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--vit-tiny"
    shutil.copytree(made["vit"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = resolve_submission(parse_spec(_spec({"pretrained": "acme/vit-tiny"}, _image_data(made))))
    assert spec.model.pretrained.commit == commit
    assert spec.model.pretrained.path == str(repo / "snapshots" / commit)
    with pytest.raises(SpecError, match="at revision 'v2'"):
        resolve_submission(
            parse_spec(
                _spec(
                    {"pretrained": {"source": "acme/vit-tiny", "revision": "v2"}}, _image_data(made)
                )
            )
        )


def test_a_replaced_checkpoint_is_refused_by_the_workers(made: dict[str, Path], tmp_path) -> None:
    copy = shutil.copytree(made["vit"], tmp_path / "vit")
    data = _image_data(made)
    spec = resolve_submission(parse_spec(_spec({"pretrained": str(copy), "num_classes": 7}, data)))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "layer_norm_eps": 1e-5}))
    with pytest.raises(CheckpointChanged, match="changed since the job was submitted"):
        architecture(spec.model)


# -- the rank's model share -------------------------------------------------------------------


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["vit", "bert"])
def test_rank_model_equals_the_transformers_model(made: dict[str, Path], kind: str) -> None:
    """The units a rank builds from the checkpoint, run as two pipeline stages, give the logits
    of the `transformers` model loaded from the same directory (fp32, same kernels: rounding
    only, so a tight tolerance)."""
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    data = _image_data(made) if kind == "vit" else _pair_data(made)
    spec = resolve_submission(parse_spec(_spec({"pretrained": str(made[kind])}, data))).model
    stages = [
        StageLayout(index=0, start=0, end=1, ranks=[0]),
        StageLayout(index=1, start=1, end=3, ranks=[0]),
    ]
    rank = RankModel(spec, seed=0, stages=stages, recompute=[False, False]).eval()
    g = torch.Generator().manual_seed(0)
    if kind == "vit":
        x = torch.randn(4, 3, 16, 16, generator=g)
        ref = AutoModelForImageClassification.from_pretrained(
            made[kind], attn_implementation="sdpa"
        )
        want = ref.eval()(pixel_values=x).logits
    else:
        ids = torch.randint(5, 30, (4, 32), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 20:] = 0
        types = torch.zeros_like(ids)
        types[:, 10:] = 1
        x = torch.stack([ids, types, mask], dim=1)
        ref = AutoModelForSequenceClassification.from_pretrained(
            made[kind], attn_implementation="sdpa"
        )
        want = ref.eval()(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    with torch.no_grad():
        got = rank.stage_modules[1](rank.stage_modules[0](x))
    torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-5)
    assert any(n.startswith("blocks.1.") for n, _ in rank.named_parameters())


# -- real jobs --------------------------------------------------------------------------------


def _flat(text: str) -> str:
    """Without whitespace: a table may fold a long path across lines."""
    return "".join(text.split())


TRAIN = {
    "training": {"epochs": 3, "global_batch_size": 16, "lr": 0.002, "warmup_steps": 2},
    "parallel": {"stages": 2, "microbatches": 2},
    "freeze": {"policy": "schedule", "alpha": 0.5, "keep_trainable": 1, "cache": "on"},
    "checkpoint": {"every_epochs": 1, "keep": 2},
}


@pytest.mark.slow
def test_an_image_folder_job_freezes_and_relays_out(made: dict[str, Path], tmp_path: Path) -> None:
    """2 stages from a pretrained ViT with a new 10-label head, read by a loader process,
    frozen by the schedule and re-laid out; with augmentation AutoCache stays off and says so."""
    data = {**_image_data(made), "augment": True, "loader_workers": 1}
    store, _ = run_job(
        tmp_path,
        "vit",
        {"model": {"pretrained": str(made["vit"]), "num_classes": 10}, "data": data, **TRAIN},
    )
    job = store.get_job("vit")
    assert job.state == "completed", job.message
    assert job.spec.model.pretrained.path == str(made["vit"])
    layouts = store.layouts("vit")
    assert max(v.layout.freeze_boundary for v in layouts) >= 1
    caches = [e for e in store.events("vit", limit=500) if e.kind == "cache_decided"]
    assert caches and all(not e.data["use"] and "data.augment" in e.message for e in caches)
    store.close()


@pytest.mark.slow
def test_a_corrupt_image_fails_the_job_once_naming_it(made: dict[str, Path], tmp_path: Path):
    """One undecodable PNG among the training images, found by a loader process mid-epoch: a
    restart would read it again, so the job fails at once (exit 3), its message naming the file
    and row, instead of restarting generation after generation (before: 11 generations, 96 s,
    then torchrun's ChildFailedError, the file never named)."""
    images = shutil.copytree(made["images"], tmp_path / "images")
    bad = sorted((images / "train").glob("*/*.png"))[7]
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not an image" * 8)
    data = {**_image_data(made), "train": str(images / "train"), "loader_workers": 1}
    spec = {"model": {"pretrained": str(made["vit"]), "num_classes": 10}, "data": data, **TRAIN}
    spec["freeze"] = {"policy": "off"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**spec, "name": "bad"}))
    res = cli("run", str(path), "--workdir", str(tmp_path / "bad"), "--job-id", "bad", timeout=300)
    said = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 3, said[-3000:]
    assert "ChildFailedError" not in said and "Traceback" not in said
    store = Store.open(sqlite_url(tmp_path / "bad" / "store.db"), migrate=False)
    job = store.get_job("bad")
    assert job.state == "failed" and str(bad) in job.message and "(row " in job.message
    assert job.message.count("DataError") <= 1 and "DataLoader worker" not in job.message
    assert len(store.generations("bad")) == 1, "a data error is not restarted"
    status = json.loads(cli("status", "bad", "--json", "--workdir", str(tmp_path / "bad")).stdout)
    assert str(bad) in status["message"]
    store.close()


@pytest.mark.slow
def test_a_sentence_pair_job_trains_and_caches(made: dict[str, Path], tmp_path: Path) -> None:
    store, summary = run_job(
        tmp_path,
        "bert",
        {
            "model": {"pretrained": str(made["bert"]), "seq_len": 24},
            "data": {**_pair_data(made), "loader_workers": 0},
            **TRAIN,
        },
    )
    job = store.get_job("bert")
    assert job.state == "completed", job.message
    assert job.spec.model.width == 33  # the attention mask travels as one extra channel
    assert any(e.kind == "cache_decided" and e.data["use"] for e in store.events("bert", limit=500))
    # once the cache held every training sample's output (the last epoch, at the boundary below
    # to advance from), the first stage's rank stopped reading inputs
    logs = "".join(p.read_text() for p in (tmp_path / "bert").glob("jobs/bert/workers-*.log"))
    assert "inputs are no longer read" in logs, logs[-3000:]
    assert [m.step for m in store.metrics("bert")] == list(range(1, job.step + 1))
    assert store.latest_checkpoint("bert") is not None
    # where the model and the data came from, in the summary and `status` (issue 23): the rows
    # are the workers' report (DataOpened), the rest the stored spec
    status = cli("status", "bert", "--workdir", str(tmp_path / "bert"))
    assert status.returncode == 0, status.stderr
    fingerprint = job.spec.model.pretrained.fingerprint[:12]
    for out in (summary, status.stdout):
        for text in (
            f"{made['bert']} (bert, 3 blocks of dim 32, 2 classes; fingerprint {fingerprint})",
            f"96 rows from {made['pairs'] / 'train.parquet'}",
            f"32 rows from {made['pairs'] / 'test.parquet'}",
            "sentence1 (text), sentence2 (text_pair), label",
        ):
            assert _flat(text) in _flat(out), out
    store.close()


def test_bad_data_fails_the_job_with_the_file_and_row(
    made: dict[str, Path], tmp_path: Path
) -> None:
    import datasets

    bad = tmp_path / "bad.parquet"
    rows = assets.pair_rows(20, seed=3)
    rows["label"][7] = 5  # beyond the 2 labels
    datasets.Dataset.from_dict(rows).to_parquet(str(bad))
    data = {**_pair_data(made), "train": str(bad)}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_spec({"pretrained": str(made["bert"])}, data, **TRAIN)))
    res = cli("run", str(path), "--workdir", str(tmp_path / "bad"), "--job-id", "bad", timeout=300)
    assert res.returncode != 0
    assert "bad.parquet: column 'label' row 7 holds label 5, outside [0, 2)" in " ".join(
        (res.stdout + res.stderr).split()
    )


# -- question answering -----------------------------------------------------------------------


def _qa_splits(made: dict[str, Path], **data: object):
    from pipetransformer.trainer.data import load_dataset

    raw = _spec(
        {"pretrained": str(made["bert"]), "task": "question-answering"}, _squad_data(made, **data)
    )
    spec = resolve_submission(parse_spec(raw))
    return spec, load_dataset(spec.data, spec.model)


def test_squad_rows_become_windows_scored_by_exact_match_and_f1(
    made: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each question's context (~40 tokens) is split into windows of seq_len 32 overlapping by
    doc_stride; each window's target is its answer's tokens (or CLS where the answer is not in
    it); the features are computed once and read back from the cache; the best span per question
    is scored against its answers as SQuAD does."""
    import numpy as np

    from pipetransformer.trainer.sources.qa import best_spans

    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path / "cache"))
    spec, data = _qa_splits(made, doc_stride=8)
    test = data.test
    assert (spec.model.seq_len, spec.data.stride(32)) == (32, 8)
    assert test.num_examples == 25 and len(test) > 25  # long contexts: several windows each
    assert len(list((tmp_path / "cache" / "qa-features").glob("*.arrow"))) == 2
    _, again = _qa_splits(made, doc_stride=8)  # the same features, from the cache
    assert torch.equal(again.test.labels, test.labels)
    assert len(list((tmp_path / "cache" / "qa-features").glob("*.arrow"))) == 2

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(made["bert"])
    examples = test.examples
    example_of = np.asarray(test.features["example"])
    inside = 0
    for f in range(len(test)):
        start, end = test.labels[f].tolist()
        if start == 0:
            continue  # the answer is outside this window
        inside += 1
        ids = test.read([f])[0, 0, start : end + 1].tolist()
        answer = examples[int(example_of[f])]["answers"]["text"][0]
        assert tok.decode(ids) == answer
    assert inside >= 25  # every answer lies in at least one window

    logits = torch.full((len(test), 32, 2), -5.0)
    for f, (start, end) in enumerate(test.labels.tolist()):
        logits[f, start, 0] = logits[f, end, 1] = 5.0 if start else -4.0
    spans = torch.zeros(len(test), 4, dtype=torch.float64)
    spans[:, 0] = 1
    spans[:, 1:] = test.spans(logits, np.arange(len(test)))
    assert test.score(spans) == (1.0, 1.0)
    spans[example_of == 0, 0] = 0  # question 0 unscored: no prediction counts 0, as SQuAD's
    exact, f1 = test.score(spans)
    assert exact == pytest.approx(24 / 25) and f1 == pytest.approx(24 / 25)
    assert best_spans(torch.zeros(0, 32, 2), torch.zeros(0, 64), 30).shape == (0, 3)


def test_a_window_stride_is_checked_at_submission(made: dict[str, Path]) -> None:
    qa = {"pretrained": str(made["bert"]), "task": "question-answering"}
    with pytest.raises(SpecError, match=r"data.doc_stride \(16\) must be below half"):
        resolve_submission(parse_spec(_spec(qa, _squad_data(made, doc_stride=16))))
    with pytest.raises(SpecError, match="data.doc_stride is for question answering"):
        data = {**_pair_data(made), "doc_stride": 8}
        resolve_submission(parse_spec(_spec({"pretrained": str(made["bert"])}, data)))


@pytest.mark.parametrize(
    "change,message",
    [
        ("no-answer", "column 'answers' row 3 has no answer"),
        ("misplaced", "answer 'red' is not at character 0 of its context"),
        ("no-column", "has no column 'question'"),
    ],
)
def test_bad_squad_rows_are_named(
    made: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: str,
    message: str,
) -> None:
    import datasets

    from pipetransformer.trainer.sources import DataError

    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path / "cache"))
    rows = assets.squad_rows(8, seed=5)
    if change == "no-answer":
        rows["answers"][3] = {"text": [], "answer_start": []}
    elif change == "misplaced":
        rows["answers"][2] = {"text": ["red"], "answer_start": [0]}
        rows["context"][2] = "blue " + rows["context"][2]
    else:
        rows["query"] = rows.pop("question")
    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(bad))
    with pytest.raises(DataError, match=message):
        _qa_splits(made, train=str(bad))


@pytest.mark.slow
def test_a_question_answering_job_scores_exact_match_and_f1(
    made: dict[str, Path], tmp_path: Path
) -> None:
    """A BERT sequence classifier given a new question-answering head, on SQuAD-format rows: 2
    stages, frozen by the schedule and re-laid out; each epoch's exact match and F1 stored and
    printed."""
    spec = _spec(
        {"pretrained": str(made["bert"]), "task": "question-answering"},
        _squad_data(made, loader_workers=1),
        **TRAIN,
    )
    store, summary = run_job(tmp_path, "qa", spec)
    job = store.get_job("qa")
    assert job.state == "completed", job.message
    evaluations = store.evaluations("qa")
    assert len(evaluations) == 3
    for e in evaluations:
        assert e.f1 is not None and 0.0 <= e.accuracy <= e.f1 <= 1.0
    assert job.accuracy == evaluations[-1].accuracy
    assert len(store.layouts("qa")) >= 2  # re-laid out after freezing
    last = evaluations[-1]
    assert f"EM {last.accuracy:.2%} F1 {last.f1:.2%}" in summary
    flat = _flat(summary)  # where the data came from: questions, and the windows they became
    assert _flat("question answering") in flat and _flat("64 rows (") in flat
    assert _flat("id, question, context, answers") in flat
    store.close()


# -- the README's recipes ---------------------------------------------------------------------

RECIPES = sorted((REPO / "examples" / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_recipe_resolves_against_its_checkpoint_s_architecture(
    recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each recipe names a hub checkpoint as it is on the hub: a `ViTModel` or a `BertForMaskedLM`
    (no head for the job's task), or a tied `*ForCausalLM` (Llama 3.2, Qwen3, GPT-2). Stand-ins of those classes (tiny) in a local hub cache under the
    same ids: the recipe's model section resolves (a new head of the recipe's task and labels);
    its data paths are the cluster's, so they are named as missing."""
    from transformers import AutoConfig, BertForMaskedLM, ViTModel

    from pipetransformer.core.spec import load_spec
    from pipetransformer.orchestrator.sources import resolve_pretrained

    spec = load_spec(recipe)
    source = spec.model.pretrained.source
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / f"models--{source.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    if spec.model.task == "causal-lm":  # the hub's *ForCausalLM, tied as the recipe's is
        _decoder_stand_in(source, snapshot)
    elif "vit" in source:
        config = AutoConfig.for_model("vit", hidden_size=32, num_hidden_layers=8, **_TINY_HEADS)
        ViTModel(config).save_pretrained(snapshot)
    else:
        config = AutoConfig.for_model("bert", hidden_size=32, num_hidden_layers=8, **_TINY_HEADS)
        config.max_position_embeddings = 512
        BertForMaskedLM(config).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = resolve_pretrained(spec, tmp_path).model
    assert model.pretrained.commit == commit and model.depth == 8  # as many as the stages
    assert model.task == spec.model.task
    arch = architecture(model)
    if model.task == "causal-lm":
        assert model.tie_embeddings and arch.architecture.endswith(("ForCausalLM", "LMHeadModel"))
    else:
        qa = model.task == "question-answering"
        assert arch.architecture.endswith("QuestionAnswering" if qa else "Classification")
    with pytest.raises(SpecError) as err:
        resolve_submission(spec, tmp_path)
    assert "no such file or directory" in " ".join(m for _, m in err.value.problems)


_TINY_HEADS = {"num_attention_heads": 2, "intermediate_size": 64}


def _decoder_stand_in(source: str, snapshot: Path) -> None:
    """A tiny tied `*ForCausalLM` of the hub checkpoint's family, with a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.lm_assets import make_tokenizer

    vocab = make_tokenizer(snapshot)
    family = "gpt2" if "gpt2" in source else "qwen3" if "Qwen3" in source else "llama"
    if family == "gpt2":
        config = AutoConfig.for_model("gpt2", n_embd=32, n_layer=8, n_head=2, vocab_size=vocab)
    else:
        config = AutoConfig.for_model(
            family, hidden_size=32, num_hidden_layers=8, num_key_value_heads=1, head_dim=16,
            vocab_size=vocab, tie_word_embeddings=True, **_TINY_HEADS,
        )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(snapshot)
