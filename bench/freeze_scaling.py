"""Freeze scaling: training samples/s of one model replica with 0, 25, 50 and 75 % of its blocks
frozen, the frozen prefix recomputed forward-only or served from AutoCache, against the compute
bound 1 / (active fraction).

This is the elastic-freezing issue's GPU table: a ViT-B/16-sized model (224x224x3 images, 16x16
patches -> 197 tokens, dim 768, 12 blocks, 12 heads) on synthetic data, `--model vit-b16`, the
default where CUDA is available. Without a GPU the default is `vit-small` (32x32x3, 4x4 patches,
dim 192, 8 blocks) on the CPU with 1 thread, so the script and its checks run anywhere;
`vit-tiny` is a seconds-long smoke run.

One training step is what the rank that owns the first stage does when the whole model is one
stage on one device: the frozen prefix (embedding + blocks [0, F)) forward-only through
`FrozenPrefix` ("recompute"), or `ActivationCache.get_or_compute` with every row a hit in the
memory tier ("cache"; on a GPU that includes bringing the rows from where `--cache-memory` keeps
them: a host-to-device copy from host or pinned memory, a gather in device memory); then forward and
backward through blocks [F, L) and the head, gradient clipping, and an AdamW step over the active
parameters only (`build_optimizer`, so frozen weights are not in it). Each fraction trains its own
copy of the model (seed 0). All configurations are timed side by side: warm-up steps first, then
repeats interleaved round-robin (the starting configuration rotates), `--steps` steps per timed
span, CUDA synchronised around it; medians.

Reported per configuration: samples/s, `speedup` over 0 % frozen, and the bounds

    bound            1 / (active fraction) = L / (L - F): frozen blocks cost nothing, the best
                     the cache can do (the embedding and head are not counted as blocks)
    bound_recompute  1 / ((1 - f) + f * r): frozen blocks still run forward, where
                     r = forward_share, the measured time of a no-grad forward of the whole
                     model over that of a training step at 0 % frozen

with `of_bound` = speedup / bound (of bound_recompute for recompute rows). Both are compute
bounds, not hard limits: a step at 0 % frozen also pays for the embedding's backward, the first
block's input gradient and the optimizer over every weight, so a speedup can exceed them a little. On CUDA,
`step_memory_mib` is the peak memory a step allocates beyond what is resident (weights,
optimizer state), the memory that freezing frees for more replicas.

How it computes (the same for every configuration): `--precision` (`auto`: bf16 on CUDA, fp32
on the CPU) is the precision of the trained stage (`StageModule(precision=...)`) and of the frozen
prefix (`FrozenPrefix(precision=...)`): bf16 autocast, weights, gradients, optimizer state and the
cached rows float32; fp32 is true float32 (TF32 is switched off on CUDA). `--compile` compiles
every block in place (`block.compile()`, the embedding and head stay eager) in every
configuration alike; the warm-up (at least 2 steps then) covers compilation. `--cache-memory`
says where the cached rows live: `host` (pageable RAM), `pinned` (page-locked RAM, copied to the
GPU asynchronously) or `device` (GPU memory: a hit is a gather on the GPU); `auto`
(`trainer.cache.choose_memory`) is `device` on CUDA when the rows of all cached configurations
together fit in half of the free GPU memory, else `pinned`, and `host` on the CPU.

MFU per configuration (`mfu`, with `tflops` the achieved model FLOP/s): samples/s x
`core.flops.training_flops_per_sample(spec, F, cached)` over the device's dense peak at the
precision in use (`core.flops.peak_flops`; none on the CPU unless
$PIPETRANSFORMER_PEAK_TFLOPS is set): model FLOPs, so a frozen prefix counts its forward when
recomputed and nothing when cached.

The issue's goal: 75 % frozen with the cache at least 3.5x the 0 % rate (the bound is 4x);
whether it is met is printed and reported (`goal`), not asserted.

Checked, not just timed: before timing, the cache serves exactly what recomputation gives for
every training sample (bit for bit on the CPU, in either precision; on a GPU within rounding:
rtol 1e-4 / atol 1e-5 in fp32, 1e-2 / 1e-2 in bf16; the largest difference is reported), and
afterwards every lookup was a hit and the frozen weights and their fingerprints did not change.
A failed check exits non-zero.

The last line is one JSON object; a Markdown table goes to stdout before it, and a PNG to
bench/out/freeze_scaling.png.

    .venv/bin/python bench/freeze_scaling.py [--model auto|vit-b16|vit-small|vit-tiny]
        [--device auto|cpu|cuda] [--precision auto|fp32|bf16] [--compile]
        [--cache-memory auto|host|pinned|device] [--batch N] [--batches 4] [--steps 3]
        [--repeats 5] [--warmup 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import (  # noqa: E402
    emit,
    environment,
    median,
    out_dir,
    pick_device,
    progress,
    rotated,
)

from pipetransformer.core.flops import mfu, peak_flops, training_flops_per_sample  # noqa: E402
from pipetransformer.core.spec import ModelSpec, TrainingSpec  # noqa: E402
from pipetransformer.models.seeded import build_model  # noqa: E402
from pipetransformer.models.stage import StageModule, num_tokens
from pipetransformer.trainer.cache import ActivationCache, FrozenPrefix, choose_memory  # noqa: E402
from pipetransformer.trainer.device import synchronize  # noqa: E402
from pipetransformer.trainer.optim import build_optimizer  # noqa: E402

PERCENTS = (0, 25, 50, 75)
GOAL_SPEEDUP = 3.5  # the goal: 75 % frozen with the cache >= 3.5x the 0 % rate
GOAL_CONFIG = "75% cache"
PRECISIONS = ("fp32", "bf16")
CACHE_MEMORIES = ("host", "pinned", "device")
# the cache-equals-recompute check on a GPU (the CPU is checked bit for bit): (rtol, atol)
TOLERANCE = {"fp32": (1e-4, 1e-5), "bf16": (1e-2, 1e-2)}
MODELS: dict[str, tuple[ModelSpec, int]] = {  # name -> (model, default batch)
    "vit-b16": (
        ModelSpec(
            family="vit", image_size=224, patch_size=16, channels=3, dim=768, depth=12,
            heads=12, mlp_ratio=4.0, num_classes=1000,
        ),
        64,
    ),
    "vit-small": (
        ModelSpec(
            family="vit", image_size=32, patch_size=4, channels=3, dim=192, depth=8, heads=3,
            mlp_ratio=4.0, num_classes=10,
        ),
        32,
    ),
    "vit-tiny": (
        ModelSpec(
            family="vit", image_size=8, patch_size=2, channels=1, dim=16, depth=4, heads=2,
            mlp_ratio=2.0, num_classes=10,
        ),
        8,
    ),
}  # fmt: skip


class CheckFailed(RuntimeError):
    """A correctness check of the benchmark failed: the numbers would not mean anything."""


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` -> bf16 on CUDA, fp32 on the CPU."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be auto, fp32 or bf16 (got {precision!r})")
    return precision


def resolve_cache_memory(memory: str, device: torch.device, cache_bytes: int) -> str:
    """Where the cached rows live. `auto`: `trainer.cache.choose_memory` for the rows of every
    cached configuration together (`cache_bytes`): `host` on the CPU; on CUDA `device` when they
    fit in half of the free GPU memory (the rest is for training), else `pinned`. `pinned` and
    `device` need CUDA."""
    if memory == "auto":
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        return choose_memory(device, cache_bytes, free)
    if memory not in CACHE_MEMORIES:
        raise ValueError(f"cache memory must be auto, host, pinned or device (got {memory!r})")
    if memory != "host" and device.type != "cuda":
        raise ValueError(f"cache memory {memory!r} needs CUDA; use host on the CPU")
    return memory


def compile_blocks(model: StageModule, backend: str | Callable = "inductor") -> None:
    """torch.compile every block of `model` in place (parameter names do not change). Blocks
    share one class, so every copy reuses the graphs compiled for the first one."""
    for block in model.blocks.values():
        block.compile(backend=backend)


def boundary_for(depth: int, percent: int) -> int:
    """Frozen blocks for `percent` % of `depth` (rounded; 0 % -> 0, never all of them)."""
    return min(depth - 1, (depth * percent + 50) // 100)


@dataclass
class Data:
    """Synthetic training set on the device: `inputs[i]`, `labels[i]` is sample i."""

    inputs: torch.Tensor
    labels: torch.Tensor
    batch: int

    def __len__(self) -> int:
        return len(self.labels)

    def indices(self, k: int) -> torch.Tensor:
        """The k-th batch's sample indices (CPU), cycling through the set in order."""
        n = len(self)
        start = (k * self.batch) % n
        return torch.arange(start, start + self.batch) % n


