"""bench/mfu_profile.py: the kernel-name categories (real names, read off the profile of the
ViT-B/16 step on an H100), the busy-time union, CPU self times, phases through kernel launches,
the per-step summary against the FLOP count, and the whole profile mode as a CPU smoke run on
vit-tiny (JSON, chart, gzipped trace)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import mfu_profile as prof  # noqa: E402

from pipetransformer.core.flops import PEAK_ENV, training_flops_per_sample  # noqa: E402

# (name as the profiler's trace gives it, category): seen on an NVIDIA H100 (torch 2.11, CUDA 13)
REAL = [
    ("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_bias_TNN", "matmul"),
    ("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_splitK_NTN", "matmul"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
     "segment_k_off_kernel__5x_cublas", "matmul"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, "
     "__nv_bfloat16, false, float, __nv_bfloat16, __nv_bfloat16, true, false, f", "matmul"),
    ("triton_tem_fused_mm_0", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1"
     "_kernel0_0", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1"
     "_kernel0_0", "attention"),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*, "
     "void*, unsigned int, unsigned int, unsigned int, unsigned ", "attention"),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int, unsigned "
     "int, unsigned int, unsigned int, unsigned int, unsigned int,", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64,"
     " 128, 128, 8, 4, 4", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<"
     "cutlass::arch::Sm80", "attention"),
    ("triton_per_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_view_10",
     "norm_act"),
    ("triton_poi_fused_gelu_gelu_backward_view_4", "norm_act"),
    ("triton_red_fused_gelu_gelu_backward_sum_view_5", "norm_act"),
    ("triton_poi_fused_add_view_9", "norm_act"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>"
     "(int, float, float const*, float const*, float const*, float*", "norm_act"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, "
     "32u, 32u, 256u, false, true, false>(long, long, float const*", "norm_act"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::GeluBackwardCUDAKernelImpl("
     "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator(", "norm_act"),
    ("void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, "
     "std::array<char*, 3ul>, 4, TrivialOffsetCalculator<2, unsigned int>, TrivialOff", "norm_act"),
    ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::func_wrapper_t"
     "<float, at::native::sum_functor<float, float, float>::ope", "norm_act"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true, false>"
     "(float*, float const*, int, int, int, bool const*, int, bool)", "norm_act"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
     "namespace)::FusedOptimizerTensorListMetadata<4>, at::native::", "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
     "namespace)::TensorListMetadata<1>, at::native::LpNormFunctor<", "optimizer"),
    ("void at::native::lpnorm_cleanup<float, (at::native::NormType)1, float, true, float>(float "
     "const*, at::native::TensorListAddresses, int)", "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("triton_poi_fused_clone_permute_stack_8", "copy"),
    ("triton_poi_fused__to_copy_view_0", "copy"),
    ("triton_poi_fused__to_copy_cat_zeros_like_2", "copy"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda("
     "at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*,", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous "
     "namespace)::OpaqueType<2u>, unsigned int, 4, 64, 64>(at::native::(a", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
     "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::a", "copy"),
    # CPU operators (the smoke run's self times)
    ("aten::addmm", "matmul"),
    ("aten::mm", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "attention"),
    ("aten::native_layer_norm", "norm_act"),
    ("aten::gelu_backward", "norm_act"),
    ("aten::add_", "norm_act"),
    ("aten::_fused_adamw_", "optimizer"),
    ("aten::_foreach_mul_", "optimizer"),
    ("aten::_to_copy", "copy"),
    ("aten::cat", "copy"),
    ("aten::empty_strided", "other"),
    ("aten::view", "other"),
    ("some_kernel_nobody_knows", "other"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "category"), REAL, ids=[n[:48] for n, _ in REAL])
def test_real_kernel_names_are_categorised(name: str, category: str) -> None:
    assert prof.categorise(name) == category
    assert category in prof.CATEGORIES


def test_union_counts_each_instant_once() -> None:
    assert prof.union_us([]) == 0.0
    assert prof.union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25.0
    assert prof.union_us([(20, 30), (0, 40)]) == 40.0


def test_self_time_subtracts_nested_operators_on_the_same_thread() -> None:
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 1, "dur": 6, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 2, "dur": 2, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 3, "dur": 5, "pid": 1, "tid": 2},
        {"ph": "X", "cat": "user_annotation", "name": "x", "ts": 0, "dur": 99, "pid": 1, "tid": 1},
    ]  # fmt: skip
    own = prof.self_times({"traceEvents": events})
    assert own == {"aten::linear": 4.0, "aten::addmm": 4.0 + 5.0, "aten::copy_": 2.0}


def _trace() -> dict:
    """Two steps of 100 µs each: forward (a GEMM and a norm), backward (attention launched from
    another thread, a copy beside it), the optimizer; the GPU idles 22 µs of each step."""
    events = []
    corr = 0

    def launch(t: float, name: str, start: float, dur: float, tid: int = 1) -> None:
        nonlocal corr
        corr += 1
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t,
                       "dur": 1, "pid": 1, "tid": tid, "args": {"correlation": corr}})  # fmt: skip
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur,
                       "pid": 0, "tid": 7, "args": {"correlation": corr}})  # fmt: skip

    for step in range(2):
        t0 = 100.0 * step
        for phase, a, b in (("forward", 0, 30), ("backward", 30, 80), ("optimizer", 80, 100)):
            events.append({"ph": "X", "cat": "user_annotation", "name": f"step/{phase}",
                           "ts": t0 + a, "dur": b - a, "pid": 1, "tid": 1})  # fmt: skip
        launch(t0 + 1, "nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_bias_TNN", t0 + 2, 20)
        launch(t0 + 2, "triton_per_fused_native_layer_norm_0", t0 + 22, 8)
        launch(t0 + 31, "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_x", t0 + 32, 40, tid=2)
        events.append(
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy DtoD (Device -> Device)",
                "ts": t0 + 60,
                "dur": 10,
                "pid": 0,
                "tid": 8,
            }
        )  # overlaps attention
        launch(t0 + 81, "multi_tensor_apply_kernel<FusedAdamMathFunctor>", t0 + 82, 10)
    return {"traceEvents": events}


def test_the_summary_splits_each_step_by_category_phase_and_idle() -> None:
    s = prof.summarise_gpu(_trace(), steps=2, step_ms=0.1)
    ms = {k: round(v * 1e3, 6) for k, v in s["ms"].items()}  # µs per step
    assert ms == {"matmul": 20, "attention": 40, "norm_act": 8, "optimizer": 10, "copy": 10,
                  "other": 0, "idle": 22}  # fmt: skip
    # busy: [2, 30), [32, 72) and [82, 92) of each step = 78 µs; the copy ran under attention
    assert s["busy_ms"] == pytest.approx(0.078)
    assert s["kernel_ms"] == pytest.approx(0.088)
    phase = {k: round(v * 1e3, 6) for k, v in s["phase_ms"].items()}
    assert phase == {"forward": 28, "backward": 40, "clip": 0, "optimizer": 10, "other": 10}
    assert s["launches_per_step"] == 5
    assert s["top"][0]["category"] == "attention" and s["top"][0]["ms"] == pytest.approx(0.040)
    shares = s["share"]
    assert shares["idle"] == pytest.approx(0.22)


def test_against_flops_gives_rates_mfu_and_the_bound() -> None:
    summary = {"step_ms": 100.0, "ms": {"matmul": 50.0, "attention": 10.0}}
    flops = {"total": 60e12, "attention": 4e12, "matmul": 56e12}
    out = prof.against_flops(summary, flops, peak=1000e12)
    assert out["step_tflops"] == pytest.approx(600)
    assert out["matmul_tflops"] == pytest.approx(56e12 / 0.05 / 1e12)
    assert out["attention_tflops"] == pytest.approx(400)
    assert out["mfu"] == pytest.approx(0.6)
    assert out["mfu_bound"] == pytest.approx(1.0)  # only matrix products and attention: 60 ms
    assert out["goal_step_ms"] == pytest.approx(150.0)  # 40 % of the peak
    assert prof.against_flops(summary, flops, peak=None)["mfu"] is None


def test_the_flop_split_adds_up_to_the_count() -> None:
    spec = prof.MODELS["vit-b16"][0]
    split = prof.flop_split(spec, 256)
    assert split["total"] == training_flops_per_sample(spec) * 256
    assert split["attention"] + split["matmul"] == split["total"]
    assert split["attention"] == 3 * 12 * 4 * 197 * 197 * 768 * 256


def test_profile_mode_runs_on_the_cpu(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv(PEAK_ENV, raising=False)
    monkeypatch.setattr(sys.modules["_common"], "OUT_DIR", tmp_path)
    prof.main(["--model", "vit-tiny", "--device", "cpu", "--batch", "4", "--configs", "fp32,bf16w",
               "--profile-steps", "2", "--steps", "1", "--repeats", "1", "--warmup", "1",
               "--trace"])  # fmt: skip
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result == json.loads((tmp_path / "mfu_profile.json").read_text())
    assert result["benchmark"] == "mfu_profile" and result["batch"] == 4
    assert any(line.startswith("| fp32 |") for line in out)
    for row in result["rows"]:
        assert row["error"] is None, row
        assert set(row["ms"]) == {*prof.CATEGORIES, "idle"}
        assert row["ms"]["matmul"] > 0 and row["ms"]["attention"] > 0
        assert sum(row["ms"].values()) >= row["step_ms"] * 0.999  # idle fills the rest
        assert row["flops"]["mfu"] is None  # no peak on the CPU
        trace = json.loads(gzip.open(row["trace"], "rt").read())
        assert any(e.get("name") == "step/backward" for e in trace["traceEvents"])
    assert (tmp_path / "mfu_profile.png").stat().st_size > 0
    torch._dynamo.reset()


def test_cli_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit, match="--profile-steps must be at least 1"):
        prof.main(["--profile-steps", "0"])
    with pytest.raises(SystemExit, match=r"unknown \['fp8'\]"):
        prof.main(["--configs", "fp8"])
