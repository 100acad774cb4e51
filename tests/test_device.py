"""The device-generic parts of the GPU data plane, on the CPU: which device a worker picks and
the errors before anything starts, GPUs sliced between simulated nodes, the FLOP count behind
MFU, per-rank meta-device init equal to the whole-model build, the training mesh (its groups
never the control group, rebuilt across layouts, DDP for replica sync), and work done once per
node. tests/test_cuda.py runs the same code on a GPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pipetransformer.core import flops
from pipetransformer.core.spec import JobSpec, ModelSpec, gpu_shortfall, local_device_type
from pipetransformer.core.state import Layout, StageLayout
from pipetransformer.models.seeded import build_model, build_stage, init_unit, unit_names, unit_seed
from pipetransformer.orchestrator import gpus, local
from pipetransformer.trainer import profile
from pipetransformer.trainer.collective import once_per_node
from pipetransformer.trainer.device import Compute, DeviceError, resolve_device
from pipetransformer.trainer.pipeline import RankModel, build_rank_pipeline
from tests.mp import run_distributed

VIT_B16 = ModelSpec(
    family="vit", image_size=224, patch_size=16, channels=3, dim=768, depth=12, heads=12,
    mlp_ratio=4.0, num_classes=1000,
)  # fmt: skip
SMALL = ModelSpec(dim=32, depth=4, heads=4, mlp_ratio=2.0)
REPO = Path(__file__).resolve().parents[1]


# -- which device ---------------------------------------------------------------------------------


def test_device_choice_and_its_errors() -> None:
    assert resolve_device("cpu", 0, 2, gpus=8) == torch.device("cpu")
    assert resolve_device("auto", 1, 2, gpus=2) == torch.device("cuda", 1)
    assert resolve_device("auto", 0, 2, gpus=1) == torch.device("cpu")  # not one GPU each
    assert resolve_device("auto", 0, 1, gpus=0) == torch.device("cpu")
    assert resolve_device("cuda", 3, 4, gpus=4) == torch.device("cuda", 3)
    with pytest.raises(DeviceError, match="no CUDA device"):
        resolve_device("cuda", 0, 1, gpus=0)
    with pytest.raises(DeviceError, match="runs 4 worker.*has 2 GPU"):
        resolve_device("cuda", 0, 4, gpus=2)
    assert gpu_shortfall("auto", 8, 0) is None and gpu_shortfall("cpu", 8, 0) is None
    assert local_device_type("auto", 2, 2) == "cuda" and local_device_type("auto", 3, 2) == "cpu"


def test_run_refuses_a_cuda_spec_this_machine_cannot_seat(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    spec = JobSpec.model_validate(
        {"name": "g", "parallel": {"stages": 2}, "runtime": {"device": "cuda"}}
    )
    assert "has 1 GPU" in local.machine_gpu_shortfall(spec)
    assert local.machine_gpu_shortfall(spec.model_copy(update={"runtime": spec.runtime.model_copy(
        update={"device": "auto"})})) is None  # fmt: skip


CHECK_IMPORTS = """
import json, sys
from pipetransformer.core.spec import JobSpec
from pipetransformer.orchestrator import gpus, local
if sys.argv[1:]:
    gpus.GPU_DRIVER_NODES = (sys.argv[1],)