def synthetic(spec: ModelSpec, batch: int, batches: int, device: torch.device) -> Data:
    gen = torch.Generator().manual_seed(0)
    n = batch * batches
    x = torch.randn((n, spec.channels, spec.image_size, spec.image_size), generator=gen)
    y = torch.randint(0, spec.num_classes, (n,), generator=gen)
    return Data(x.to(device), y.to(device), batch)


@dataclass
class Replica:
    """One fraction's model copy: the frozen prefix, the trained stage and its optimizer, and,
    for "cache", its ActivationCache."""

    name: str
    percent: int
    boundary: int
    mode: str  # "train" (nothing frozen) | "recompute" | "cache" | "forward" (no-grad pass)
    spec: ModelSpec
    data: Data
    device: torch.device
    training: TrainingSpec
    cache_dir: Path | None = None
    precision: str = "fp32"
    compile: bool = False
    compile_backend: str | Callable = "inductor"
    cache_memory: str = "host"
    step_no: int = 0
    times: list[float] = field(default_factory=list)
    peak_bytes: int = 0

    def __post_init__(self) -> None:
        full = build_model(self.spec, seed=0).to(self.device)
        full.precision = self.precision  # the no-grad pass ("forward") computes like the rest
        if self.compile:
            compile_blocks(full, self.compile_backend)
        f, L = self.boundary, self.spec.depth
        self.full = full
        frozen = ([full.embed] if f else []) + [full.blocks[str(i)] for i in range(f)]
        for module in frozen:
            module.requires_grad_(False)
        blocks = {i: full.blocks[str(i)] for i in range(f, L)}
        self.stage = StageModule(
            self.spec, f, L, full.embed, blocks, full.head, precision=self.precision
        )
        frozen_blocks = {i: full.blocks[str(i)] for i in range(f)}
        self.prefix = (
            FrozenPrefix(full.embed, frozen_blocks, precision=self.precision) if f else None
        )
        self.optimizer = build_optimizer(self.stage, self.training)
        self.params = [p for p in self.stage.parameters() if p.requires_grad]
        self.cache: ActivationCache | None = None
        if self.mode == "cache":
            assert self.prefix is not None and self.cache_dir is not None
            self.cache = ActivationCache.for_model(
                self.cache_dir / self.name.replace(" ", "-").replace("%", "pct"),
                self.spec,
                len(self.data),
                ram_bytes=1 << 62,  # steady state: every row in the memory tier (capped at the set)
                shared=False,
                memory=self.cache_memory,  # float32 rows (the prefix's output in either precision)
                device=self.device,
            )
            self.cache.set_boundary(f, self.prefix.fingerprints(f))

    def _hidden(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.data.inputs[idx.to(self.device)]
        if self.prefix is None:
            return x
        if self.cache is not None:
            return self.cache.get_or_compute(idx.numpy(), x, self.prefix, self.device)
        return self.prefix.compute(x, self.boundary)

    def step(self) -> None:
        idx = self.data.indices(self.step_no)
        self.step_no += 1
        if self.mode == "forward":
            self.full.eval()
            with torch.no_grad():
                self.full(self.data.inputs[idx.to(self.device)])
            return
        logits = self.stage(self._hidden(idx))
        loss = F.cross_entropy(logits, self.data.labels[idx.to(self.device)])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.training.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, steps: int, record: bool) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            resident = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        synchronize(self.device)
        if record:
            self.times.append((time.perf_counter() - t0) / steps)
            if cuda:
                peak = torch.cuda.max_memory_allocated(self.device) - resident
                self.peak_bytes = max(self.peak_bytes, peak)

    @property
    def samples_per_s(self) -> float:
        return self.data.batch / median(self.times)


