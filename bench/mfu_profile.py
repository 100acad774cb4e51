"""Where the MFU benchmark's training step spends its time: a torch.profiler capture of a few
steps of bench/mfu.py's configurations, GPU kernel time by category per step, against the FLOP
count of core/flops.py.

Each configuration (`--configs`, the names of bench/mfu.py) builds, warms up and is timed as
bench/mfu.py does it (`--repeats` spans of `--steps` steps, CUDA events, the median: the step
time that MFU is computed from, with no profiler attached), then `--profile-steps` more steps run
under torch.profiler (CPU and CUDA activities). From the profiler's trace (pure functions below,
tested on the CPU):

    categories  every kernel, copy and memset on the GPU, by name (`categorise`):
                matmul     matrix products (cuBLAS/cuBLASLt, CUTLASS, Triton mm templates)
                attention  scaled-dot-product attention (flash, memory-efficient, cuDNN)
                norm_act   norms, activations and the other elementwise kernels and reductions
                           (eager ATen kernels and Inductor's fused Triton kernels)
                optimizer  AdamW and gradient clipping (fused/for-each multi-tensor kernels)
                copy       copies, casts, concatenations, memcpy and memset
                other      anything else
                idle       the step time minus the time some GPU work ran (the union of the
                           intervals above): launch gaps, host-side waits, synchronisation
    phases      the same GPU time by the step's phase (`step/forward`, `step/backward`,
                `step/clip`, `step/optimizer`, named by bench/mfu.py with record_function),
                attributed through each kernel's launch
    top         the kernels that took longest, with their category

and against the count (core/flops.py): the model FLOPs of a step split into matrix products
and attention (3 x 4 T^2 d per block per sample), the TFLOP/s each achieves inside its own
kernels, and `mfu_bound`: the MFU the step would reach if only its matrix products and attention
ran (every other category and idle at zero), the ceiling that the remainder is measured from.

On the CPU (a smoke run, vit-tiny by default) there are no GPU kernels: the same categories are
the self time of the CPU operators (`aten::addmm` -> matmul, ...), and no MFU.

Writes bench/out/mfu_profile.json (also the last line of stdout), bench/out/mfu_profile.png (a
stacked bar per configuration: ms per step by category, and the step time that 40 % MFU needs),
and with `--trace` the profiler's Chrome trace of each configuration as
bench/out/mfu_profile.<config>.json.gz (open in https://ui.perfetto.dev).

    .venv/bin/python bench/mfu_profile.py [--model auto|vit-b16|vit-small|vit-tiny]
        [--device auto|cpu|cuda] [--batch N] [--configs bf16,bf16+compile] [--profile-steps 3]
        [--steps 5] [--repeats 3] [--warmup 3] [--attention auto|flash|efficient|cudnn|math]
        [--trace] [--threads 1]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import emit, environment, median, out_dir, progress  # noqa: E402
from mfu import ATTENTION, CONFIGS, GOAL_MFU, MODELS, Config, resolve_choices, use_attention  # noqa: E402

from pipetransformer.core.flops import peak_flops, training_flops_per_sample  # noqa: E402
from pipetransformer.models.stage import num_tokens  # noqa: E402
from pipetransformer.trainer.device import synchronize  # noqa: E402

CATEGORIES = ("matmul", "attention", "norm_act", "optimizer", "copy", "other")
PHASES = ("forward", "backward", "clip", "optimizer")
DEFAULT_CONFIGS = ("bf16", "bf16+compile")
DEFAULT_BATCH = {"vit-b16": 256, "vit-small": 64, "vit-tiny": 8}
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")

# (category, pattern) tried in order on the lower-cased name; the first match wins
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile(pattern))
    for cat, pattern in (
        # gradient clipping's norms and scaling and AdamW: multi-tensor (for-each, fused) kernels
        ("optimizer", r"adam|multi_tensor_apply|_foreach_|lpnorm|optimizer"),
        # before matmul: memory-efficient attention's kernels are CUTLASS kernels
        # (cuDNN's backward also runs cudnn::fusion::compute_dot_do_o and convert_dq_to_16bits)
        ("attention", r"flash|fmha|attention|sdpa|attn|cudnn::fusion|dot_do_o|convert_dq"),
        ("matmul", r"gemm|xmma|nvjet|cutlass|cublas|gemv|splitk|aten::(mm|addmm|bmm|baddbmm)\b"),
        ("copy", r"memcpy|memset|copy|catarray|aten::(cat|clone|contiguous|fill_|zero_)\b"),
        ("copy", r"transpose|permute|fill_kernel|fillfunctor"),
        (
            "norm_act",
            r"norm|gammabeta|gelu|relu|silu|softmax|dropout|elementwise|reduce|cross_entropy|"
            r"nll_loss|aten::(add|mul|sub|div|sum|mean|neg|exp|pow|sqrt|rsqrt|where|clamp|tanh|"
            r"erf|abs|max|min|sign)_?\b",
        ),
    )
)
# Inductor's kernels: triton_{poi,per,red}_fused_<ops>_<n> (pointwise, persistent reduction,
# reduction) and triton_tem_fused_* (templates: its own matrix products)
_TRITON_COPY_OPS = {"to", "copy", "clone", "cat", "view", "permute", "transpose", "t", "unsafe",
                    "expand", "slice", "select", "stack", "_unsafe_view", "fused", "poi", "constant",
                    "pad", "squeeze", "unsqueeze", "split", "reshape", "as", "strided", "zeros",
                    "like", "new", "empty", "full", "fill"}  # fmt: skip


def categorise(name: str) -> str:
    """The category (one of CATEGORIES) of a GPU kernel or CPU operator, from its name.

    GPU: cuBLAS/cuBLASLt (`sm90_xmma_gemm_*`, `nvjet_*`, `cutlass*`) -> matmul; flash,
    memory-efficient and cuDNN attention -> attention; fused AdamW and the multi-tensor kernels
    of clipping -> optimizer; `Memcpy`/`Memset`, copy and cast kernels -> copy; Inductor's Triton
    kernels -> matmul for templates (`triton_tem_*`), copy when they only move or cast data,
    else norm_act; ATen's elementwise and reduction kernels -> norm_act. CPU: the same rules on
    ATen operator names (`aten::addmm` -> matmul, `aten::native_layer_norm` -> norm_act)."""
    low = name.lower()
    triton = re.search(r"triton_(poi|per|red|tem)_", low)
    if triton:
        if triton.group(1) == "tem":
            return "matmul"
        ops = re.sub(r"^.*?triton_(poi|per|red)_", "", low)
        tokens = {t for t in re.split(r"[_\W]+", ops) if t and not t.isdigit()}
        return "copy" if tokens <= _TRITON_COPY_OPS else "norm_act"
    for category, pattern in _RULES:
        if pattern.search(low):
            return category
    return "other"


@dataclass(frozen=True)
class GpuEvent:
    """One piece of GPU work from the trace: a kernel, a copy or a memset."""

    name: str
    ts: float  # start, microseconds
    dur: float  # microseconds
    correlation: int | None = None

    @property
    def end(self) -> float:
        return self.ts + self.dur


def gpu_events(trace: dict | list) -> list[GpuEvent]:
    """The GPU work in a Chrome trace (torch.profiler's `export_chrome_trace`), in start order."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = [
        GpuEvent(
            e["name"], float(e["ts"]), float(e.get("dur", 0.0)), (e.get("args") or {}).get(
                "correlation"
            ),
        )
        for e in events
        if e.get("ph") == "X" and e.get("cat", "").lower() in GPU_CATS
    ]  # fmt: skip
    return sorted(out, key=lambda e: e.ts)


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals: the time some GPU work ran (kernels on
    several streams may overlap; each instant counts once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def self_times(trace: dict | list, cat: str = "cpu_op") -> dict[str, float]:
    """Self time (µs) per name of the `cat` events of a trace: each event's duration less that of
    the events nested directly inside it on the same thread (CPU operators nest: `aten::linear`
    calls `aten::addmm`)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == cat:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[str, float] = defaultdict(float)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[list] = []  # [end, name, self time]
        for e in evs:
            ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
            while stack and stack[-1][0] <= ts:
                end, name, own = stack.pop()
                out[name] += own
            if stack:
                stack[-1][2] -= dur
            stack.append([ts + dur, e["name"], dur])
        for _, name, own in stack:
            out[name] += own
    return dict(out)


def launch_phases(trace: dict | list, prefix: str = "step/") -> dict[int, str]:
    """Correlation id -> phase, for every kernel launch (a `cuda_runtime`/`cuda_driver` event)
    that falls inside a `record_function` range named `<prefix><phase>` (on any thread: the
    backward pass launches from autograd's own thread while the main thread waits inside
    `step/backward`)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ranges = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"][len(prefix) :])
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and str(e.get("name", "")).startswith(prefix)
    )
    starts = [r[0] for r in ranges]
    out: dict[int, str] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        corr = (e.get("args") or {}).get("correlation")
        if corr is None:
            continue
        ts = float(e["ts"])
        i = bisect_right(starts, ts) - 1
        if i >= 0 and ranges[i][0] <= ts < ranges[i][1]:
            out[corr] = ranges[i][2]
    return out


