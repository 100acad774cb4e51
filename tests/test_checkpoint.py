"""Checkpoints: written under one partition, loaded under another (keys are stable block names);
torn or altered checkpoints are detected and the previous committed one is used
(docs/architecture.md, Invariants 7); asynchronous checkpoints are snapshots, equal to synchronous
ones, and sealed only once every shard is durable; loading unpickles nothing but DCP's index; the
interval rule."""

from __future__ import annotations

import json
import os
import pickle
import signal
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipetransformer.core.planner import plan_layout
from pipetransformer.core.spec import CheckpointSpec, JobSpec
from pipetransformer.edge.manifest import CheckpointError, read_meta, verify_checkpoint
from pipetransformer.models.seeded import build_model
from pipetransformer.orchestrator.controller import Controller
from pipetransformer.store import Store
from pipetransformer.trainer.checkpoint import (
    AsyncCheckpointer,
    CheckpointWriteError,
    _MetadataUnpickler,
    _optimizer_tensors,
    checkpoint_due,
    load_checkpoint,
    save_checkpoint,
)
from pipetransformer.trainer.optim import build_optimizer
from pipetransformer.trainer.pipeline import build_rank_pipeline
from tests.mp import _entry, run_distributed

SPEC = JobSpec(
    name="ckpt-test",
    model={"depth": 4, "dim": 32, "heads": 4},
    training={"global_batch_size": 16},
    parallel={"stages": 2, "microbatches": 2},
)


def _train_two_steps_and_save(rank: int, world: int, spec_json: str, path: str):
    spec = JobSpec.model_validate_json(spec_json)
    pipe = build_rank_pipeline(spec.model, 0, plan_layout(spec).layout, rank, 16)
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
    shutil.rmtree(copy)
    shutil.copytree(path, copy)
    (copy / "meta.json").write_text('{"step": 999}')  # the training state is covered too
    with pytest.raises(CheckpointError, match="meta.json"):
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
    state, ckpt, _ = ctrl.resume_point()
    assert ckpt.step == 1 and state.step == 1 and state.samples_consumed == 16
    assert state.checkpoint == str(older)
    assert [c.step for c in store.checkpoints("job-1")] == [1]
    assert store.checkpoints("job-1", state="corrupt")[0].step == 2
    assert any(e.kind == "checkpoint_corrupt" for e in store.events("job-1"))


# -- the interval rule ---------------------------------------------------------------------------


def _due(steps_since: int, epoch: int = 3, epoch_end: bool = False, seconds=None, **spec):
    return checkpoint_due(
        CheckpointSpec(**spec),
        steps_since=steps_since,
        epoch=epoch,
        epoch_end=epoch_end,
        seconds_since=seconds,
    )


def test_epoch_interval() -> None:
    assert _due(5, epoch_end=True) == "epoch"  # default: every epoch
    assert _due(5, epoch=3, epoch_end=False) is None
    assert _due(5, epoch=3, epoch_end=True, every_epochs=2) is None
    assert _due(5, epoch=4, epoch_end=True, every_epochs=2) == "epoch"
    assert _due(5, epoch=4, epoch_end=True, every_epochs=None, every_steps=100) is None


def test_step_and_second_intervals_count_from_the_last_checkpoint() -> None:
    assert _due(9, every_steps=10) is None
    assert _due(10, every_steps=10) == "steps"
    assert _due(11, every_steps=10) == "steps"  # an overdue one is still due
    assert _due(3, seconds=29.9, every_seconds=30) is None
    assert _due(3, seconds=30.0, every_seconds=30) == "seconds"
    assert _due(3, seconds=None, every_seconds=30) is None  # clock not consulted this step


def test_any_interval_makes_it_due_and_nothing_is_due_twice_per_step() -> None:
    both = {"every_steps": 50, "every_seconds": 10.0, "every_epochs": None}
    assert _due(50, seconds=1.0, **both) == "steps"
    assert _due(2, seconds=12.0, **both) == "seconds"
    assert _due(2, seconds=1.0, **both) is None
    assert _due(0, epoch_end=True, seconds=99.0, **both | {"every_epochs": 1}) is None


# -- asynchronous checkpoints (2 processes, gloo) ------------------------------------------------


def _pipeline(spec: JobSpec, rank: int):
    pipe = build_rank_pipeline(spec.model, 0, plan_layout(spec).layout, rank, 16)
    return pipe, build_optimizer(pipe.model, spec.training)


def _train(pipe, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)
        pipe.train_step(x if pipe.is_first else None, y, 16)
        pipe.sync_and_clip(1.0)
        opt.step()
        opt.zero_grad()


def _tensors(module, opt) -> dict:
    return {
        "model": {k: v.clone() for k, v in module.state_dict().items()},
        "optim": {k: v.clone() for k, v in _optimizer_tensors(module, opt).items()},
    }