def _frozen_state(rep: Replica) -> list[torch.Tensor]:
    if not rep.boundary:
        return []
    modules = [rep.full.embed] + [rep.full.blocks[str(i)] for i in range(rep.boundary)]
    return [p.detach().clone() for m in modules for p in m.parameters()]


def check_cache(rep: Replica) -> float:
    """Fill the cache from every sample, then compare each batch it serves with recomputation.
    Returns the largest absolute difference (0 on the CPU, where anything else fails)."""
    # On a GPU the tolerance is that of the precision: in fp32 a kernel that picks another
    # algorithm (another summation order) per call moves the result by float32 rounding only;
    # under bf16 autocast the same reordering rounds the blocks' matrix products to bf16
    # (8-bit mantissa: relative steps of 2**-8 ~ 4e-3), and the difference passes through up to
    # 9 residual blocks, so hidden states of magnitude ~1 may differ by a few 1e-3. 1e-2 still
    # fails a wrong row (off by O(1)) or a row of another sample.
    rtol, atol = TOLERANCE[rep.precision]
    assert rep.cache is not None and rep.prefix is not None
    batches = len(rep.data) // rep.data.batch
    for k in range(batches):  # the fill: every row computed once and stored
        idx = rep.data.indices(k)
        rep.cache.get_or_compute(idx.numpy(), rep.data.inputs[idx.to(rep.device)], rep.prefix)
    worst = 0.0
    for k in range(batches):
        idx = rep.data.indices(k)
        x = rep.data.inputs[idx.to(rep.device)]
        served = rep.cache.get_or_compute(idx.numpy(), x, rep.prefix, rep.device)
        fresh = rep.prefix.compute(x, rep.boundary)
        # exact on the CPU: the rows were computed from this very batch (same shapes, same
        # kernels); GPU kernels may pick another algorithm per call, hence the tolerance there
        if rep.device.type == "cpu" and not torch.equal(served, fresh):
            raise CheckFailed(f"{rep.name}: cached prefix output differs from recomputation")
        if served.dtype != fresh.dtype or not torch.allclose(served, fresh, rtol=rtol, atol=atol):
            raise CheckFailed(
                f"{rep.name}: cached prefix output not within {rep.precision} rounding (max abs "
                f"difference {float((served.float() - fresh.float()).abs().max()):.3g})"
            )
        worst = max(worst, float((served - fresh).abs().max()))
    if rep.cache.stats().misses != batches * rep.data.batch:
        raise CheckFailed(f"{rep.name}: the second pass over the data missed the cache")
    return worst


