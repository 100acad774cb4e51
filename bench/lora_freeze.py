"""LoRA that freezes (issue 51): LoRA on every layer, the usual practice, against LoRA with
freezing, re-packing and AutoCache, on the decoder workload of `bench/paper.py --workload lm`.

    model       the committed upstream decoder (bench/results/issue50-decoder: 8 Llama blocks of
                width 128, pretrained here on the standard library's packages), or --body
    data        a regime of bench/paper_lm.py: `continued` pre-training on pydoc's language
                reference (default) or `chat` fine-tuning on docstring answers
    jobs        each a real `pipetransformer run` on 2 worker processes (2 stages x 1 replica),
                the same epochs, per seed in a rotated order:

      baseline          LoRA (rank --rank, alpha 2 x rank, learning rate --lr) on every
                        projection of every block, no freezing: the usual practice
      lora+freeze <p>   the same adapters with all four components (freeze.relayout: elastic,
                        cache: auto) under each freeze policy <p> of --policies (`output:R`:
                        the output rule at ratio R): a frozen block's adapters are merged and
                        its output cached
      lora bound        the same, every block but the top --keep-trainable frozen at the
                        first step: the most freezing can give
      full              full fine-tuning of the same model, no freezing, at the workload's
                        learning rate

Per configuration, medians over seeds: the wall time and its speed-up over the baseline, the
held-out perplexity and its change (%), the time to the baseline's perplexity, tokens/s over the
training span, the peak resident memory per rank (sampled from /proc every --sample-s), the last
checkpoint's size and the time the ranks spent writing checkpoints.

Memory (--memory-width, 0: skipped): the workload's decoder is too small for what LoRA saves to
show (a worker's memory there is the runtime and the activations), so full fine-tuning and LoRA
also run --memory-steps steps on a random decoder of that width (--memory-layers blocks, the
same tokenizer, batch 8): peak memory per rank, the checkpoint's size and writing time.

    .venv/bin/python bench/lora_freeze.py [--seeds 0 1 2] [--regime continued] [--epochs 3]
        [--rank 8] [--lr 2e-3] [--policies auto output:0.5 gradient bound] [--quick]

One JSON line last (also bench/out/lora_freeze-<regime>.json): `wall_time_speedup`,
`perplexity_delta_pct` and `worst_seed_perplexity_delta_pct` of the first policy's row,
`peak_memory_mib` per configuration and `memory`; figure bench/out/lora_freeze-<regime>.png."""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

import paper_lm
from _common import ROOT, emit, environment, out_dir, progress
from lm_speed import run_sampled, worker_memory
from paper import ABLATION, history, summarise, time_split
from safetensors import safe_open

from pipetransformer.store import Store, sqlite_url

BODY = ROOT / "bench" / "results" / "issue50-decoder"


def configurations(
    rank: int, policies: list[str], keep: int, every: int, full: bool = True
) -> dict[str, dict[str, Any]]:
    """name -> what its spec adds to the regime's job: `adapters` (model.adapters or None)
    and `freeze` (the freeze section or None). A policy is a freeze policy's name, `output:R`
    (the output rule at ratio R) or `bound` (every block but the top `keep` frozen at the first
    step: the most freezing can give)."""
    lora = {"rank": rank, "alpha": 2 * rank}
    base = {"alpha": 0.25, "keep_trainable": keep, "every": every, **ABLATION["all"]}
    configs: dict[str, dict[str, Any]] = {"baseline": {"adapters": lora, "freeze": None}}
    for policy in policies:
        name, _, ratio = policy.partition(":")
        freeze = {**base, "policy": name}
        if ratio:
            freeze["output_ratio"] = float(ratio)
        if name == "bound":
            freeze |= {"policy": "schedule", "every": 1, "alpha": 0.99}
        configs[f"lora+freeze {policy}" if name != "bound" else "lora bound"] = {
            "adapters": lora,
            "freeze": freeze,
        }
    if full:
        configs["full"] = {"adapters": None, "freeze": None}
    return configs


def _run_sampled(tmp: Path, spec: dict, job: str, cache: Path, sample_s: float) -> dict:
    """`pipetransformer run` of `spec` as job `job`, its workers' memory sampled; its wall
    time and per-rank memory (MiB)."""
    run = run_sampled(
        tmp, {**spec, "name": job}, sample_s, env={"PIPETRANSFORMER_CACHE": str(cache)}
    )
    if run.returncode != 0:
        raise SystemExit(f"{job} failed:\n{run.output[-4000:]}")
    started, wall, sampler = run.started, run.wall_s, run.sampler
    store = Store.open(sqlite_url(tmp / job / "store.db"), migrate=False)
    try:
        workers = store.workers(job)
        end = store.metrics(job)[-1].time
        ckpts = [c for c in store.checkpoints(job) if c.state == "committed"]
        ckpt_s = sum(t.seconds.checkpoint for t in store.stage_times(job))
        sequences = store.events(job, kinds=["data_opened"])[0].data["origin"]["train"]
    finally:
        store.close()
    return {
        "started": started,
        "wall_s": wall,
        "memory": worker_memory(sampler.memory, workers, None, end),
        "checkpoint_bytes": ckpts[0].size_bytes if ckpts else None,
        "checkpoint_s": ckpt_s,
        "sequences": sequences.get("sequences") or sequences["rows"],
    }