def _hold_writes(release: threading.Event) -> None:
    """DCP's file writer (in the checkpoint thread) waits until `release` is set."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        release.wait(60)
        return original(self, plan, planner)

    filesystem.FileSystemWriter.write_data = write_data


def _sync_async_and_snapshot(rank: int, world: int, spec_json: str, root: str):
    spec = JobSpec.model_validate_json(spec_json)
    pipe, opt = _pipeline(spec, rank)
    _train(pipe, opt, 2, seed=0)
    snapshot = _tensors(pipe.model, opt)

    sync = AsyncCheckpointer(async_save=False)
    sync.start(Path(root) / "sync", pipe.model, opt, {"step": 2})
    saved_sync = sync.poll()  # sealed inside start()

    release = threading.Event()
    _hold_writes(release)
    ckpt = AsyncCheckpointer()
    t0 = time.monotonic()
    ckpt.start(Path(root) / "async", pipe.model, opt, {"step": 2})
    start_s = time.monotonic() - t0
    _train(pipe, opt, 3, seed=1)  # steps while the checkpoint is in flight
    in_flight = ckpt.poll() is None and ckpt.in_flight
    unsealed = not (Path(root) / "async").exists()
    release.set()
    saved_async = ckpt.wait()
    return {
        "snapshot": snapshot,
        "later": _tensors(pipe.model, opt),
        "sync": saved_sync,
        "async": saved_async,
        "in_flight": in_flight,
        "unsealed": unsealed,
        "start_s": start_s,
        "again": ckpt.poll(),  # collected once only
    }


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("async")
    return root, run_distributed(_sync_async_and_snapshot, 2, SPEC.model_dump_json(), str(root))


def _load(path: Path) -> dict:
    full = build_model(SPEC.model, seed=123)
    opt = build_optimizer(full, SPEC.training)
    load_checkpoint(path, full, opt)
    return _tensors(full, opt)


def _merged(results: list, key: str) -> dict:
    return {part: results[0][key][part] | results[1][key][part] for part in ("model", "optim")}


def _assert_equal(actual: dict, expected: dict) -> None:
    for part in ("model", "optim"):
        assert set(actual[part]) == set(expected[part]), part
        for name, value in actual[part].items():
            assert value.dtype == expected[part][name].dtype, name
            assert torch.equal(value, expected[part][name]), name


@pytest.mark.slow
def test_async_checkpoint_equals_sync_one_bit_for_bit(async_run) -> None:
    root, results = async_run
    sync, done = results[0]["sync"], results[0]["async"]
    for r in results:  # every rank learns the sealed checkpoint, exactly once
        assert (r["sync"].checksum, r["async"].checksum) == (sync.checksum, done.checksum)
        assert r["again"] is None
    assert verify_checkpoint(root / "sync", sync.checksum) == sync.size_bytes
    assert verify_checkpoint(root / "async", done.checksum) == done.size_bytes
    assert read_meta(root / "async") == {"step": 2}
    # the shards themselves are byte-identical (only .metadata names its own path and save id)
    manifests = [json.loads((root / n / "manifest.json").read_text()) for n in ("sync", "async")]
    shards = [{k: v for k, v in m.items() if k.endswith(".distcp")} for m in manifests]
    assert shards[0] == shards[1] and len(shards[0]) == 2
    _assert_equal(_load(root / "async"), _load(root / "sync"))
    assert not list(root.glob("*.partial"))


@pytest.mark.slow
def test_async_checkpoint_is_a_snapshot(async_run) -> None:
    root, results = async_run
    assert all(r["in_flight"] and r["unsealed"] for r in results)  # steps overlapped the write
    snapshot, later = _merged(results, "snapshot"), _merged(results, "later")
    assert any(
        not torch.equal(later["model"][k], v) for k, v in snapshot["model"].items()
    )  # the 3 later steps changed the weights in place...
    _assert_equal(_load(root / "async"), snapshot)  # ...and none of it reached the checkpoint
    assert max(r["start_s"] for r in results) < 5.0  # start() did not wait for the write


def _killed_mid_write(rank: int, world: int, path: str):
    ckpt = AsyncCheckpointer(timeout=timedelta(seconds=60))
    module = build_model(SPEC.model, seed=rank)
    opt = build_optimizer(module, SPEC.training)
    if rank == 1:
        from torch.distributed.checkpoint import filesystem

        def write_data(self, plan, planner):  # a torn shard, then the process is killed
            (Path(self.path) / "stale.distcp").write_bytes(b"torn")
            os.kill(os.getpid(), signal.SIGKILL)

        filesystem.FileSystemWriter.write_data = write_data
    ckpt.start(path, module, opt, {"step": 7})
    try:
        ckpt.wait()
    except CheckpointWriteError as exc:
        return {"error": str(exc)}
    return {"error": None}


@pytest.mark.slow
def test_writer_killed_mid_write_leaves_nothing_sealed(tmp_path: Path) -> None:
    path = tmp_path / "step-00000007"
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(r, 2, store, _killed_mid_write, (str(path),), tmp))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        codes = [p.exitcode for p in procs]
        rank0 = torch.load(os.path.join(tmp, "0.pt"), weights_only=False)
    assert codes == [0, -signal.SIGKILL]
    assert rank0["error"] and "was not sealed" in rank0["error"]
    assert not path.exists()  # rank 0 wrote its shard but did not seal without rank 1's
    partial = path.with_name(path.name + ".partial")
    assert (partial / "stale.distcp").exists() and not (partial / "manifest.json").exists()
    # a later attempt at the same step (here by one process) replaces the torn directory
    module = build_model(SPEC.model, seed=0)
    ckpt = AsyncCheckpointer()
    ckpt.start(path, module, build_optimizer(module, SPEC.training), {"step": 7})
    saved = ckpt.wait()
    assert verify_checkpoint(path, saved.checksum) == saved.size_bytes
    assert not (path / "stale.distcp").exists() and not partial.exists()


def _shard_lost_before_seal(rank: int, world: int, spec_json: str, root: str):
    """Rank 1's shard vanishes after DCP wrote (and this rank hashed) it, before the seal."""
    import pipetransformer.trainer.checkpoint as checkpoint

    spec = JobSpec.model_validate_json(spec_json)
    pipe, opt = _pipeline(spec, rank)
    if rank == 1:
        hash_entry = checkpoint._entry

        def entry_then_lose(path: Path) -> dict:
            result = hash_entry(path)
            path.unlink()
            return result

        checkpoint._entry = entry_then_lose
    ckpt = AsyncCheckpointer()
    ckpt.start(Path(root) / "lost", pipe.model, opt, {"step": 1})
    try:
        ckpt.wait()
        error = None
    except CheckpointWriteError as exc:
        error = str(exc)
    if rank == 1:
        checkpoint._entry = hash_entry
    ckpt.start(Path(root) / "next", pipe.model, opt, {"step": 2})  # the next one is fine
    return {"error": error, "next": ckpt.wait()}


