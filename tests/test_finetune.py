"""Fine-tuning (`init` in the job spec) and class subsets (`data.classes`): a job starts from the
weights of a checkpoint another job committed, checked and pinned at submission."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch

from pipetransformer.core.planner import plan_layout
from pipetransformer.core.spec import JobSpec, SpecError, parse_spec
from pipetransformer.edge.manifest import CheckpointError, manifest_checksum
from pipetransformer.models.seeded import build_model
from pipetransformer.orchestrator.controller import Controller
from pipetransformer.orchestrator.exits import EXIT_JOB_FAILED
from pipetransformer.orchestrator.pretrained import resolve_init
from pipetransformer.store import Store, sqlite_url
from pipetransformer.trainer.checkpoint import AsyncCheckpointer, load_weights
from pipetransformer.trainer.data import load_dataset
from pipetransformer.trainer.optim import build_optimizer
from pipetransformer.trainer.relayout import build_training
from tests.fixtures_run import cli, start_cli, store_probe, wait_for, write_spec
from tests.mp import run_distributed

MODEL = {"depth": 4, "dim": 32, "heads": 4}
SOURCE = JobSpec(name="source", model=MODEL, training={"global_batch_size": 16})


def _save(path: Path, spec: JobSpec = SOURCE, seed: int = 7, step: int = 0) -> Path:
    """A sealed checkpoint of `spec`'s model initialised from `seed`, as a job writes it."""
    module = build_model(spec.model, seed)
    ckpt = AsyncCheckpointer(async_save=False)
    ckpt.start(path, module, build_optimizer(module, spec.training), _meta(spec, step))
    assert ckpt.wait() is not None
    return path


def _meta(spec: JobSpec, step: int) -> dict:
    return {"step": step, "model": spec.model.model_dump()}


def _target(checkpoint: Path | str, **init) -> JobSpec:
    return parse_spec(
        {
            "name": "target",
            "model": {**MODEL, "num_classes": 3},
            "data": {"classes": [7, 1, 4]},
            "training": {"global_batch_size": 16},
            "init": {"checkpoint": str(checkpoint), "skip": ["head"], **init},
        }
    )


@pytest.fixture
def source_ckpt(tmp_path: Path) -> Path:
    return _save(tmp_path / "runs" / "checkpoints" / "step-00000040", step=40)


# -- the spec ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field", "phrase"),
    [
        ({"data": {"classes": [3]}}, "data", "at least 2 different digits"),
        ({"data": {"classes": [3, 3]}}, "data", "at least 2 different digits"),
        ({"data": {"classes": [3, 10]}}, "data.classes.1", "less than or equal to 9"),
        (
            {"data": {"dataset": "synthetic", "classes": [0, 1]}},
            "data",
            "needs dataset 'digits'",
        ),
        ({"data": {"classes": [0, 1]}}, "data", "model.num_classes=2"),
        ({"init": {"skip": ["head"]}}, "init", "need init.checkpoint"),
        ({"init": {"checkpoint": "x", "skip": ["neck"]}}, "init.skip", "'embed', 'head' or"),
        ({"init": {"checkpoint": "x", "skip": ["blocks.6"]}}, "init.skip", "beyond the model"),
    ],
)
def test_bad_fine_tuning_specs_name_the_field(data: dict, field: str, phrase: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", **data})
    problems = dict(err.value.problems)
    assert field in problems, problems
    assert phrase in problems[field]


def test_class_subsets_never_cross_the_held_out_split() -> None:
    full_spec = JobSpec(name="all")
    some = parse_spec({"name": "some", "data": {"classes": [7, 1, 4]}, "model": {"num_classes": 3}})
    full = load_dataset(full_spec.data, full_spec.model)
    part = load_dataset(some.data, some.model)
    back = torch.tensor([7, 1, 4])
    for name in ("train", "test"):
        whole, subset = getattr(full, name), getattr(part, name)
        keep = torch.isin(whole.labels, back)
        # the subset's split is the whole data set's split, filtered: same images, same order
        assert torch.equal(subset.inputs, whole.inputs[keep])
        assert torch.equal(back[subset.labels], whole.labels[keep])
        assert set(subset.labels.tolist()) == {0, 1, 2}
    # so a job on digits 7, 1, 4 never trains on an image another job (same data.seed) holds out
    train_images = {x.numpy().tobytes() for x in part.train.inputs}
    assert not train_images & {x.numpy().tobytes() for x in full.test.inputs}


# -- loading the weights -------------------------------------------------------------------------


def test_weights_load_except_the_skipped_units(source_ckpt: Path) -> None:
    spec = _target(source_ckpt)
    source = build_model(SOURCE.model, seed=7).state_dict()
    fresh = build_model(spec.model, seed=0)
    expected_head = {k: v.clone() for k, v in fresh.state_dict().items() if k.startswith("head.")}
    loaded = load_weights(source_ckpt, fresh, skip=["head"])
    assert loaded == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "embed"]
    for name, value in fresh.state_dict().items():
        expected = expected_head[name] if name.startswith("head.") else source[name]
        assert torch.equal(value, expected), name
    assert fresh.head.fc.out_features == 3  # the new head, of the new task's classes


