"""Model FLOPs and model FLOPs utilisation (MFU), as PaLM defines it: the FLOPs the model's
training step needs (not what a run happens to execute: recomputation and padding are not
counted), per second, over the devices' dense peak. Pure: no I/O beyond reading one variable.

Each model family counts its units (`core.families`); the default, per sample (T tokens, width
d, MLP hidden h = mlp_ratio x d, a multiply-add = 2 FLOPs):

    block forward   2 T (3 d^2 + d^2 + 2 d h)    q/k/v, output projection, the two MLP matrices
                  + 4 T^2 d                      attention scores (Q K^T) and their use (A V)
    embed forward   2 P (C p^2) d                ViT patch projection over P patches (BERT: a
                                                 lookup, 0)
    head forward    2 d K                        K classes, on the CLS token

A trainable unit costs 3x its forward (forward, then the gradients of its input and of its
weights); a frozen unit costs its forward when the frozen prefix is recomputed, or runs in its
stage (`freeze.relayout: off`: no backward crosses it), and nothing when AutoCache serves its
output. Norms, softmax, GELU and the optimizer are left out (under 2 % for
ViT-B/16), as everyone does, so MFU slightly understates the work done.
"""

from __future__ import annotations

import os

from pipetransformer.core.spec import ModelSpec

PEAK_ENV = "PIPETRANSFORMER_PEAK_TFLOPS"

# Dense (no sparsity) peak TFLOP/s per device from the vendors' data sheets, by a substring of
# torch.cuda.get_device_name(); "fp32" is plain float32 (CUDA cores: PyTorch does not use TF32
# for float32 matrix products unless asked). The first match wins, so longer names come first.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bf16": 989.4, "fp32": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp32": 66.9}),  # SXM
    ("H800", {"bf16": 989.4, "fp32": 66.9}),
    ("GH200", {"bf16": 989.4, "fp32": 66.9}),
    ("B200", {"bf16": 2250.0, "fp32": 80.0}),
    ("A100", {"bf16": 312.0, "fp32": 19.5}),
    ("A800", {"bf16": 312.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp32": 30.3}),
    ("A10G", {"bf16": 70.0, "fp32": 31.2}),
    ("A10", {"bf16": 125.0, "fp32": 31.2}),
    ("V100", {"bf16": 0.0, "fp32": 15.7}),  # no bf16 tensor cores
)


def block_forward_flops(spec: ModelSpec) -> float:
    """Forward FLOPs of one transformer block for one sample (the family's count)."""
    return spec.family_info.block_flops(spec)


def embed_forward_flops(spec: ModelSpec) -> float:
    """Forward FLOPs of the embedding for one sample (a table lookup for text: 0)."""
    return spec.family_info.embed_flops(spec)


def head_forward_flops(spec: ModelSpec) -> float:
    """Forward FLOPs of the head for one sample (a classifier reads the CLS token only; a
    question-answering head reads every token: `core.tasks`)."""
    return spec.family_info.head_flops(spec)


def training_flops_per_sample(spec: ModelSpec, boundary: int = 0, cached: bool = False) -> float:
    """Model FLOPs of one training sample with blocks [0, boundary) (and the embedding below them)
    frozen: 3x forward for what trains, 1x for the frozen blocks when recomputed (as a prefix
    outside the pipeline or in place in their stages), 0 when they come from the activation
    cache (`cached`)."""
    if not 0 <= boundary <= spec.depth:
        raise ValueError(f"boundary {boundary} outside a model of {spec.depth} blocks")
    block, embed, head = (
        block_forward_flops(spec),
        embed_forward_flops(spec),
        head_forward_flops(spec),
    )
    trainable = 3 * ((spec.depth - boundary) * block + head + (embed if boundary == 0 else 0))
    frozen = 0.0 if cached or boundary == 0 else boundary * block + embed
    return trainable + frozen


def peak_flops(device_name: str | None, precision: str) -> float | None:
    """The dense peak FLOP/s of one device at `precision` ("fp32", or "bf16" and
    "bf16-weights", whose matrix products both run in bfloat16): from
    $PIPETRANSFORMER_PEAK_TFLOPS when set (one number, the device's peak at the precision in
    use), else from `PEAK_TFLOPS` for a known GPU; None for the CPU or an unknown device."""
    override = os.environ.get(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            raise ValueError(
                f"{PEAK_ENV}={override!r}: give the device's dense peak in TFLOP/s, e.g. 989"
            ) from None
        if not value > 0:
            raise ValueError(f"{PEAK_ENV}={override!r}: the peak must be a positive number")
        return value * 1e12
    if not device_name:
        return None
    for key, peaks in PEAK_TFLOPS:
        if key in device_name:
            tflops = peaks.get("fp32" if precision == "fp32" else "bf16")
            return tflops * 1e12 if tflops else None
    return None


def mfu(
    samples_per_s: float | None, flops_per_sample: float, devices: int, peak: float | None
) -> float | None:
    """Model FLOPs utilisation of `devices` devices of peak `peak` FLOP/s each (None without a
    peak or a rate)."""
    if not peak or not samples_per_s or devices < 1:
        return None
    return samples_per_s * flops_per_sample / (devices * peak)
