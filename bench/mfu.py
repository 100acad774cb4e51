"""MFU: model FLOPs utilisation of the unfrozen ViT-B/16 training step on one device, in fp32 and
bf16, eager and torch.compile'd, measured side by side.

The model is freeze_scaling's `vit-b16` (224x224x3 images, 16x16 patches -> 197 tokens, dim 768,
12 blocks, 12 heads, MLP ratio 4, 1000 classes), the default where CUDA is available; without a
GPU the default is `vit-tiny` on the CPU (a smoke run: no peak is known there, so no MFU). One
training step: the whole model as one `StageModule` (nothing frozen) forward and backward on a
synthetic batch that lives on the device, cross-entropy, gradient clipping and AdamW
(`trainer.optim.build_optimizer` with the default `TrainingSpec`). Configurations (`--configs`):

    fp32                 float32 throughout; TF32 off (`set_float32_matmul_precision("highest")`)
    bf16                 bf16 autocast (StageModule(precision="bf16")): matrix products and
                         attention in bf16; weights, gradients and optimizer state float32
    <p>+compile          the same with every block torch.compile'd in place (`block.compile()`;
                         the embedding, head, loss and optimizer stay eager)
    <p>+compile-stage    the whole StageModule compiled as one graph (optional rows)
    bf16+compile-cudagraphs  compiled blocks with mode="reduce-overhead" (CUDA graphs; issue 29)
    bf16+compile-autotune    compiled blocks with mode="max-autotune-no-cudagraphs"
    bf16w, bf16w+compile     bf16 weights (no autocast: activations and the residual stream in
                         bf16, norms with float32 statistics) trained through float32 master
                         copies in AdamW (`trainer.optim.MasterWeights`); clipping on the masters'
                         gradients. Not what a job runs (training.precision bf16 keeps float32
                         weights under autocast): issue 29's measurement of what it would buy

Each configuration trains its own copy of the model (seed 0). Warm-up steps first (they include
compilation: at least 2 when compiling), then repeats interleaved round-robin (the starting
configuration rotates), `--steps` steps per timed span, timed with CUDA events after a
synchronisation on CUDA (wall clock on the CPU); medians. A configuration that fails (torch.compile
without a working compiler, out of memory, a non-finite loss) records its error in its row and the
others go on.

Counted (core/flops.py, `training_flops_per_sample(spec)`): the model FLOPs of a training
sample, 3x the forward's matrix products and attention (the embedding's patch projection, the
blocks' q/k/v/output projections, MLP and attention scores, the head), as PaLM defines MFU: what
the model needs, not what the run executes; norms, softmax, GELU and the optimizer are left out
(under 2 %), so MFU slightly understates the work. Per configuration: samples/s, step ms,
achieved TFLOP/s (samples/s x FLOPs per sample), MFU = achieved / `peak_flops(device, precision)`
(bf16 rows against the device's dense bf16 peak, fp32 rows against its fp32 peak;
$PIPETRANSFORMER_PEAK_TFLOPS overrides both), and on CUDA the peak memory allocated (the model's
weights and optimizer state plus the most a step allocates on top of what is resident).

`--attention` chooses the attention kernel process-wide (`use_attention`: auto = PyTorch's
choice, cuDNN's on an H100 with torch 2.11; flash, efficient, cudnn or math alone). The step's
phases carry `record_function` names (`step/forward`, `step/backward`, `step/clip`,
`step/optimizer`) that bench/mfu_profile.py reads its per-phase kernel time from.

The issue's goal: MFU >= 40 % on an H100 in bf16 (the best bf16 row is reported as `goal`, not
asserted).

A Markdown table and a progress line per repeat go to stdout, a PNG bar chart to
bench/out/mfu.png, and the last line is one JSON object (also bench/out/mfu.json).

    .venv/bin/python bench/mfu.py [--model auto|vit-b16|vit-small|vit-tiny]
        [--device auto|cpu|cuda] [--batch N] [--configs fp32,fp32+compile,bf16,bf16+compile]
        [--steps 5] [--repeats 5] [--warmup 3] [--threads 1]
        [--attention auto|flash|efficient|cudnn|math]
"""

from __future__ import annotations

import argparse
import gc
import sys
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
from freeze_scaling import MODELS, _backend_name  # noqa: E402
from torch.profiler import record_function  # noqa: E402