def test_another_architecture_names_the_units(source_ckpt: Path) -> None:
    wider = build_model(SOURCE.model.model_copy(update={"dim": 64}), seed=0)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"its blocks\.0 holds \d+ values, this model's"):
        load_weights(source_ckpt, wider, skip=["head"])
    deeper = build_model(SOURCE.model.model_copy(update={"depth": 5}), seed=0)
    with pytest.raises(CheckpointError, match=r"it has no blocks\.4.*init\.skip"):
        load_weights(source_ckpt, deeper)
    ten_classes = build_model(SOURCE.model.model_copy(update={"num_classes": 3}), seed=0)
    with pytest.raises(CheckpointError, match="its head holds"):
        load_weights(source_ckpt, ten_classes)  # a new head must be skipped
    assert all(torch.equal(v, before[k]) for k, v in wider.state_dict().items())


def test_a_replaced_checkpoint_is_refused(source_ckpt: Path) -> None:
    pinned = resolve_init(_target(source_ckpt))
    shutil.rmtree(source_ckpt)
    _save(source_ckpt, seed=8, step=40)  # same place, other weights
    with pytest.raises(CheckpointError, match="manifest does not match"):
        load_weights(source_ckpt, build_model(pinned.model, 0), ["head"], pinned.init.checksum)


def _build_two_stages(rank: int, world: int, spec_json: str):
    spec = JobSpec.model_validate_json(spec_json)
    pipe, optimizer = build_training(spec, plan_layout(spec).layout, rank)
    return {k: v.clone() for k, v in pipe.model.state_dict().items()}, len(optimizer.state)


@pytest.mark.slow
def test_a_pipeline_starts_from_the_pretrained_weights(source_ckpt: Path) -> None:
    """Written by one process, loaded by the two stages of another layout; nothing but the
    weights: the optimizer starts empty."""
    spec = resolve_init(_target(source_ckpt))
    results = run_distributed(_build_two_stages, 2, spec.model_dump_json())
    source = build_model(SOURCE.model, seed=7).state_dict()
    fresh_head = build_model(spec.model, spec.training.seed).state_dict()
    stages = [r[0] for r in results]
    assert set(stages[0]) & set(stages[1]) == set()
    merged = stages[0] | stages[1]
    assert set(merged) == set(fresh_head)
    for name, value in merged.items():
        expected = fresh_head[name] if name.startswith("head.") else source[name]
        assert torch.equal(value, expected), name
    assert [r[1] for r in results] == [0, 0]


# -- checked and pinned at submission ------------------------------------------------------------


