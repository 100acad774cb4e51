"""The GPU data plane on a CUDA device (`-m cuda`; skipped without one): a job on `cuda` end to
end through the CLI, bf16 training within a stated tolerance of fp32, and NCCL training groups
rebuilt across re-layouts without memory growth. The same code paths run on the CPU in the rest
of the suite (gloo groups, the same mesh, DDP and meta-device init); the precision comparison
runs on both devices here."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipetransformer.core.spec import DataSpec, ModelSpec, TrainingSpec
from pipetransformer.core.state import Layout, StageLayout
from pipetransformer.models.seeded import init_unit
from pipetransformer.models.stage import StageModule
from pipetransformer.store import Store, sqlite_url
from pipetransformer.trainer.data import Dataset, load_dataset, onto_device
from pipetransformer.trainer.device import Compute
from pipetransformer.trainer.optim import build_optimizer, lr_at, set_lr
from pipetransformer.trainer.pipeline import build_rank_pipeline
from tests.fixtures_run import cli, write_spec

CUDA = torch.cuda.is_available()
cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
DIGITS = ModelSpec(dim=64, depth=4, heads=4, mlp_ratio=2.0)


def _train_digits(device: str, precision: str, epochs: int = 10) -> tuple[float, float]:
    """A digits ViT trained on one device at `precision` with the job's LR schedule (warm-up,
    cosine decay: the end point does not hinge on the last steps' noise); (held-out accuracy,
    final train loss)."""
    spec = DIGITS
    data = load_dataset(DataSpec(dataset="digits"), spec)
    units = {i: init_unit(spec, 0, f"blocks.{i}") for i in range(spec.depth)}
    model = StageModule(
        spec,
        0,
        spec.depth,
        init_unit(spec, 0, "embed"),
        units,
        init_unit(spec, 0, "head"),
        precision=precision,
    ).to(device)
    training = TrainingSpec(lr=3e-3)
    opt = build_optimizer(model, training)
    x, y = data.train.inputs.to(device), data.train.labels.to(device)
    gen = torch.Generator().manual_seed(0)
    loss, step, total = torch.tensor(0.0), 0, epochs * -(-len(y) // 64)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(64):
            idx = idx.to(device)
            set_lr(opt, lr_at(step, total, training))
            step += 1
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        logits = model(data.test.inputs.to(device))
    accuracy = (logits.argmax(-1).cpu() == data.test.labels).float().mean().item()
    return accuracy, float(loss.detach())


@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_bf16_trains_within_tolerance_of_fp32(device: str) -> None:
    # bf16 keeps 8 mantissa bits in matrix products, so the two runs diverge step by step and
    # cannot be compared value for value; what must hold is the outcome: held-out accuracy within
    # 4 points (14 of 360 test digits) and a final loss of the same order. Seen: fp32 93.6 %;
    # bf16 91.9 % (AVX-512 kernels), 93.3 % (AVX2), and on an H100 within 3 points.
    torch.manual_seed(0)
    acc32, loss32 = _train_digits(device, "fp32")
    torch.manual_seed(0)
    acc16, loss16 = _train_digits(device, "bf16")
    assert acc32 > 0.9, acc32
    assert abs(acc16 - acc32) <= 0.04, (acc16, acc32)
    assert loss16 < max(3 * loss32, 0.2), (loss16, loss32)


def _one_rank_group(tmp: Path) -> None:
    store = dist.FileStore(str(tmp / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_nccl_groups_rebuilt_across_relayouts_without_memory_growth() -> None:
    """Ten re-layouts in one process (world 1: NCCL cannot put two ranks on one GPU): each
    builds the layout's mesh (NCCL groups), trains a step (so the communicators are really
    created) and destroys the groups. Device memory free (`mem_get_info`, which sees NCCL's own
    buffers too) must not shrink after the first rebuilds."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    compute = Compute(device=device, precision="bf16")
    spec = DIGITS
    frees = []
    with tempfile.TemporaryDirectory() as tmp:
        _one_rank_group(Path(tmp))
        try:
            for k in range(10):
                f = k % 3  # the boundary moves, so the model share changes like a re-layout
                layout = Layout(
                    num_blocks=spec.depth,
                    stages=[StageLayout(index=0, start=f, end=spec.depth, ranks=[0])],
                    microbatches=2,
                    freeze_boundary=f,
                )
                pipe = build_rank_pipeline(spec, 0, layout, 0, 16, compute=compute)
                x = torch.randn(16, 1, 8, 8)
                y = torch.randint(0, 10, (16,))
                pipe.train_step(x, y, 16)
                pipe.sync_and_clip(1.0)  # an all-reduce on the NCCL pipeline group
                pipe.destroy_groups()
                del pipe
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                frees.append(torch.cuda.mem_get_info(device)[0])
        finally:
            dist.destroy_process_group()
    growth = (frees[2] - frees[-1]) / 2**20
    print(json.dumps({"free_mib": [round(v / 2**20) for v in frees], "growth_mib": growth}))
    assert growth < 64, f"device memory shrank by {growth:.0f} MiB over 8 re-layouts"


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "bf16-weights"])
def test_a_one_rank_job_trains_on_cuda_through_the_cli(tmp_path: Path, precision: str) -> None:
    spec = write_spec(
        tmp_path / "gpu.yaml",
        name="gpu",
        parallel={"stages": 1, "replicas": 1, "microbatches": 2},
        training={"epochs": 2, "precision": precision},
        runtime={"device": "cuda", "control_every_steps": 5},
    )
    work = tmp_path / "runs"
    proc = cli("run", str(spec), "--workdir", str(work), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    store = Store(sqlite_url(work / "store.db"))
    job = store.list_jobs()[0]
    assert job.state == "completed", job
    metrics = store.metrics(job.id)
    assert metrics and all(m.loss is not None for m in metrics)
    peaks = [m.peak_memory_mib for m in metrics if m.peak_memory_mib]
    assert peaks and all(p[0] > 0 for p in peaks), peaks
    known = os.environ.get("PIPETRANSFORMER_PEAK_TFLOPS") or "H100" in torch.cuda.get_device_name()
    if known:
        assert all(m.mfu is not None and 0 < m.mfu < 1 for m in metrics[1:])
    status = cli("status", "--workdir", str(work), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "completed"


def test_in_memory_sets_stay_on_the_host_where_they_do_not_fit_or_are_read_by_loaders() -> None:
    data = load_dataset(DataSpec(dataset="digits"), DIGITS)
    size = sum(s.inputs.numel() * s.inputs.element_size() for s in (data.train, data.test))
    # more than an eighth of the free memory: stays (and nothing touches a GPU)
    assert onto_device(data, torch.device("cuda", 0), free_bytes=8 * size - 8) is data
    assert onto_device(data, torch.device("cpu"), free_bytes=2**40) is data
    sourced = Dataset(train=object(), test=data.test)  # a data source's split: loader processes
    assert onto_device(sourced, torch.device("cuda", 0), free_bytes=2**40) is sourced


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_in_memory_sets_that_fit_move_to_the_gpu() -> None:
    data = load_dataset(DataSpec(dataset="digits"), DIGITS)
    moved = onto_device(data, torch.device("cuda", 0), free_bytes=2**40)
    for before, after in ((data.train, moved.train), (data.test, moved.test)):
        assert after.inputs.is_cuda and not after.labels.is_cuda
        assert torch.equal(after.inputs.cpu(), before.inputs)
        assert torch.equal(after.read(np.arange(5)).cpu(), before.read(np.arange(5)))