def measure(
    spec: ModelSpec,
    *,
    batch: int,
    batches: int = 4,
    steps: int = 3,
    repeats: int = 5,
    warmup: int = 2,
    device: torch.device | str = "cpu",
    scratch: Path | None = None,
    precision: str = "auto",
    compile: bool = False,
    compile_backend: str | Callable = "inductor",
    cache_memory: str = "auto",
) -> dict:
    """Time every configuration side by side and run the checks; the result as a dict.
    `compile_backend` is torch.compile's backend (tests use "eager": no C++ compiler)."""
    device = torch.device(device)
    if device.type == "cuda":
        # fp32 means fp32: no TF32 tensor cores for float32 matrix products (bf16 autocast
        # computes its products in bf16 either way)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    precision = resolve_precision(precision, device)
    if compile:
        warmup = max(warmup, 2)  # the first steps compile (training and no-grad graphs)
    data = synthetic(spec, batch, batches, device)
    training = TrainingSpec()
    L = spec.depth
    cached_configs = sum(1 for pct in PERCENTS if boundary_for(L, pct))
    cache_bytes = cached_configs * len(data) * num_tokens(spec) * spec.dim * 4
    cache_memory = resolve_cache_memory(cache_memory, device, cache_bytes)
    how = dict(
        precision=precision,
        compile=compile,
        compile_backend=compile_backend,
        cache_memory=cache_memory,
    )
    own_scratch = scratch is None
    scratch = Path(tempfile.mkdtemp(prefix="freeze-scaling-")) if scratch is None else scratch
    reps: list[Replica] = []
    try:
        for pct in PERCENTS:
            f = boundary_for(L, pct)
            modes = ["train", "forward"] if f == 0 else ["recompute", "cache"]
            for mode in modes:
                name = f"{pct}% {mode}"
                reps.append(
                    Replica(name, pct, f, mode, spec, data, device, training, scratch, **how)
                )
        checks: dict = {"cache_equals_recompute": True, "max_abs_diff": 0.0}
        for rep in reps:
            if rep.mode == "cache":
                progress(f"{rep.name}: filling the cache and comparing it with recomputation")
                checks["max_abs_diff"] = max(checks["max_abs_diff"], check_cache(rep))
        frozen_before = {rep.name: _frozen_state(rep) for rep in reps}
        fingerprints = {
            rep.name: rep.prefix.fingerprints(rep.boundary) for rep in reps if rep.prefix
        }
        progress(f"warm-up: {warmup} steps per configuration")
        for rep in reps:
            rep.run(warmup, record=False)
        misses_before = {rep.name: rep.cache.stats().misses for rep in reps if rep.cache}
        for r in range(repeats):
            for rep in rotated(reps, r):
                rep.run(steps, record=True)
            progress(
                f"repeat {r + 1}/{repeats}: "
                + ", ".join(f"{rep.name} {rep.data.batch / rep.times[-1]:.1f}/s" for rep in reps)
            )
        for rep in reps:
            after = _frozen_state(rep)
            before = frozen_before[rep.name]
            same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            if rep.prefix is not None:
                same = same and rep.prefix.fingerprints(rep.boundary) == fingerprints[rep.name]
            if not same:
                raise CheckFailed(f"{rep.name}: frozen weights changed while training")
            if rep.cache and rep.cache.stats().misses != misses_before[rep.name]:
                raise CheckFailed(f"{rep.name}: timed steps missed the cache")
        checks.update(frozen_unchanged=True, cache_all_hits=True)
    finally:
        for rep in reps:
            if rep.cache is not None:
                rep.cache.close()
        if own_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    by = {rep.name: rep for rep in reps}
    base = by["0% train"].samples_per_s
    share = by["0% train"].samples_per_s / by["0% forward"].samples_per_s  # t_fwd / t_step
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = peak_flops(device_name, precision)  # FLOP/s; None on the CPU (unless set by env)
    rows = []
    for rep in reps:
        if rep.mode == "forward":
            continue
        f = rep.boundary
        bound = L / (L - f)
        bound_rc = 1.0 / ((L - f) / L + f / L * share)
        speedup = rep.samples_per_s / base
        flops = training_flops_per_sample(spec, f, cached=rep.mode == "cache")
        rows.append(
            {
                "config": rep.name,
                "percent": rep.percent,
                "boundary": f,
                "mode": rep.mode,
                "samples_per_s": rep.samples_per_s,
                "speedup": speedup,
                "bound": bound,
                "bound_recompute": bound_rc,
                "of_bound": speedup / (bound_rc if rep.mode == "recompute" else bound),
                "step_memory_mib": rep.peak_bytes / 2**20 if device.type == "cuda" else None,
                "flops_per_sample": flops,
                "tflops": rep.samples_per_s * flops / 1e12,
                "mfu": mfu(rep.samples_per_s, flops, 1, peak),
            }
        )
    goal_speedup = next(r["speedup"] for r in rows if r["config"] == GOAL_CONFIG)
    goal = {
        "config": GOAL_CONFIG,
        "target_speedup": GOAL_SPEEDUP,
        "speedup": goal_speedup,
        "met": goal_speedup >= GOAL_SPEEDUP,
    }
    return {
        "rows": rows,
        "forward_share": share,
        "checks": checks,
        "goal": goal,
        "peak_tflops": peak / 1e12 if peak else None,
        "warmup": warmup,
        **how,
        "compile_backend": _backend_name(compile_backend),
    }


