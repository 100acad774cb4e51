"""Checkpoints: written under one partition, loaded under another (keys are stable block names);
torn or altered checkpoints are detected and the previous committed one is used (DESIGN §4.7)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.controller import Controller
from orchestrator.manifest import CheckpointError, verify_checkpoint
from orchestrator.spec import JobSpec
from orchestrator.store import Store
from tests.mp import run_distributed
from trainer.checkpoint import _optimizer_tensors, load_checkpoint, read_meta, save_checkpoint
from trainer.models import build_model
from trainer.optim import build_optimizer
from trainer.partition import plan_layout
from trainer.pipeline import build_rank_pipeline

SPEC = JobSpec(
    name="ckpt-test",
    model={"depth": 4, "dim": 32, "heads": 4},
    training={"global_batch_size": 16},
    parallel={"stages": 2, "microbatches": 2},
)


def _train_two_steps_and_save(rank: int, world: int, spec_json: str, path: str):
    spec = JobSpec.model_validate_json(spec_json)
    pipe = build_rank_pipeline(spec.model, 0, plan_layout(spec), rank, 16)
    module = pipe.model
    opt = build_optimizer(module, spec.training)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        pipe.train_step(x if pipe.is_first else None, y, 16)
        pipe.sync_and_clip(1.0)
        opt.step()
        opt.zero_grad()
    saved = save_checkpoint(path, module, opt, {"step": 2})
    return {
        "model": {k: v.clone() for k, v in module.state_dict().items()},
        "optim": {k: v.clone() for k, v in _optimizer_tensors(module, opt).items()},
        "saved": saved,
    }


@pytest.fixture(scope="module")
def two_stage_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("ckpt") / "step-00000002"
    results = run_distributed(_train_two_steps_and_save, 2, SPEC.model_dump_json(), str(path))
    return path, results


@pytest.mark.slow
def test_two_stage_checkpoint_loads_into_one_process(two_stage_checkpoint) -> None:
    path, results = two_stage_checkpoint
    saved = results[0]["saved"]
    assert saved is not None and results[1]["saved"] is None  # rank 0 seals it
    assert verify_checkpoint(path, saved.checksum) == saved.size_bytes
    assert read_meta(path) == {"step": 2}
    assert not path.with_name(path.name + ".partial").exists()

    full = build_model(SPEC.model, seed=123)  # different init: everything must come from disk
    opt = build_optimizer(full, SPEC.training)
    load_checkpoint(path, full, opt)
    expected_model = results[0]["model"] | results[1]["model"]
    assert set(expected_model) == set(full.state_dict())
    for name, value in full.state_dict().items():
        assert torch.equal(value, expected_model[name]), name
    expected_optim = results[0]["optim"] | results[1]["optim"]
    loaded = _optimizer_tensors(full, opt)
    assert set(loaded) == set(expected_optim)
    for name, value in loaded.items():
        assert torch.equal(value, expected_optim[name]), name


@pytest.mark.slow
def test_truncated_shard_is_detected(two_stage_checkpoint, tmp_path: Path) -> None:
    import shutil

    path, results = two_stage_checkpoint
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    shard = next(p for p in copy.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=shard.name):
        verify_checkpoint(copy, results[0]["saved"].checksum)
    with pytest.raises(CheckpointError, match="does not match the committed checksum"):
        verify_checkpoint(path, "0" * 64)


@pytest.mark.slow
def test_controller_falls_back_to_previous_committed(
    two_stage_checkpoint, tmp_path: Path, store: Store
) -> None:
    import shutil

    path, results = two_stage_checkpoint
    saved = results[0]["saved"]
    store.create_job("job-1", SPEC, str(tmp_path))
    older, newer = tmp_path / "step-1", tmp_path / "step-2"
    shutil.copytree(path, older)
    shutil.copytree(path, newer)
    for step, p in ((1, older), (2, newer)):
        store.commit_checkpoint(
            "job-1",
            step=step,
            epoch=0,
            layout_version=1,
            path=str(p),
            size_bytes=saved.size_bytes,
            checksum=saved.checksum,
            samples_consumed=16 * step,
        )
    (newer / "manifest.json").unlink()  # torn after commit
    ctrl = Controller(store, etcd=None, job_id="job-1")  # resume_point needs no etcd
    state, ckpt = ctrl.resume_point()
    assert ckpt.step == 1 and state.step == 1 and state.samples_consumed == 16
    assert state.checkpoint == str(older)
    assert [c.step for c in store.checkpoints("job-1")] == [1]
    assert store.checkpoints("job-1", state="corrupt")[0].step == 2
    assert any(e["kind"] == "checkpoint_corrupt" for e in store.events("job-1"))