from pipetransformer.core.flops import mfu, peak_flops, training_flops_per_sample  # noqa: E402
from pipetransformer.core.spec import ModelSpec, TrainingSpec  # noqa: E402
from pipetransformer.models.seeded import build_model  # noqa: E402
from pipetransformer.models.stage import StageModule, num_tokens
from pipetransformer.trainer.device import synchronize  # noqa: E402
from pipetransformer.trainer.optim import MasterWeights, build_optimizer  # noqa: E402


@dataclass(frozen=True)
class Variant:
    """How a configuration computes: `precision` (the peak it is measured against), what is
    compiled (None | "blocks" | "stage"), torch.compile's `mode` (None: the default;
    "reduce-overhead" adds CUDA graphs) and where the weights live ("fp32": float32 parameters
    under autocast, as training does; "bf16": bfloat16 parameters, no autocast, float32 master
    copies in the optimizer)."""

    precision: str
    compile: str | None = None
    mode: str | None = None
    weights: str = "fp32"


CONFIGS: dict[str, Variant] = {
    "fp32": Variant("fp32"),
    "fp32+compile": Variant("fp32", "blocks"),
    "bf16": Variant("bf16"),
    "bf16+compile": Variant("bf16", "blocks"),
    "fp32+compile-stage": Variant("fp32", "stage"),
    "bf16+compile-stage": Variant("bf16", "stage"),
    # issue 29's candidates: CUDA graphs for the compiled blocks; bf16 weights + master copies
    "bf16+compile-cudagraphs": Variant("bf16", "blocks", mode="reduce-overhead"),
    "bf16+compile-autotune": Variant("bf16", "blocks", mode="max-autotune-no-cudagraphs"),
    "bf16w": Variant("bf16", weights="bf16"),
    "bf16w+compile": Variant("bf16", "blocks", weights="bf16"),
}
DEFAULT_CONFIGS = ("fp32", "fp32+compile", "bf16", "bf16+compile")
DEFAULT_BATCH = {"vit-b16": 128, "vit-small": 64, "vit-tiny": 8}
GOAL_MFU = 0.40  # the goal, on an H100 in bf16
Backend = str | Callable


ATTENTION = ("auto", "flash", "efficient", "cudnn", "math")


def use_attention(choice: str) -> None:
    """Which kernel `scaled_dot_product_attention` may use on CUDA, process-wide: `auto` leaves
    PyTorch's choice (cuDNN's kernels for bf16 on an H100, torch 2.11), any other enables that
    one alone (a shape it cannot run is then an error, not a silent fallback). Set before anything compiles:
    a compiled graph keeps the kernel chosen when it was traced, and Inductor's on-disk caches
    (FX graphs, AOT autograd) do not key on this choice, so they are switched off for this
    process when one kernel is asked for (else a graph compiled earlier under another choice is
    served: seen on an H100, where `--attention efficient` ran the flash kernels of the run
    before)."""
    if choice not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)} (got {choice!r})")
    if choice != "auto":
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
    backends = torch.backends.cuda
    for name, enable in (
        ("flash", backends.enable_flash_sdp),
        ("efficient", backends.enable_mem_efficient_sdp),
        ("cudnn", backends.enable_cudnn_sdp),
        ("math", backends.enable_math_sdp),
    ):
        enable(choice in ("auto", name))