def summarise_gpu(trace: dict | list, *, steps: int, step_ms: float | None, top: int = 12) -> dict:
    """Per-step GPU time (ms) by category and by phase, the busy time (union), idle = `step_ms`
    (the unprofiled step) less busy, and the `top` kernels by time. `steps`: how many steps the
    trace holds."""
    events = gpu_events(trace)
    phases = launch_phases(trace)
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    by_phase: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e in events:
        by_cat[categorise(e.name)] += e.dur
        by_phase[phases.get(e.correlation, "other") if e.correlation is not None else "other"] += (
            e.dur
        )
        by_name[e.name] += e.dur
        counts[e.name] += 1
    busy = union_us((e.ts, e.end) for e in events) / 1e3 / steps
    window = (max(e.end for e in events) - events[0].ts) / 1e3 / steps if events else 0.0
    ms = {k: v / 1e3 / steps for k, v in by_cat.items()}
    wall = step_ms if step_ms is not None else window
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {
        "step_ms": wall,
        "profiled_step_ms": window,
        "busy_ms": busy,
        "kernel_ms": sum(ms.values()),
        "ms": ms | {"idle": max(0.0, wall - busy)},
        "share": {k: v / wall for k, v in (ms | {"idle": max(0.0, wall - busy)}).items()}
        if wall
        else {},
        "phase_ms": {p: by_phase.get(p, 0.0) / 1e3 / steps for p in (*PHASES, "other")},
        "launches_per_step": len(events) / steps,
        "top": [
            {
                "name": name[:160],
                "category": categorise(name),
                "ms": v / 1e3 / steps,
                "calls": counts[name] / steps,
            }
            for name, v in ranked
        ],
    }