def _extra(per_seed: list[dict[str, dict]], seq_len: int, epochs: int) -> dict[str, dict]:
    """Per configuration, medians over seeds: tokens/s over the training span, peak resident
    memory per rank, the last checkpoint's size and the seconds spent writing checkpoints."""
    out: dict[str, dict] = {}
    for name in per_seed[0]:
        runs = [r[name] for r in per_seed]
        ranks = sorted({k for r in runs for k in r["memory"]})
        out[name] = {
            "tokens_per_s": statistics.median(
                r["sequences"] * seq_len * epochs / (r["wall_s"] - r["startup_s"]) for r in runs
            ),
            "peak_memory_mib": {
                k: statistics.median(r["memory"][k]["peak_rss"] for r in runs if k in r["memory"])
                for k in ranks
            },
            "checkpoint_mib": statistics.median(
                (r["checkpoint_bytes"] or 0) / (1 << 20) for r in runs
            ),
            "checkpoint_s": statistics.median(r["checkpoint_s"] for r in runs),
        }
    return out


def memory_rows(
    tmp: Path,
    body: Path,
    data: Path,
    cache: Path,
    width: int,
    layers: int,
    steps: int,
    sample_s: float,
    rank: int,
) -> dict[str, dict]:
    """Full fine-tuning against LoRA on a wider decoder than the workload's (`width`, `layers`;
    the body's tokenizer, random weights: memory and checkpoints do not depend on what the
    weights hold), `steps` optimizer steps each on 2 stages: per rank the peak resident memory
    and its anonymous part's growth since the worker was first seen (the data, the model, its
    gradients, optimizer state and activations), the checkpoint's size and the seconds the
    ranks spent writing it."""
    import shutil

    from assets import make_decoder
    from transformers import AutoTokenizer

    wide = tmp / f"decoder-{width}x{layers}"
    if not (wide / "config.json").exists():
        wide.mkdir(parents=True)
        for file in body.iterdir():
            if file.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(file, wide / file.name)
        make_decoder(wide, len(AutoTokenizer.from_pretrained(body)), hidden=width, layers=layers)
    with safe_open(str(wide / "model.safetensors"), framework="pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    rows: dict[str, dict] = {}
    for name, adapters in (("full", None), ("lora", {"rank": rank, "alpha": 2 * rank})):
        spec = paper_lm.job(f"memory-{name}", wide, "continued", data, 0, 1, 8)
        spec["training"]["max_steps"] = steps
        if adapters is not None:
            spec["model"]["adapters"] = adapters
        job = f"memory-{name}"
        run = _run_sampled(tmp, spec, job, cache, sample_s)
        rows[name] = {
            "parameters": params,
            "wall_s": run["wall_s"],
            "peak_memory_mib": {k: m["peak_rss"] for k, m in run["memory"].items()},
            "model_memory_mib": {k: m["model"] for k, m in run["memory"].items()},
            "checkpoint_mib": (run["checkpoint_bytes"] or 0) / (1 << 20),
            "checkpoint_s": run["checkpoint_s"],
        }
        progress(
            f"memory {name} ({params / 1e6:.0f}M parameters): peak "
            + ", ".join(f"{v:.0f}" for v in rows[name]["peak_memory_mib"].values())
            + f" MiB, checkpoint {rows[name]['checkpoint_mib']:.1f} MiB"
        )
    return rows


def plot(summary: dict, extra: dict, memory: dict | None, path: Path) -> str:
    """Speed-up, perplexity change and peak memory per rank of each configuration; with
    `memory`, the wider decoder's peak memory under full fine-tuning and LoRA."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["rows"])
    fig, axes = plt.subplots(1, 4 if memory else 3, figsize=(18 if memory else 14, 4))
    axes[0].bar(names, [summary["rows"][n]["wall_time_speedup"] for n in names])
    axes[0].axhline(1.5, color="tab:green", ls="--", lw=0.8)
    axes[0].set_ylabel("wall-time speed-up over LoRA on every layer")
    axes[1].bar(names, [summary["rows"][n]["perplexity_delta_pct"] for n in names])
    axes[1].axhline(1.0, color="tab:red", ls="--", lw=0.8)
    axes[1].set_ylabel("held-out perplexity change (%)")
    panels = [(axes[2], names, {n: extra[n]["peak_memory_mib"] for n in names})]
    if memory:
        panels.append((axes[3], list(memory), {n: memory[n]["peak_memory_mib"] for n in memory}))
        params = next(iter(memory.values()))["parameters"]
        axes[3].set_title(f"a {params / 1e6:.0f}M-parameter decoder", fontsize=9)
    for ax, labels, peaks in panels:
        for k, rank in enumerate(sorted({r for n in labels for r in peaks[n]})):
            ax.bar(
                [i + 0.4 * k for i in range(len(labels))],
                [peaks[n].get(rank, 0) for n in labels],
                0.4,
                label=f"rank {rank}",
            )
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel("peak resident memory (MiB)")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--body", type=Path, default=BODY)
    parser.add_argument("--regime", choices=paper_lm.REGIMES, default="continued")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha: twice it)")
    parser.add_argument("--lr", type=float, default=2e-3, help="the adapters' learning rate")
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["auto", "output:0.5", "gradient", "bound"],
        help="freeze policies (output:R for the output rule at ratio R; bound)",
    )
    parser.add_argument(
        "--full",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also full fine-tuning (the `full` row)",
    )
    parser.add_argument("--keep-trainable", type=int, default=3)
    parser.add_argument("--every", type=int, default=20, help="freeze decision points (steps)")
    parser.add_argument("--sample-s", type=float, default=0.2, help="memory sampling period")
    parser.add_argument(
        "--quick", action="store_true", help="one epoch of one seed: a check that it runs"
    )
    parser.add_argument("--keep", type=Path, help="keep the runs under this directory")
    parser.add_argument(
        "--memory-width",
        type=int,
        default=1024,
        help="full fine-tuning against LoRA on a decoder this wide (0: not measured)",
    )
    parser.add_argument("--memory-layers", type=int, default=8)
    parser.add_argument("--memory-steps", type=int, default=4)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.epochs = args.seeds[:1], 1
        args.memory_width = min(args.memory_width, 256)
    configs = configurations(args.rank, args.policies, args.keep_trainable, args.every, args.full)
    batch = {"continued": 16, "chat": 8}[args.regime]
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or Path(scratch)
        cache = tmp / "cache"
        targets = paper_lm.make_targets(tmp / "targets")
        per_seed: list[dict[str, dict]] = []
        names = list(configs)
        for k, seed in enumerate(args.seeds):
            runs: dict[str, dict] = {}
            for name in names[k % len(names) :] + names[: k % len(names)]:
                spec = paper_lm.job(
                    "lora", args.body, args.regime, targets[args.regime], seed, args.epochs, batch
                )
                if configs[name]["adapters"] is not None:
                    spec["model"]["adapters"] = configs[name]["adapters"]
                    spec["training"]["lr"] = args.lr
                if configs[name]["freeze"] is not None:
                    spec["freeze"] = configs[name]["freeze"]
                job = f"s{seed}-{len(runs)}"
                run = _run_sampled(tmp, spec, job, cache, args.sample_s)
                runs[name] = {**run, **history(tmp / job, job, run["wall_s"])}
                runs[name]["time_split"] = time_split(tmp / job, job, run["started"], run["wall_s"])
                progress(
                    f"seed {seed} {name}: {run['wall_s']:.0f}s, perplexity "
                    f"{runs[name]['final_perplexity']:.2f}, peak "
                    + ", ".join(f"{m['peak_rss']:.0f}" for m in run["memory"].values())
                    + " MiB"
                )
            per_seed.append({n: runs[n] for n in names})
        summary = summarise(per_seed, 0)
        extra = _extra(per_seed, 128, args.epochs)
        memory = (
            memory_rows(
                tmp,
                args.body,
                targets["continued"],
                cache,
                args.memory_width,
                args.memory_layers,
                args.memory_steps,
                args.sample_s,
                args.rank,
            )  # fmt: skip
            if args.memory_width
            else None
        )
        figure = plot(summary, extra, memory, out_dir() / f"lora_freeze-{args.regime}.png")
    head = next(n for n in names if n.startswith("lora+freeze"))
    rows = {n: {**summary["rows"][n], **extra[n]} for n in names}
    emit(
        {
            "benchmark": "lora_freeze",
            "headline": head,
            "wall_time_speedup": rows[head]["wall_time_speedup"],
            "perplexity_delta_pct": rows[head]["perplexity_delta_pct"],
            "worst_seed_perplexity_delta_pct": rows[head]["worst_seed_perplexity_delta_pct"],
            "peak_memory_mib": {n: rows[n]["peak_memory_mib"] for n in names},
            "memory": memory,
            "configurations": rows,
            "goals": {"wall_time_speedup": 1.5, "perplexity_delta_pct": 1.0},
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "per_seed": per_seed,
            "figures": [figure],
            "environment": environment(),
        },
        save_as=f"lora_freeze-{args.regime}.json",
    )


if __name__ == "__main__":
    main()
