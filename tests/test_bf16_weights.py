"""`training.precision: bf16-weights` in the job (issue 29): bf16 parameters compute without
autocast, AdamW updates float32 masters (`trainer.optim.MasterWeights`) that the optimizer,
gradient sync, clipping and checkpoints see under the model's own names. Through re-layouts on
real gloo processes: the model is always its masters rounded, checkpoints hold the float32
masters (so they move bit for bit to the next layout and resume under any precision), frozen
masters never change, replicas agree bit for bit, and the run trains what float32 trains. A
real CLI job freezes, re-lays out and serves its prefix from AutoCache under it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetransformer.core.sampler import IGNORE
from pipetransformer.core.spec import JobSpec
from pipetransformer.models.seeded import build_model
from pipetransformer.store import Store, sqlite_url
from pipetransformer.trainer.checkpoint import _optimizer_tensors, _SafeReader, save_checkpoint
from pipetransformer.trainer.relayout import build_training
from tests.fixtures_run import cli, write_spec
from tests.mp import run_distributed
from tests.test_relayout import PLAN, SPEC, _batches, _data, _reference

BF16 = JobSpec.model_validate(
    {**SPEC.model_dump(), "training": {**SPEC.training.model_dump(), "precision": "bf16-weights"}}
)


def _train(rank: int, world: int, ckpt_dir: str) -> dict:
    """tests/test_relayout.py's three layouts (2x1 -> 2x1 F=1 -> 1x2 F=3), each step as the
    trainer takes it under bf16-weights, with checks after every step."""
    x, y = _data()
    switches = dict(PLAN)
    pipe = opt = None
    frozen: dict[str, torch.Tensor] = {}
    moved = []  # (saved, loaded) masters at each re-layout
    for step, b in enumerate(_batches()):
        if step in switches:
            layout, path = switches[step], None
            if pipe is not None:
                path = str(Path(ckpt_dir) / f"step-{step}")
                save_checkpoint(path, pipe.model.state_module, opt, {"step": step})
                saved = {k: v.clone() for k, v in pipe.model.state_module.state_dict().items()}
                pipe.destroy_groups()
            pipe, opt = build_training(BF16, layout, rank, load_from=path)
            if path is not None:
                loaded = pipe.model.state_module.state_dict()
                moved.append((saved, {k: v.clone() for k, v in loaded.items()}))
            replica, per = layout.placement(rank)[1], 16 // layout.replicas
        sl = slice(replica * per, (replica + 1) * per)
        targets = y[b.indices].clone()
        targets[~torch.from_numpy(b.valid)] = IGNORE
        pipe.train_step(x[b.indices][sl] if pipe.is_first else None, targets[sl], b.global_valid)
        master = pipe.model.master
        master.load_grads()
        pipe.sync_and_clip(BF16.training.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        master.write_back()
        masters = dict(pipe.model.state_module.named_parameters())
        for name, p in pipe.model.named_parameters():
            assert p.dtype == torch.bfloat16 and masters[name].dtype == torch.float32, name
            assert torch.equal(p, masters[name].to(torch.bfloat16)), f"{name} is not its master"
            if not p.requires_grad:
                frozen.setdefault(name, masters[name].clone())
                assert torch.equal(masters[name], frozen[name]), f"frozen {name} changed"
    state = pipe.model.state_module
    return {
        "replica": replica,
        "params": {k: v.clone() for k, v in state.state_dict().items()},
        "optim": {k: v.clone() for k, v in _optimizer_tensors(state, opt).items()},
        "moved": moved,
    }


@pytest.mark.slow
@pytest.mark.numerics  # compared with the float32 reference: again under other kernels
def test_bf16_weights_train_through_relayouts(tmp_path: Path) -> None:
    results = run_distributed(_train, 2, str(tmp_path))
    # a checkpoint carries the float32 masters: what the next layout loads is what was saved
    for r in results:
        assert len(r["moved"]) == 2
        for saved, loaded in r["moved"]:
            for name in set(saved) & set(loaded):
                assert torch.equal(saved[name], loaded[name]), name
    for path in tmp_path.glob("step-*"):
        stored = _SafeReader(str(path)).read_metadata().state_dict_metadata
        dtypes = {v.properties.dtype for k, v in stored.items() if k.startswith("model.")}
        assert dtypes == {torch.float32}, (path.name, dtypes)
    # both replicas of the final 1x2 layout hold the same masters and optimizer state
    for key in ("params", "optim"):
        a, b = (r[key] for r in results)
        assert set(a) == set(b)
        for name in a:
            assert torch.equal(a[name], b[name]), f"{key}: {name}"
    # it trains what float32 trains: the one-process float32 reference moved every trainable
    # weight some distance from its initialisation; bf16 (activations and gradients rounded to
    # 8 bits of mantissa) lands within a fifth of that distance of it
    got: dict[str, torch.Tensor] = {}
    for r in results:
        if r["replica"] == 0:
            got.update(r["params"])
    ref = _reference()
    init = build_model(SPEC.model, SPEC.training.seed).state_dict()
    assert set(got) == set(ref)
    for name in ("blocks.3.mlp.0.weight", "blocks.3.attn.qkv.weight", "head.fc.weight"):
        travelled = (ref[name] - init[name]).norm()
        assert travelled > 0, name
        assert (got[name] - ref[name]).norm() < 0.2 * travelled, name


def test_a_bf16_weights_job_freezes_relays_out_and_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real job: 2 stages re-planned as blocks freeze, the frozen prefix served from AutoCache,
    its checkpoints float32 (what a float32 job writes)."""
    monkeypatch.setenv("PIPETRANSFORMER_CACHE", str(tmp_path / "cache"))
    workdir = tmp_path / "runs"
    spec = write_spec(
        tmp_path / "bf16w.yaml",
        model={"depth": 4},
        training={"epochs": 1, "max_steps": 12, "precision": "bf16-weights"},
        freeze={"policy": "schedule", "every": 4, "keep_trainable": 1, "cache": "on"},
    )
    run = cli("run", str(spec), "--workdir", str(workdir), "--job-id", "w")
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    try:
        job = store.get_job("w")
        assert job.state == "completed" and job.step == 12
        layouts = [h.layout for h in store.layouts("w")]
        last = layouts[-1]  # its shape is AutoPipe's measured choice (2x1 or 1x2)
        assert layouts[0].freeze_boundary == 0 and last.freeze_boundary >= 2, last.short
        assert last.stages[0].start == last.freeze_boundary, last.short  # the prefix left
        assert [m.step for m in store.metrics("w")] == list(range(1, 13))
        losses = [m.loss for m in store.metrics("w")]
        assert all(loss == loss and loss < 10 for loss in losses), losses  # finite, sane
        decided = [e for e in store.events("w", limit=500) if e.kind == "cache_decided"]
        assert decided and all(e.data["use"] for e in decided)
        final = store.checkpoints("w")[-1]
    finally:
        store.close()
    stored = _SafeReader(final.path).read_metadata().state_dict_metadata
    assert {v.properties.dtype for k, v in stored.items() if k.startswith("model.")} == {
        torch.float32
    }