def summarise_cpu(trace: dict | list, *, steps: int, step_ms: float | None, top: int = 12) -> dict:
    """The CPU smoke run's counterpart of `summarise_gpu`: operators' self time by category."""
    own = self_times(trace)
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    for name, us in own.items():
        if name.startswith("aten::"):
            by_cat[categorise(name)] += us
    ms = {k: v / 1e3 / steps for k, v in by_cat.items()}
    busy = sum(ms.values())
    wall = step_ms if step_ms is not None else busy
    ranked = sorted(
        ((n, v) for n, v in own.items() if n.startswith("aten::")), key=lambda kv: -kv[1]
    )
    return {
        "step_ms": wall,
        "busy_ms": busy,
        "kernel_ms": busy,
        "ms": ms | {"idle": max(0.0, wall - busy)},
        "share": {k: v / wall for k, v in (ms | {"idle": max(0.0, wall - busy)}).items()}
        if wall
        else {},
        "top": [
            {"name": n, "category": categorise(n), "ms": v / 1e3 / steps} for n, v in ranked[:top]
        ],
    }


def flop_split(spec, batch: int) -> dict[str, float]:
    """The model FLOPs of one training step (core/flops.py), split into attention (scores and
    their use, 3 x 4 T^2 d per block per sample) and matrix products (the rest)."""
    total = training_flops_per_sample(spec) * batch
    t = num_tokens(spec)
    attention = 3 * spec.depth * 4 * t * t * spec.dim * batch
    return {"total": total, "attention": float(attention), "matmul": total - attention}