def _error(exc: BaseException) -> str:
    """An exception as one short line for the JSON (torch.compile's errors span many lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    lines = [line for line in lines if "TORCHDYNAMO_VERBOSE" not in line]  # dynamo's advice
    text = f"{type(exc).__name__}: {' / '.join(lines[:4])}"
    return text if len(text) <= 500 else text[:497] + "..."


@dataclass
class Config:
    """One configuration's model copy, optimizer and timings (or the error that stopped it)."""

    name: str
    variant: Variant
    spec: ModelSpec
    inputs: torch.Tensor
    labels: torch.Tensor
    backend: Backend = "inductor"
    times: list[float] = field(default_factory=list)
    step_peak_bytes: int = 0
    state_bytes: int = 0
    warmup_s: float | None = None
    error: str | None = None

    @property
    def precision(self) -> str:
        return self.variant.precision

    @property
    def compile(self) -> str | None:
        return self.variant.compile

    def __post_init__(self) -> None:
        self.device = self.inputs.device
        self.master: MasterWeights | None = None  # bf16 weights' float32 copies
        try:
            bf16_weights = self.variant.weights == "bf16"
            full = build_model(self.spec, seed=0)
            blocks = {i: full.blocks[str(i)] for i in range(self.spec.depth)}
            self.model: StageModule | None = StageModule(
                self.spec, 0, self.spec.depth, full.embed, blocks, full.head,
                # bf16 weights compute in bf16 without autocast (norms keep float32 statistics),
                # as a `training.precision: bf16-weights` job's stages do
                precision="bf16-weights" if bf16_weights else self.precision,
            ).to(self.device)  # fmt: skip
            self.params = [p for p in self.model.parameters() if p.requires_grad]
            self.training = TrainingSpec()
            self.optimizer: torch.optim.Optimizer | None
            if bf16_weights:  # the job's MasterWeights: AdamW and clipping on float32 masters
                self.master = MasterWeights(self.model, torch.bfloat16)
                self.params = list(self.master.module.parameters())
                self.optimizer = build_optimizer(self.master.module, self.training)
                self.inputs = self.inputs.to(torch.bfloat16)  # the batch arrives cast
            else:
                self.optimizer = build_optimizer(self.model, self.training)
            mode = {"mode": self.variant.mode} if self.variant.mode else {}
            if self.compile == "blocks":
                for block in self.model.blocks.values():
                    block.compile(backend=self.backend, **mode)
            elif self.compile == "stage":
                self.model.compile(backend=self.backend, **mode)
        except Exception as exc:  # noqa: BLE001 -- recorded in the row; the others go on
            self.fail(exc)

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, exc: BaseException) -> None:
        self.error = _error(exc)
        progress(f"{self.name}: failed, left out ({self.error})")
        self.model = self.optimizer = None
        self.params, self.master = [], None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def step(self) -> torch.Tensor:
        """One training step; its phases are named for the profiler (bench/mfu_profile.py)."""
        assert self.model is not None and self.optimizer is not None
        if self.variant.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's graph outputs are free
        with record_function("step/forward"):
            logits = self.model(self.inputs)
            loss = F.cross_entropy(logits, self.labels)
        with record_function("step/backward"):
            loss.backward()
        with record_function("step/clip"):
            if self.master is not None:  # the bf16 gradients into the float32 master copies
                self.master.load_grads()
            torch.nn.utils.clip_grad_norm_(self.params, self.training.grad_clip)
        with record_function("step/optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.master is not None:  # the masters, rounded, into the bf16 weights
                self.master.write_back()
        return loss.detach()

    def warm_up(self, steps: int) -> None:
        """The first steps: compilation, kernel selection, the optimizer's state. Checks the
        loss is finite and counts what stays resident (weights, optimizer state)."""
        if not self.ok:
            return
        t0 = time.perf_counter()
        try:
            loss = None
            for _ in range(steps):
                loss = self.step()
            synchronize(self.device)
            if loss is not None and not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {float(loss)} after warm-up")
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            return
        self.warmup_s = time.perf_counter() - t0
        assert self.model is not None and self.optimizer is not None
        state = [p for p in self.model.parameters()]
        if self.master is not None:
            state += self.master.resident()
        state += [
            t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
        ]
        self.state_bytes = sum(t.numel() * t.element_size() for t in state)

    def run(self, steps: int) -> None:
        """One timed span of `steps` steps (the median over spans is reported)."""
        if not self.ok:
            return
        try:
            if self.device.type == "cuda":
                synchronize(self.device)  # an empty queue: the span starts now
                resident = torch.cuda.memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(steps):
                    self.step()
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
                peak = torch.cuda.max_memory_allocated(self.device) - resident
                self.step_peak_bytes = max(self.step_peak_bytes, peak)
            else:
                t0 = time.perf_counter()
                for _ in range(steps):
                    self.step()
                seconds = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            return
        self.times.append(seconds / steps)

    @property
    def samples_per_s(self) -> float | None:
        return len(self.labels) / median(self.times) if self.ok and self.times else None


def measure(
    spec: ModelSpec,
    *,
    batch: int,
    configs: tuple[str, ...] | list[str] = DEFAULT_CONFIGS,
    steps: int = 5,
    repeats: int = 5,
    warmup: int = 3,
    device: torch.device | str = "cpu",
    compile_backend: Backend = "inductor",
    attention: str = "auto",
) -> dict:
    """Time the configurations side by side; the result as a dict. `compile_backend` is
    torch.compile's backend (tests use "eager", which needs no C++ compiler); `attention` the
    attention kernel (`use_attention`)."""
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ValueError(f"unknown configurations {unknown}: choose from {', '.join(CONFIGS)}")
    device = torch.device(device)
    use_attention(attention)
    # fp32 rows are true float32 (no TF32); bf16 autocast computes its products in bf16 anyway
    torch.set_float32_matmul_precision("highest")
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False
    if any(CONFIGS[c].compile for c in configs):
        warmup = max(warmup, 2)  # the first step compiles forward and backward
    gen = torch.Generator().manual_seed(0)
    shape = (batch, spec.channels, spec.image_size, spec.image_size)
    inputs = torch.randn(shape, generator=gen).to(device)
    labels = torch.randint(0, spec.num_classes, (batch,), generator=gen).to(device)
    items = []
    for name in configs:
        items.append(Config(name, CONFIGS[name], spec, inputs, labels, compile_backend))
    for item in items:
        if item.ok:
            progress(
                f"{item.name}: warm-up, {warmup} steps" + (" (compiling)" if item.compile else "")
            )
        item.warm_up(warmup)
        if item.ok:
            progress(f"{item.name}: warm-up took {item.warmup_s:.1f} s")
    for r in range(repeats):
        active = [item for item in items if item.ok]
        if not active:
            break
        for item in rotated(active, r):
            item.run(steps)
        progress(
            f"repeat {r + 1}/{repeats}: "
            + ", ".join(f"{item.name} {batch / item.times[-1]:.1f}/s" for item in items if item.ok)
        )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peaks = {p: peak_flops(name, p) for p in ("fp32", "bf16")}
    flops = training_flops_per_sample(spec)
    rows = []
    for item in items:
        sps = item.samples_per_s
        cuda = device.type == "cuda" and sps is not None
        rows.append(
            {
                "config": item.name,
                "precision": item.precision,
                "compile": item.compile,
                "compile_mode": item.variant.mode,
                "weights": item.variant.weights,
                "samples_per_s": sps,
                "step_ms": None if sps is None else 1e3 * batch / sps,
                "tflops": None if sps is None else sps * flops / 1e12,
                "mfu": mfu(sps, flops, 1, peaks[item.precision]),
                "peak_memory_mib": (
                    (item.state_bytes + item.step_peak_bytes) / 2**20 if cuda else None
                ),
                "warmup_s": item.warmup_s,
                "error": item.error,
            }
        )
    bf16 = [r for r in rows if r["precision"] == "bf16" and r["samples_per_s"] is not None]
    best = max(bf16, key=lambda r: r["samples_per_s"]) if bf16 else None
    goal = {
        "target_mfu": GOAL_MFU,
        "config": best["config"] if best else None,
        "mfu": best["mfu"] if best else None,
        "met": None if best is None or best["mfu"] is None else best["mfu"] >= GOAL_MFU,
    }
    return {
        "rows": rows,
        "flops_per_sample": flops,
        "peak_tflops": {p: v / 1e12 if v else None for p, v in peaks.items()},
        "goal": goal,
        "batch": batch,
        "warmup": warmup,
        "steps": steps,
        "repeats": repeats,
        "compile_backend": _backend_name(compile_backend),
        "attention": attention,
    }


def table(rows: list[dict], heading: str | None = None) -> str:
    """The result as a Markdown table, under `heading` when given."""
    lines = [f"### {heading}", ""] if heading else []
    lines += [
        "| config | precision | compiled | samples/s | step | TFLOP/s | MFU | peak memory "
        "| warm-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        compiled = r["compile"] or "-"
        if r["error"] is not None:
            lines.append(
                f"| {r['config']} | {r['precision']} | {compiled} | "
                f"failed: {r['error'].replace('|', '/')} "
                "| | | | | |"
            )
            continue
        util = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        mem = "-" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.0f} MiB"
        lines.append(
            f"| {r['config']} | {r['precision']} | {compiled} | {r['samples_per_s']:.1f} | "
            f"{r['step_ms']:.1f} ms | {r['tflops']:.3g} | {util} | {mem} | "
            f"{r['warmup_s']:.1f} s |"
        )
    return "\n".join(lines)


def goal_line(goal: dict) -> str:
    if goal["mfu"] is None:
        why = "no bf16 row" if goal["config"] is None else "no peak known for this device"
        return f"goal: bf16 MFU >= {goal['target_mfu']:.0%}: not measured ({why})"
    verdict = "met" if goal["met"] else "NOT met"
    return (
        f"goal: bf16 MFU >= {goal['target_mfu']:.0%}: {goal['config']} at {goal['mfu']:.1%}: "
        f"{verdict}"
    )


def _plot(result: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    with_mfu = any(r["mfu"] is not None for r in rows)
    key = "mfu" if with_mfu else "samples_per_s"
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colours = {"fp32": "tab:blue", "bf16": "tab:orange"}
    top = max([0.0] + [(100 if with_mfu else 1) * r[key] for r in rows if r["error"] is None])
    ax.set_ylim(0, 1.3 * max(top, 100 * GOAL_MFU if with_mfu else 0.0) or 1.0)  # room: legend
    for i, r in enumerate(rows):
        if r["error"] is not None:
            ax.bar([i], [0], 0.6, color="tab:gray")
            ax.annotate("failed", (i, 0), ha="center", va="bottom", fontsize=8)
            continue
        value = 100 * r[key] if with_mfu else r[key]
        ax.bar([i], [value], 0.6, color=colours[r["precision"]], alpha=0.8,
               hatch="//" if r["compile"] else None)  # fmt: skip
        label = f"{r['samples_per_s']:.0f}/s" if with_mfu else f"{r['step_ms']:.1f} ms"
        ax.annotate(label, (i, value), ha="center", va="bottom", fontsize=8)
    for precision, colour in colours.items():
        ax.bar([0], [0], 0, color=colour, alpha=0.8, label=precision)
    ax.bar([0], [0], 0, color="white", edgecolor="black", hatch="//", label="compiled")
    if with_mfu:
        ax.axhline(100 * GOAL_MFU, color="k", ls="--", lw=1, label=f"goal {GOAL_MFU:.0%} (bf16)")
        ax.set_ylabel("MFU (%)")
    else:
        ax.set_ylabel("training samples/s (no peak known: no MFU)")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["config"] for r in rows], fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def resolve_choices(
    args: argparse.Namespace, default_batch: dict[str, int] = DEFAULT_BATCH
) -> tuple:
    """The configurations, device, model and batch the command line asks for (shared with
    bench/mfu_profile.py, whose default batches differ): (configs, device, where, model name,
    ModelSpec, batch)."""
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    device, where = pick_device(args.device, args.threads)
    name = args.model
    if name == "auto":
        name = "vit-b16" if device.type == "cuda" else "vit-tiny"
    return configs, device, where, name, MODELS[name][0], args.batch or default_batch[name]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="auto", choices=["auto", *MODELS])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=None, help="samples per step (model default)")
    ap.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS),
        help=f"comma-separated, from: {', '.join(CONFIGS)}",
    )  # fmt: skip
    ap.add_argument("--steps", type=int, default=5, help="steps per timed span")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps (>= 2 when compiling)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    ap.add_argument(
        "--attention", default="auto", choices=ATTENTION,
        help="the attention kernel on CUDA (auto: PyTorch's choice)",
    )  # fmt: skip
    args = ap.parse_args()
    for flag in ("batch", "steps", "repeats", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be at least 1")
    if args.warmup < 0:
        raise SystemExit("--warmup must be at least 0")
    configs, device, where, name, spec, batch = resolve_choices(args)
    progress(
        f"{name}: {spec.depth} blocks, {num_tokens(spec)} tokens x dim {spec.dim}, batch {batch}, "
        f"on {where}; configurations {', '.join(configs)}"
    )
    result = measure(
        spec,
        batch=batch,
        configs=configs,
        steps=args.steps,
        repeats=args.repeats,
        warmup=args.warmup,
        device=device,
        attention=args.attention,
    )
    heading = f"{name} (depth {spec.depth}, dim {spec.dim}), batch {batch}, {where}"
    plot = out_dir() / "mfu.png"
    _plot(result, f"training-step MFU: {heading}", plot)
    print(table(result["rows"], f"MFU: {heading}"), flush=True)
    print(goal_line(result["goal"]), flush=True)
    flat = {r["config"]: r for r in result["rows"]}
    emit(
        {
            "benchmark": "mfu",
            "model": name,
            "device": where,
            "batch": batch,
            "samples_per_s": {k: r["samples_per_s"] for k, r in flat.items()},
            "mfu": {k: r["mfu"] for k, r in flat.items()},
            "errors": {k: r["error"] for k, r in flat.items() if r["error"] is not None},
            "flops_per_sample": result["flops_per_sample"],
            "peak_tflops": result["peak_tflops"],
            "goal": result["goal"],
            "warmup": result["warmup"],
            "steps": result["steps"],
            "repeats": result["repeats"],
            "compile_backend": result["compile_backend"],
            "attention": result["attention"],
            "rows": result["rows"],
            "plot": plot,
            "environment": environment(),
        },
        save_as="mfu.json",
    )


if __name__ == "__main__":
    main()
