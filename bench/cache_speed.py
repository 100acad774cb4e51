"""AutoCache speed: the frozen prefix's work per training step, recomputed vs served from the cache.

For the digits ViT (examples/vit-digits.yaml's model, real digits images) and a larger ViT-ish
model (32x32x3 images, 4x4 patches -> 65 tokens, dim 256, 12 blocks; synthetic images), with
25 / 50 / 75 % of the blocks frozen, one training step's prefix work (one global batch through
the embedding + frozen blocks, as the first stage's rank does it) is timed, side by side in one
run (interleaved repeats, medians, 1 thread), as:

    recompute    FrozenPrefix.compute (eval, no_grad)
    ram          ActivationCache.get_or_compute, every row a hit in the RAM tier
    disk warm    the same from the memory-mapped files, page cache warm
    disk cold    the same after evicting the rows file from the page cache (fsync + fadvise)

The scratch cache holds about a train split's worth of rows (the batch's outputs tiled), so
reads are random rows of a realistically sized file; it lives under bench/out/ and is removed.
`speedup_*` = recompute / lookup; `cache_cheaper` is CachePolicy("auto")'s decision (lookup x 1.2
<= recompute) for a RAM-resident and a disk-resident cache. Also timed: the incremental advance
when F grows (blocks [F_old, F_new) on cached rows vs recomputing [0, F_new) from the inputs).

The last line is one JSON object; a PNG lands in bench/out/cache_speed.png.

    .venv/bin/python bench/cache_speed.py [--repeats 15] [--batch 64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, emit, environment, median, out_dir, pin_threads, progress  # noqa: E402

pin_threads(1)

import torch  # noqa: E402

from pipetransformer.core.spec import ModelSpec, load_spec  # noqa: E402
from pipetransformer.models.seeded import build_model  # noqa: E402
from pipetransformer.models.stage import num_tokens  # noqa: E402
from pipetransformer.trainer.cache import CachePolicy, FrozenPrefix, measure_prefix_costs  # noqa: E402
from pipetransformer.trainer.data import load_dataset  # noqa: E402

FRACTIONS = (25, 50, 75)


def _configs(batch: int) -> dict[str, tuple[ModelSpec, torch.Tensor, int]]:
    """name -> (model, one batch of inputs, rows of the scratch cache)."""
    job = load_spec(ROOT / "examples" / "vit-digits.yaml")
    digits = load_dataset(job.data, job.model).train
    large = ModelSpec(
        family="vit", image_size=32, patch_size=4, channels=3, dim=256, depth=12, heads=8,
        mlp_ratio=4.0, num_classes=10,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    large_x = torch.randn((batch, 3, 32, 32), generator=gen)
    return {
        "digits-vit": (job.model, digits.inputs[:batch], len(digits)),
        "vit-256x12": (large, large_x, 2048),
    }


def _boundary(depth: int, percent: int) -> int:
    return max(1, min(depth - 1, (depth * percent + 50) // 100))


def _incremental(prefix: FrozenPrefix, x: torch.Tensor, f_old: int, f_new: int, repeats: int):
    """(advance s, recompute s): blocks [f_old, f_new) on cached rows vs [0, f_new) from x."""
    cached = prefix.compute(x, f_old)
    adv, full = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        prefix.run_blocks(cached, f_old, f_new)
        t1 = time.perf_counter()
        prefix.compute(x, f_new)
        t2 = time.perf_counter()
        adv.append(t1 - t0)
        full.append(t2 - t1)
    return median(adv), median(full)


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.6), squeeze=False)
    axes = list(axes[0])
    kinds = [
        ("recompute_ms", "recompute", "tab:red"),
        ("ram_ms", "cache: RAM", "tab:green"),
        ("disk_warm_ms", "cache: disk (page cache)", "tab:blue"),
        ("disk_cold_ms", "cache: disk (cold)", "tab:purple"),
    ]
    for ax, (name, rows) in zip(axes, results.items(), strict=True):
        labels = list(rows)
        width = 0.2
        for k, (key, label, color) in enumerate(kinds):
            xs = [i + (k - 1.5) * width for i in range(len(labels))]
            ax.bar(xs, [rows[lab][key] for lab in labels], width, label=label, color=color)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([f"{lab} frozen\n(F={rows[lab]['boundary']})" for lab in labels])
        ax.set_yscale("log")
        ax.set_ylabel("prefix time per step (ms, log)")
        ax.set_title(f"{name}, batch {next(iter(rows.values()))['batch']}")
        ax.grid(axis="y", alpha=0.3, which="both")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(kinds), fontsize=9)
    fig.suptitle("AutoCache: frozen-prefix work per training step (1 thread)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, default=64, help="global batch (the digits job's)")
    args = ap.parse_args()
    policy = CachePolicy("auto")
    scratch = out_dir() / "cache_speed_scratch"
    results: dict[str, dict[str, dict]] = {}
    flat: dict[str, dict[str, float | bool]] = {
        "speedup_ram": {}, "speedup_disk_warm": {}, "speedup_disk": {},
        "cache_cheaper_ram": {}, "cache_cheaper_disk": {}, "advance_speedup": {},
    }  # fmt: skip
    for name, (spec, x, rows) in _configs(args.batch).items():
        prefix = FrozenPrefix.of(build_model(spec, seed=0))
        row_kb = num_tokens(spec) * spec.dim * 4 / 1024
        progress(
            f"{name}: depth {spec.depth}, {num_tokens(spec)} tokens x dim {spec.dim} "
            f"({row_kb:.1f} KiB/sample), cache of {rows} rows ({rows * row_kb / 1024:.0f} MiB)"
        )
        results[name] = {}
        bounds = {}
        for pct in FRACTIONS:
            f = _boundary(spec.depth, pct)
            bounds[pct] = f
            c = measure_prefix_costs(
                prefix, x, f, directory=scratch, repeats=args.repeats,
                pool_batches=max(1, rows // len(x)),
            )  # fmt: skip
            r = {
                "boundary": f,
                "batch": c.batch_size,
                "recompute_ms": c.compute_s * 1e3,
                "ram_ms": c.ram_s * 1e3,
                "disk_warm_ms": c.disk_warm_s * 1e3,
                "disk_cold_ms": c.disk_s * 1e3,
                "store_ms": c.store_s * 1e3,
                "speedup_ram": c.speedup(1.0),
                "speedup_disk_warm": c.speedup(0.0, cold=False),
                "speedup_disk": c.speedup(0.0),
                "cache_cheaper_ram": policy.should_use_cache(c.compute_s, c.lookup_s(1.0)),
                "cache_cheaper_disk": policy.should_use_cache(c.compute_s, c.lookup_s(0.0)),
            }
            r = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
            key = f"{name}@{pct}"
            results[name][f"{pct}%"] = r
            for k in flat:
                if k in r:
                    flat[k][key] = round(r[k], 2) if isinstance(r[k], float) else r[k]
            progress(
                f"  {pct}% frozen (F={f}): recompute {r['recompute_ms']:.2f} ms | RAM "
                f"{r['ram_ms']:.3f} ms ({r['speedup_ram']:.1f}x) | disk warm "
                f"{r['disk_warm_ms']:.3f} ms ({r['speedup_disk_warm']:.1f}x) | disk cold "
                f"{r['disk_cold_ms']:.3f} ms ({r['speedup_disk']:.1f}x) | store "
                f"{r['store_ms']:.3f} ms | cache cheaper: RAM {r['cache_cheaper_ram']}, "
                f"disk {r['cache_cheaper_disk']}"
            )
        for lo, hi in zip(FRACTIONS, FRACTIONS[1:], strict=False):
            adv_s, full_s = _incremental(prefix, x, bounds[lo], bounds[hi], args.repeats)
            flat["advance_speedup"][f"{name}@{lo}->{hi}"] = round(full_s / adv_s, 2)
            progress(
                f"  F {bounds[lo]} -> {bounds[hi]}: advance cached rows {adv_s * 1e3:.2f} ms vs "
                f"recompute {full_s * 1e3:.2f} ms ({full_s / adv_s:.1f}x)"
            )
    scratch.rmdir()  # each measurement removed its own files
    png = out_dir() / "cache_speed.png"
    _plot(results, png)
    progress(f"plot: {png}")
    emit(
        {
            "benchmark": "cache_speed",
            **flat,
            "results": results,
            "png": str(png.relative_to(ROOT)),
            "environment": environment(),
        },
        save_as="cache_speed.json",
    )


if __name__ == "__main__":
    main()