def against_flops(summary: dict, flops: dict[str, float], peak: float | None) -> dict:
    """What the step's kernels achieve against the count: TFLOP/s inside the matrix-product and
    attention kernels, the step's MFU, and `mfu_bound` (only those kernels ran)."""
    ms = summary["ms"]

    def rate(f: float, t: float) -> float | None:
        return f / (t / 1e3) / 1e12 if t > 0 else None

    core = ms["matmul"] + ms["attention"]
    out = {
        "step_tflops": rate(flops["total"], summary["step_ms"]),
        "matmul_tflops": rate(flops["matmul"], ms["matmul"]),
        "attention_tflops": rate(flops["attention"], ms["attention"]),
        "mfu": None,
        "mfu_bound": None,
        "goal_step_ms": None,
    }
    if peak:
        out["mfu"] = flops["total"] / (summary["step_ms"] / 1e3) / peak
        out["mfu_bound"] = flops["total"] / (core / 1e3) / peak if core > 0 else None
        out["goal_step_ms"] = 1e3 * flops["total"] / (GOAL_MFU * peak)
    return out


def profile(config: Config, steps: int, trace_path: Path | None) -> dict:
    """`steps` steps of a warmed-up configuration under torch.profiler; the trace as a dict (and
    gzipped at `trace_path` when given)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if config.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(config.device)
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            config.step()
        synchronize(config.device)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        text = raw.read_text()
    if trace_path is not None:
        with gzip.open(trace_path, "wt") as f:
            f.write(text)
    return json.loads(text)


def run(
    spec,
    *,
    batch: int,
    configs: list[str] | tuple[str, ...] = DEFAULT_CONFIGS,
    profile_steps: int = 3,
    steps: int = 5,
    repeats: int = 3,
    warmup: int = 3,
    device: torch.device | str = "cpu",
    attention: str = "auto",
    compile_backend="inductor",
    trace_dir: Path | None = None,
) -> dict:
    """Time, then profile, each configuration in turn; the result as a dict."""
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ValueError(f"unknown configurations {unknown}: choose from {', '.join(CONFIGS)}")
    device = torch.device(device)
    use_attention(attention)
    torch.set_float32_matmul_precision("highest")
    gen = torch.Generator().manual_seed(0)
    shape = (batch, spec.channels, spec.image_size, spec.image_size)
    inputs = torch.randn(shape, generator=gen).to(device)
    labels = torch.randint(0, spec.num_classes, (batch,), generator=gen).to(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    flops = flop_split(spec, batch)
    results = []
    for cname in configs:
        variant = CONFIGS[cname]
        item = Config(cname, variant, spec, inputs, labels, compile_backend)
        progress(f"{cname}: warm-up")
        item.warm_up(max(warmup, 2) if variant.compile else warmup)
        for _ in range(repeats):
            item.run(steps)
        row: dict = {"config": cname, "precision": variant.precision, "error": item.error}
        if item.ok:
            step_ms = 1e3 * median(item.times)
            progress(f"{cname}: {step_ms:.2f} ms per step unprofiled; profiling {profile_steps}")
            safe = re.sub(r"[^A-Za-z0-9._-]", "_", cname)
            path = trace_dir / f"mfu_profile.{safe}.json.gz" if trace_dir else None
            try:
                trace = profile(item, profile_steps, path)
            except Exception as exc:  # noqa: BLE001 -- recorded; the others go on
                row["error"] = f"profiler: {type(exc).__name__}: {exc}"[:500]
            else:
                summarise = summarise_gpu if device.type == "cuda" else summarise_cpu
                summary = summarise(trace, steps=profile_steps, step_ms=step_ms)
                peak = peak_flops(name, variant.precision)
                row |= summary | {"flops": against_flops(summary, flops, peak)}
                if path is not None:
                    row["trace"] = path
        results.append(row)
        del item
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "rows": results,
        "flops_per_step": flops,
        "flops_per_sample": training_flops_per_sample(spec),
        "peak_tflops": {p: (v / 1e12 if v else None) for p in ("bf16", "fp32")
                        for v in [peak_flops(name, p)]},
        "batch": batch,
        "profile_steps": profile_steps,
        "attention": attention,
    }  # fmt: skip


def table(result: dict) -> str:
    """ms per step by category (and share of the step) per configuration, as Markdown."""
    cols = (*CATEGORIES, "idle")
    lines = [
        "| config | step | " + " | ".join(cols) + " | matmul TFLOP/s | attention TFLOP/s | MFU "
        "| MFU bound |",
        "|---" * (len(cols) + 7) + "|",
    ]
    for r in result["rows"]:
        if r.get("error") or "ms" not in r:
            lines.append(f"| {r['config']} | failed: {r.get('error')} |")
            continue
        f = r["flops"]

        def num(v, fmt="{:.0f}"):
            return "-" if v is None else fmt.format(v)

        cells = [f"{r['ms'][c]:.2f} ({r['share'][c]:.0%})" for c in cols]
        lines.append(
            f"| {r['config']} | {r['step_ms']:.2f} ms | " + " | ".join(cells) + f" | "
            f"{num(f['matmul_tflops'])} | {num(f['attention_tflops'])} | "
            f"{num(f['mfu'], '{:.1%}')} | {num(f['mfu_bound'], '{:.1%}')} |"
        )
    return "\n".join(lines)


def _plot(result: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "ms" in r]
    fig, ax = plt.subplots(figsize=(8, 1.8 + 0.6 * max(1, len(rows))))
    colours = {
        "matmul": "tab:blue", "attention": "tab:purple", "norm_act": "tab:orange",
        "optimizer": "tab:green", "copy": "tab:brown", "other": "tab:gray", "idle": "white",
    }  # fmt: skip
    for i, r in enumerate(rows):
        left = 0.0
        for c, colour in colours.items():
            v = r["ms"][c]
            ax.barh([i], [v], left=left, color=colour, edgecolor="black", lw=0.5,
                    label=c if i == 0 else None)  # fmt: skip
            if v > 0.06 * r["step_ms"]:
                ax.annotate(f"{v:.1f}", (left + v / 2, i), ha="center", va="center", fontsize=7)
            left += v
        goal = r["flops"]["goal_step_ms"]
        if goal:
            ax.plot([goal, goal], [i - 0.4, i + 0.4], color="red", lw=1.5,
                    label=f"{GOAL_MFU:.0%} MFU" if i == 0 else None)  # fmt: skip
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["config"] for r in rows], fontsize=8)
    ax.set_xlabel("ms per training step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=8, loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="auto", choices=["auto", *MODELS])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=None, help="samples per step (model default)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated, from: {', '.join(CONFIGS)}")  # fmt: skip
    ap.add_argument("--profile-steps", type=int, default=3, help="steps under the profiler")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed span (unprofiled)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--attention", default="auto", choices=ATTENTION)
    ap.add_argument("--trace", action="store_true", help="keep each Chrome trace (gzipped)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (CPU runs only)")
    args = ap.parse_args(argv)
    for flag in ("batch", "profile_steps", "steps", "repeats", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    configs, device, where, name, spec, batch = resolve_choices(args, DEFAULT_BATCH)
    progress(f"{name}, batch {batch}, on {where}; profiling {', '.join(configs)}")
    result = run(
        spec,
        batch=batch,
        configs=configs,
        profile_steps=args.profile_steps,
        steps=args.steps,
        repeats=args.repeats,
        warmup=args.warmup,
        device=device,
        attention=args.attention,
        trace_dir=out_dir() if args.trace else None,
    )
    heading = f"{name}, batch {batch}, {where}"
    plot = out_dir() / "mfu_profile.png"
    _plot(result, f"training step by kernel category: {heading}", plot)
    print(f"### Step time by category (ms per step, share): {heading}\n", flush=True)
    print(table(result), flush=True)
    emit(
        {
            "benchmark": "mfu_profile",
            "model": name,
            "device": where,
            **result,
            "plot": plot,
            "environment": environment(),
        },
        save_as="mfu_profile.json",
    )


if __name__ == "__main__":
    main()