def test_a_relative_path_or_checkpoints_directory_is_resolved_and_pinned(
    source_ckpt: Path, tmp_path: Path
) -> None:
    older = _save(source_ckpt.parent / "step-00000020", step=20)
    (source_ckpt.parent / "step-00000060.partial").mkdir()  # never sealed: not a candidate
    torn = _save(source_ckpt.parent / "step-00000050", step=50)
    shard = next(torn.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-8])
    os.chdir(tmp_path)
    spec = resolve_init(_target("runs/checkpoints"))
    assert spec.init.checkpoint == str(source_ckpt)  # the newest complete one, made absolute
    manifest = json.loads((source_ckpt / "manifest.json").read_text())
    assert spec.init.checksum == manifest_checksum(manifest)
    assert resolve_init(spec) == spec  # idempotent
    pinned_older = resolve_init(_target(older))
    assert pinned_older.init.checkpoint == str(older)


@pytest.mark.parametrize(
    ("change", "field", "phrase"),
    [
        ("missing", "init.checkpoint", "no such directory"),
        ("empty", "init.checkpoint", "neither a checkpoint"),
        ("torn", "init.checkpoint", "is damaged: .*files differ from the manifest"),
        ("pinned", "init.checksum", "not the pinned 0000"),
        ("wider", "init.checkpoint", "model.dim: 32 there, 64 here"),
        ("head", "init.checkpoint", r"model.num_classes: 10 there, 3 here.*init.skip: \[head\]"),
    ],
)
def test_an_unusable_checkpoint_is_a_spec_error_and_stores_nothing(
    source_ckpt: Path, tmp_path: Path, change: str, field: str, phrase: str
) -> None:
    init: dict = {"checkpoint": str(source_ckpt)}
    model = {**MODEL, "num_classes": 3}
    if change == "missing":
        init["checkpoint"] = str(tmp_path / "nowhere")
    elif change == "empty":
        init["checkpoint"] = str(tmp_path)
    elif change == "torn":
        (source_ckpt / "meta.json").write_text("{}")
    elif change == "pinned":
        init["checksum"] = "0000"
    elif change == "wider":
        model["dim"] = 64
    spec = parse_spec(
        {
            "name": "target",
            "model": model,
            "data": {"classes": [7, 1, 4]},
            "init": {"skip": [] if change == "head" else ["head"], **init},
        }
    )
    store = Store.open(sqlite_url(tmp_path / "store.db"))
    with pytest.raises(SpecError) as err:
        Controller.create(store, None, spec, tmp_path, "target")
    problems = dict(err.value.problems)
    assert field in problems, problems
    assert re.search(phrase, problems[field]), problems[field]
    assert store.list_jobs() == []


# -- a real job ----------------------------------------------------------------------------------


def _job(tmp_path: Path, name: str, **sections) -> Store:
    """Run a job through the CLI as a user would; its store."""
    spec = write_spec(tmp_path / f"{name}.yaml", name=name, **sections)
    res = cli("run", str(spec), "--workdir", str(tmp_path / name), "--job-id", name)
    assert res.returncode == 0, res.stdout + res.stderr
    return Store.open(sqlite_url(tmp_path / name / "store.db"), migrate=False)


def _weights(path: str | Path, spec: JobSpec) -> dict[str, torch.Tensor]:
    module = build_model(spec.model, seed=12345)  # everything but skipped units from disk
    load_weights(path, module)
    return module.state_dict()