@pytest.mark.slow
def test_a_shard_lost_before_the_seal_fails_the_checkpoint(tmp_path: Path) -> None:
    results = run_distributed(_shard_lost_before_seal, 2, SPEC.model_dump_json(), str(tmp_path))
    for r in results:  # every rank learns that it failed
        assert r["error"] and "shard __1_0.distcp is missing" in r["error"], r["error"]
    assert not (tmp_path / "lost").exists()  # never sealed, so never committed
    assert not (tmp_path / "lost.partial" / "manifest.json").exists()
    saved = results[0]["next"]
    assert verify_checkpoint(tmp_path / "next", saved.checksum) == saved.size_bytes


# -- loading unpickles nothing but DCP's index ---------------------------------------------------


@pytest.fixture
def single_process_checkpoint(tmp_path: Path) -> Path:
    module = build_model(SPEC.model, seed=0)
    opt = build_optimizer(module, SPEC.training)
    ckpt = AsyncCheckpointer()
    ckpt.start(tmp_path / "ckpt", module, opt, {"step": 0})
    saved = ckpt.wait()
    assert saved is not None and saved.blocked_s <= saved.seconds
    return tmp_path / "ckpt"


class _Gadget:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_tampered_metadata_cannot_run_code(single_process_checkpoint: Path) -> None:
    path = single_process_checkpoint
    _assert_equal(_load(path), _load(path))  # loads as written
    marker = path.parent / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Gadget(marker)))
    with pytest.raises(CheckpointError, match="refusing to load"):
        _load(path)
    assert not marker.exists()


def test_objects_stored_as_bytes_are_refused(single_process_checkpoint: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = single_process_checkpoint
    with open(path / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    key = next(k for k in metadata.state_dict_metadata if k.startswith("model."))
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=f"{key}.*as pickled objects"):
        _load(path)


def test_optimizer_tensors_match_torch_flattening() -> None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from pipetransformer.trainer.checkpoint import _OPTIONS

    module = build_model(SPEC.model, seed=0)
    for p in module.blocks["0"].parameters():  # a frozen block has no optimizer state
        p.requires_grad_(False)
    opt = build_optimizer(module, SPEC.training)
    fresh = _optimizer_tensors(module, opt)  # initialises the state (load relies on it)
    module(torch.randn(4, 1, 8, 8)).sum().backward()
    opt.step()
    fast = _optimizer_tensors(module, opt)  # read directly now
    full = get_optimizer_state_dict(module, opt, options=_OPTIONS)
    official = {k: v for k, v in full.items() if k.startswith("state.")}
    assert list(fast) == list(official) == list(fresh) and fast
    assert not any(k.startswith("state.blocks.0.") for k in fast)
    assert all(fast[k] is official[k] for k in fast)


def test_a_different_model_does_not_load_silently(single_process_checkpoint: Path) -> None:
    wider = SPEC.model.model_copy(update={"dim": 64})  # same keys, other sizes
    module = build_model(wider, seed=0)
    with pytest.raises(CheckpointError, match="cannot load"):
        load_checkpoint(single_process_checkpoint, module, build_optimizer(module, SPEC.training))