spec = JobSpec.model_validate({"name": "g", "parallel": {"stages": 2}})
problems = local.admission_problems(spec, here=True)
print(json.dumps([problems, local.node_devices(spec, 1), "torch" in sys.modules]))
"""


def test_a_cpu_machine_admits_and_places_a_job_without_importing_torch(tmp_path: Path) -> None:
    """`run` asks how many GPUs there are: where no GPU driver can be opened the answer is 0
    without importing torch (2.5 s of every run), and torch is asked where one can."""
    if any(map(os.path.exists, gpus.GPU_DRIVER_NODES)):
        pytest.skip("this machine has a GPU driver")
    cmd = [sys.executable, "-c", CHECK_IMPORTS]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[], [{}], False]
    driver = tmp_path / "nvidiactl"  # a driver node to open: torch counts (none here)
    driver.touch()
    out = subprocess.run([*cmd, str(driver)], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[], [{}], True]


def test_simulated_nodes_get_their_own_gpus(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [local.node_gpus(k, 2) for k in range(2)] == ["0,1", "2,3"]
    assert local.node_gpus(1, 1, visible="5,7") == "7"
    two_nodes = JobSpec.model_validate(
        {"name": "g", "parallel": {"stages": 2, "replicas": 2}, "runtime": {"nodes": 2}}
    )
    assert local.node_devices(two_nodes, 2) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        {"CUDA_VISIBLE_DEVICES": "2,3"},
    ]
    # auto with more workers than GPUs: the whole machine trains on the CPU, GPUs hidden
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local.node_devices(two_nodes, 2) == [{"CUDA_VISIBLE_DEVICES": ""}] * 2
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert local.node_devices(two_nodes, 2) == [{}, {}]


def test_profiling_measures_the_device_it_is_given(monkeypatch) -> None:
    # the trap: "cuda when present" would profile a GPU while the job trains on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert profile._device(None) == torch.device("cpu")
    assert profile.profile_key(SMALL, 4, "cpu", "bf16") != profile.profile_key(SMALL, 4, "cpu")


# -- FLOPs and MFU ----------------------------------------------------------------------------


def test_vit_b16_flops_match_the_published_count() -> None:
    # ViT-B/16 at 224: 17.6 GMACs per image forward (timm, fvcore), i.e. 35.1 GFLOPs; ours
    # leaves out norms, softmax and GELU, so it sits just below
    forward = 12 * flops.block_forward_flops(VIT_B16) + flops.embed_forward_flops(VIT_B16)
    forward += flops.head_forward_flops(VIT_B16)
    assert 34.5e9 < forward < 35.3e9, forward
    train = flops.training_flops_per_sample(VIT_B16)
    assert train == pytest.approx(3 * forward)
    block = flops.block_forward_flops(VIT_B16)
    frozen_recomputed = flops.training_flops_per_sample(VIT_B16, boundary=9)
    frozen_cached = flops.training_flops_per_sample(VIT_B16, boundary=9, cached=True)
    assert frozen_recomputed - frozen_cached == pytest.approx(
        9 * block + flops.embed_forward_flops(VIT_B16)
    )
    assert frozen_cached == pytest.approx(3 * (3 * block + flops.head_forward_flops(VIT_B16)))
    with pytest.raises(ValueError, match="boundary 13"):
        flops.training_flops_per_sample(VIT_B16, boundary=13)


def test_mfu_against_the_device_peak(monkeypatch) -> None:
    monkeypatch.delenv(flops.PEAK_ENV, raising=False)
    assert flops.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert flops.peak_flops("NVIDIA H100 PCIe", "fp32") == pytest.approx(51.2e12)
    assert flops.peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312e12)
    assert flops.peak_flops("cpu", "fp32") is None and flops.peak_flops(None, "bf16") is None
    assert flops.mfu(1000.0, 1e11, 2, 1e15) == pytest.approx(0.05)
    assert flops.mfu(None, 1e11, 1, 1e15) is None and flops.mfu(10.0, 1e11, 1, None) is None
    monkeypatch.setenv(flops.PEAK_ENV, "2.5")
    assert flops.peak_flops("cpu", "fp32") == pytest.approx(2.5e12)
    monkeypatch.setenv(flops.PEAK_ENV, "fast")
    with pytest.raises(ValueError, match="PIPETRANSFORMER_PEAK_TFLOPS"):
        flops.peak_flops("cpu", "fp32")


# -- meta-device init -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [SMALL, ModelSpec(family="bert", vocab_size=40, seq_len=12, dim=32, depth=3, heads=4)],
    ids=["vit", "bert"],
)
def test_each_rank_materialises_exactly_the_whole_model_weights(spec: ModelSpec) -> None:
    full = dict(build_model(spec, seed=7).named_parameters())
    assert len({unit_seed(7, u) for u in unit_names(spec)}) == spec.depth + 2
    for stages, boundary in (
        ([StageLayout(index=0, start=0, end=2, ranks=[0])], 0),
        ([StageLayout(index=1, start=2, end=spec.depth, ranks=[1])], 0),
        ([StageLayout(index=0, start=1, end=2, ranks=[0])], 1),  # owns the frozen prefix too
    ):
        model = RankModel(spec, 7, stages, [False], boundary)
        own = dict(model.named_parameters())
        assert own and all(p.device.type == "cpu" for p in own.values())
        for name, p in own.items():
            assert torch.equal(p, full[name]), name
        assert set(own) <= set(full)
    stage = build_stage(spec, 7, 1, 2)
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name
    # a unit's weights do not depend on which others a process builds
    assert torch.equal(init_unit(spec, 7, "blocks.1").norm1.weight, full["blocks.1.norm1.weight"])


# -- the training mesh ----------------------------------------------------------------------------


def _layout(stages: int, replicas: int, schedule: str = "gpipe", virtual: int = 1) -> Layout:
    depth, n = SMALL.depth, stages * virtual
    cuts = [round(i * depth / n) for i in range(n + 1)]
    placed = []
    for i in range(n):
        if schedule == "zbv":
            pos = i if i < stages else 2 * stages - 1 - i
        else:
            pos = i % stages
        placed.append(
            StageLayout(
                index=i,
                start=cuts[i],
                end=cuts[i + 1],
                ranks=[r * stages + pos for r in range(replicas)],
            )
        )
    return Layout(
        num_blocks=depth,
        stages=placed,
        replicas=replicas,
        microbatches=4,
        schedule=schedule,
        virtual_stages=virtual,
    )


def _mesh_and_relayout(rank: int, world: int) -> dict:
    out: dict = {}
    gen = torch.Generator().manual_seed(0)  # the same batch on every rank
    x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    for key, layout in (
        ("2x1", _layout(2, 1)),  # "pp" spans the whole world: must not reuse the control group
        ("1x2", _layout(1, 2)),  # "dp" spans it: DDP over a fresh group
        ("zbv", _layout(1, 2, "zbv", 2)),  # zero-bubble: summed after the step, not by DDP
    ):
        pipe = build_rank_pipeline(SMALL, 0, layout, rank, 16 // layout.replicas)
        groups = pipe.groups
        out[key] = {
            "dims": pipe.groups.mesh.mesh_dim_names,
            "control": groups.pipeline == dist.group.WORLD
            or groups.data_parallel == dist.group.WORLD,
            "ddp": [isinstance(s.submod, DistributedDataParallel) for s in pipe.stages],
        }
        replica = layout.placement(rank)[1]
        half = slice(replica * 16 // layout.replicas, (replica + 1) * 16 // layout.replicas)
        pipe.train_step(x[half], y[half], 16)
        norms = pipe.sync_and_clip(1.0)
        out[key]["norm"] = norms.total
        out[key]["grads"] = {
            n: p.grad.clone() for n, p in pipe.model.named_parameters() if p.grad is not None
        }
        pipe.destroy_groups()
        dist.barrier()  # the control group outlives every layout's groups
    flag = torch.tensor([float(rank)])
    dist.all_reduce(flag)
    out["control_sum"] = float(flag)
    return out


@pytest.mark.slow
def test_mesh_groups_are_fresh_per_layout_and_replicas_sync_through_ddp() -> None:
    r0, r1 = run_distributed(_mesh_and_relayout, 2)
    for res in (r0, r1):
        assert res["control_sum"] == 1.0
        for key in ("2x1", "1x2", "zbv"):
            assert res[key]["dims"] == ("dp", "pp") and not res[key]["control"], key
        assert res["2x1"]["ddp"] == [False]  # one replica: nothing to sync
        assert res["1x2"]["ddp"] == [True]
        assert res["zbv"]["ddp"] == [False, False]
    # replicas end every step with the same (summed) gradients and the same norm
    for key in ("1x2", "zbv"):
        assert math.isclose(r0[key]["norm"], r1[key]["norm"], rel_tol=0, abs_tol=0)
        for name, g in r0[key]["grads"].items():
            assert torch.equal(g, r1[key]["grads"][name]), (key, name)
    # and the same norm as the same batch on a 2-stage pipeline (summation order differs)
    assert math.isclose(r0["1x2"]["norm"], r0["2x1"]["norm"], rel_tol=1e-5)


# -- once per node ---------------------------------------------------------------------------------


def _per_node(rank: int, world: int, tmp: str) -> str | None:
    node = "a" if rank < 2 else "b"

    def work() -> None:
        Path(tmp, f"ran-{rank}").touch()
        if node == "b":
            raise ValueError("node b's copy is torn")

    try:
        once_per_node(rank, node, work)
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_work_runs_once_per_node_and_its_error_reaches_the_node(tmp_path: Path) -> None:
    results = run_distributed(_per_node, 3, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ran-0", "ran-2"]
    assert results[:2] == [None, None]
    assert results[2] == "ValueError: node b's copy is torn"


def test_compute_defaults_to_the_cpu_with_gloo() -> None:
    c = Compute()
    assert (c.device.type, c.backend, c.precision, c.cuda) == ("cpu", "gloo", "fp32", False)
    assert Compute(device=torch.device("cuda", 0)).backend == "nccl"


def test_run_admits_gpu_jobs_against_the_smallest_gpu(monkeypatch) -> None:
    class Props:
        def __init__(self, gib: int) -> None:
            self.total_memory = gib << 30

    sizes = {0: Props(80), 1: Props(40)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: sizes[i])
    gpu = JobSpec.model_validate({"name": "g", "runtime": {"device": "cuda"}})
    assert local.gpu_memory(gpu) == 40 << 30
    cpu = gpu.model_copy(update={"runtime": gpu.runtime.model_copy(update={"device": "cpu"})})
    assert local.gpu_memory(cpu) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert local.gpu_memory(gpu) is None


def _bf16_step(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 1, 8, 8, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    out = {}
    for key, layout in (("2x1", _layout(2, 1)), ("1x2", _layout(1, 2))):
        compute = Compute(precision="bf16")
        pipe = build_rank_pipeline(SMALL, 0, layout, rank, 16 // layout.replicas, compute=compute)
        replica = layout.placement(rank)[1]
        half = slice(replica * 16 // layout.replicas, (replica + 1) * 16 // layout.replicas)
        loss = pipe.train_step(x[half], y[half], 16)
        out[key] = {"norm": pipe.sync_and_clip(1.0).total, "loss": loss}
        pipe.destroy_groups()
    return out


@pytest.mark.slow
def test_bf16_pipeline_steps_agree_across_layouts() -> None:
    # bf16 autocast in the stages, float32 between them: a 2-stage pipeline and 2 DDP replicas
    # of the same batch agree within bf16 rounding (rtol 2e-2), not bit for bit (the replicas'
    # micro-batches are half the size, so their bf16 products round differently)
    r0, r1 = run_distributed(_bf16_step, 2)
    assert r0["2x1"]["norm"] == r1["2x1"]["norm"] and r0["1x2"]["norm"] == r1["1x2"]["norm"]
    assert math.isclose(r0["2x1"]["norm"], r0["1x2"]["norm"], rel_tol=2e-2)
    full = r1["2x1"]["loss"]  # the last stage holds the loss
    halves = r0["1x2"]["loss"] + r1["1x2"]["loss"]
    assert full is not None and math.isclose(full, halves, rel_tol=2e-2)