@pytest.mark.slow
def test_a_job_fine_tunes_from_another_jobs_checkpoint(tmp_path: Path) -> None:
    """Pretrain on digits 0-4 through the CLI, then fine-tune on 5-9 with a new head from that
    job's checkpoints directory: the job records the pinned checkpoint, starts from its weights
    with a fresh head, and completes. (A vanishing learning rate keeps the fine-tuned weights
    where they started, so the end state shows the start.)"""
    model = {"num_classes": 5}
    pre = _job(
        tmp_path, "pre", model=model, data={"classes": [0, 1, 2, 3, 4]}, training={"epochs": 1}
    )
    newest = Path(pre.latest_checkpoint("pre").path)
    ft = _job(
        tmp_path,
        "ft",
        model=model,
        data={"classes": [5, 6, 7, 8, 9]},
        training={"epochs": 1, "max_steps": 2, "lr": 1e-9},
        init={"checkpoint": str(newest.parent), "skip": ["head"]},
    )
    job = ft.get_job("ft")
    assert job.state == "completed" and job.step == 2
    assert job.spec.init.checkpoint == str(newest)  # the directory's newest, pinned
    created = next(e for e in ft.events("ft", limit=100) if e.kind == "job_created")
    assert created.data["init"]["checksum"] == job.spec.init.checksum
    assert str(newest) in created.message
    start = _weights(newest, job.spec)
    end = _weights(ft.latest_checkpoint("ft").path, job.spec)
    fresh = build_model(job.spec.model, job.spec.training.seed).state_dict()
    for name, value in end.items():
        expected = fresh[name] if name.startswith("head.") else start[name]
        torch.testing.assert_close(value, expected, atol=1e-6, rtol=0, msg=name)
    assert not torch.allclose(start["head.fc.weight"], fresh["head.fc.weight"])
    pre.close()
    ft.close()


@pytest.mark.slow
def test_a_checkpoint_gone_after_submission_fails_the_job_after_one_generation(
    tmp_path: Path,
) -> None:
    """The checkpoint a job fine-tunes from was checked and pinned when the job was submitted,
    then deleted before the workers started (the controller and trainer roles of a torchx
    launch start apart). Every rank fails the same way while loading it: the job fails after
    that one generation, with the error in its status, instead of restarting
    runtime.max_restarts times."""
    source = _save(tmp_path / "pre" / "checkpoints" / "step-00000040", step=40)
    spec = write_spec(
        tmp_path / "ft.yaml",
        name="ft",
        model=MODEL,
        training={"epochs": 1, "global_batch_size": 16},
        init={"checkpoint": str(source)},
        runtime={"max_restarts": 5},
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tmp_path / "runs"
    ctl = start_cli(
        "controller", str(spec), "--job-id", "ft", "--workdir", str(workdir),
        "--etcd-port", str(port), "--join-timeout", "60", log=tmp_path / "controller.log",
    )  # fmt: skip
    workers = None
    try:
        wait_for(store_probe(workdir / "store.db", "ft", lambda s, j: s.get_job(j)), 60, "the job")
        shutil.rmtree(source.parent.parent)  # after submission, before any worker loads it
        t0 = time.monotonic()
        workers = start_cli(
            "workers", "--job-id", "ft", "--etcd", f"127.0.0.1:{port}", "--nproc-per-node", "2",
            log=tmp_path / "workers.log",
        )  # fmt: skip
        assert workers.wait(timeout=120) == 0, (tmp_path / "workers.log").read_text()[-3000:]
        took = time.monotonic() - t0
        # a failure a restart cannot fix: the status that ends a Volcano job (TerminateJob)
        assert ctl.wait(timeout=60) == EXIT_JOB_FAILED, (tmp_path / "controller.log").read_text()[
            -3000:
        ]
    finally:
        for proc in (ctl, workers):
            if proc is not None:
                proc.kill()
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    job = store.get_job("ft")
    assert job.state == "failed", job.message
    assert "every rank failed the same way while starting" in job.message
    assert "CheckpointError" in job.message and str(source) in job.message
    gens = store.generations("ft")
    assert [(g.number, g.state) for g in gens] == [(1, "failed")]
    failed = [e for e in store.events("ft", limit=200) if e.kind == "worker_failed"]
    assert sorted(e.rank for e in failed) == [0, 1]
    assert all(e.data["phase"] == "build" for e in failed)
    assert took < 60, f"{took:.0f}s: it should not have gone through the restarts"