def _backend_name(backend: str | Callable) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", "custom")


def describe(result: dict) -> str:
    """How the configurations computed, for the table heading and the plot title."""
    compiled = f"compiled ({result['compile_backend']})" if result["compile"] else "eager"
    return f"{result['precision']}, {compiled}, cached rows in {result['cache_memory']} memory"


def goal_line(goal: dict) -> str:
    verdict = "met" if goal["met"] else "NOT met"
    return (
        f"goal: {goal['config']} at {goal['speedup']:.2f}x the 0 % rate "
        f"(target >= {goal['target_speedup']}x): {verdict}"
    )


def table(rows: list[dict], heading: str | None = None) -> str:
    """The result as a Markdown table (for notes and the README), under `heading` when given.
    `of bound` compares a recompute row with `bound_recompute`, the others with `bound`."""
    lines = [f"### {heading}", ""] if heading else []
    lines += [
        "| frozen | F | frozen prefix | samples/s | speedup | bound | bound_recompute "
        "| of bound | step memory | TFLOP/s | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        prefix = {"train": "-", "recompute": "recomputed", "cache": "cached"}[r["mode"]]
        mem = "-" if r["step_memory_mib"] is None else f"{r['step_memory_mib']:.0f} MiB"
        util = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['percent']} % | {r['boundary']} | {prefix} | {r['samples_per_s']:.1f} | "
            f"{r['speedup']:.2f} | {r['bound']:.2f} | {r['bound_recompute']:.2f} | "
            f"{r['of_bound']:.0%} | {mem} | {r['tflops']:.3g} | {util} |"
        )
    return "\n".join(lines)


def _plot(result: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    pcts = sorted({r["percent"] for r in rows})
    get = {(r["percent"], r["mode"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    width = 0.36
    for k, (mode, label, colour) in enumerate(
        (("recompute", "frozen prefix recomputed", "tab:red"),
         ("cache", "frozen prefix cached", "tab:green"))
    ):  # fmt: skip
        xs = [i + (k - 0.5) * width for i, p in enumerate(pcts) if (p, mode) in get]
        ys = [get[(p, mode)]["speedup"] for p in pcts if (p, mode) in get]
        ax.bar(xs, ys, width, label=label, color=colour, alpha=0.8)
    ax.bar([0], [1.0], width, color="tab:gray", alpha=0.8, label="nothing frozen")
    ax.plot(range(len(pcts)), [get[(p, "train" if p == 0 else "cache")]["bound"] for p in pcts],
            "k--o", label="bound 1/(active fraction)")  # fmt: skip
    rc = [(i, get[(p, "recompute")]["bound_recompute"]) for i, p in enumerate(pcts) if p]
    ax.plot([i for i, _ in rc], [b for _, b in rc], ":s", color="tab:red",
            label="bound with forward-only frozen blocks")  # fmt: skip
    goal = result.get("goal")
    if goal and 75 in pcts:
        ax.plot([pcts.index(75) + 0.5 * width], [goal["target_speedup"]], "*", color="tab:green",
                markeredgecolor="k", markersize=12,
                label=f"goal {goal['target_speedup']}x (75 % cached)")  # fmt: skip
    ax.set_xticks(range(len(pcts)))
    ax.set_xticklabels([f"{p} % frozen" for p in pcts])
    ax.set_ylabel("training samples/s over nothing frozen")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="auto", choices=["auto", *MODELS])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=None, help="samples per step (model default)")
    ap.add_argument("--batches", type=int, default=4, help="synthetic set size in batches")
    ap.add_argument("--steps", type=int, default=3, help="steps per timed span")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    ap.add_argument(
        "--precision", default="auto", choices=["auto", *PRECISIONS],
        help="trained stage and frozen prefix: bf16 autocast or float32 (auto: bf16 on CUDA)",
    )  # fmt: skip
    ap.add_argument(
        "--compile", action="store_true",
        help="torch.compile every block in place (at least 2 warm-up steps then)",
    )  # fmt: skip
    ap.add_argument(
        "--cache-memory", default="auto", choices=["auto", *CACHE_MEMORIES],
        help="where cached rows live (auto: device memory on CUDA if they fit, host on the CPU)",
    )  # fmt: skip
    args = ap.parse_args()
    for flag in ("batch", "batches", "steps", "repeats", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be at least 1")
    if args.warmup < 0:
        raise SystemExit("--warmup must be at least 0")
    device, where = pick_device(args.device, args.threads)
    if device.type == "cpu" and args.cache_memory in ("pinned", "device"):
        raise SystemExit(f"--cache-memory {args.cache_memory} needs CUDA; use host on the CPU")
    name = args.model
    if name == "auto":
        name = "vit-b16" if device.type == "cuda" else "vit-small"
    spec, default_batch = MODELS[name]
    batch = args.batch or default_batch
    precision = resolve_precision(args.precision, device)
    progress(
        f"{name}: {spec.depth} blocks, {num_tokens(spec)} tokens x dim {spec.dim}, batch {batch}, "
        f"on {where}, {precision}{', compiled' if args.compile else ''}; "
        f"frozen {', '.join(f'{p} %' for p in PERCENTS)}"
    )
    try:
        result = measure(
            spec,
            batch=batch,
            batches=args.batches,
            steps=args.steps,
            repeats=args.repeats,
            warmup=args.warmup,
            device=device,
            precision=precision,
            compile=args.compile,
            cache_memory=args.cache_memory,
        )
    except CheckFailed as exc:
        raise SystemExit(f"check failed: {exc}") from exc
    heading = f"{name} (depth {spec.depth}, dim {spec.dim}), batch {batch}, {where}"
    title = f"{heading}\n{describe(result)}"
    plot = out_dir() / "freeze_scaling.png"
    _plot(result, title, plot)
    print(table(result["rows"], f"freeze scaling: {heading}; {describe(result)}"), flush=True)
    print(goal_line(result["goal"]), flush=True)
    flat = {r["config"]: r for r in result["rows"]}
    emit(
        {
            "benchmark": "freeze_scaling",
            "model": name,
            "device": where,
            "batch": batch,
            "precision": result["precision"],
            "compile": result["compile"],
            "cache_memory": result["cache_memory"],
            "warmup": result["warmup"],
            "samples_per_s": {k: r["samples_per_s"] for k, r in flat.items()},
            "speedup": {k: r["speedup"] for k, r in flat.items()},
            "of_bound": {k: r["of_bound"] for k, r in flat.items()},
            "mfu": {k: r["mfu"] for k, r in flat.items()},
            "peak_tflops": result["peak_tflops"],
            "goal": result["goal"],
            "forward_share": result["forward_share"],
            "checks": result["checks"],
            "rows": result["rows"],
            "plot": plot,
            "environment": environment(),
        },
        save_as="freeze_scaling.json",
    )


if __name__ == "__main__":
    main()
