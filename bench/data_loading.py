"""Data loading (issue 23): what reading a job's own image files costs its training loop, and how
much memory a worker needs to train through a data set several times its memory budget.

(a) throughput. The CPU example's job (examples/hf-vit-images.yaml: its ViT, 4 blocks of width 64
    on 32x32 images, pretrained on digits 0-4, fine-tuned with a new head on an image folder of all
    ten digits as 32x32 PNGs; its global batch, `loader_workers` and image backend) trained in
    this process through the project's own pieces: a gloo process group of one rank, the layout
    1x1 (`plan_layout`), `trainer.relayout.build_training` (pipeline + AdamW from the pretrained
    checkpoint), the `ElasticSampler`, `trainer.feed.Feed`, the trainer's LR schedule, train step,
    clipping and optimizer step. Two variants, each with its own copy of the model:

        image_folder  the folder opened as the job opens it (`trainer.data.load_dataset` ->
                      `image_folder_splits`): PNG files decoded and resized by the model's image
                      processor in `loader_workers` DataLoader processes, through `Feed`
        in_memory     the same images decoded once, up front, into a `trainer.data.Split` (one
                      float tensor, the built-in data sets' form), indexed by `Feed`

    They take turns of `--turn-steps` steps (which goes first alternates every round) so
    machine-load drift hits both; epochs roll over inside turns. Not timed: `--warmup-steps` of
    each at the start, and the first `--skip-steps` of every turn (default: the batches the
    loader processes read ahead, 4 each, which they had time to read during the other variant's
    turn). `Feed` is made as the trainer makes it (`epochs`: the job's), so a reader runs on
    across epoch ends; a batch at an epoch's start is reported apart all the same. Reported per
    variant: samples/s (real samples over the summed step times), step ms, the wait for inputs
    per step (mean, median, p95, max, at epoch starts, elsewhere); for image_folder the stall
    fraction, `Feed.wait_s` over the summed step time (goal: below 5 %), and without epochs'
    first steps (`stall_fraction_steady`). `samples_per_s_ratio` = image_folder / in_memory (what
    data loading costs: 1 - ratio), the per-round ratios' median and range as a noise gauge.
    `decode_ms_per_image` times reading and preprocessing one row alone in this process, and
    `decode_all_s` the whole split read as one batch (diagnostics).

(b) memory. A table (`data.dataset: table`, one arrow file memory-mapped in place) of random RGB
    images generated into `--workdir` (reused when present) until it holds `--data-factor` x
    `--budget-mib` on disk: PNGs whose deflate blocks are stored uncompressed, so the bytes stored
    equal the decoded pixels (`--image-size` square, resized by the processor to the model's
    16x16; a tiny ViT of 2 blocks, width 32, keeps the training cheap). A fresh process (this
    script, `--memory-child`) trains one full pass over it, the same pieces as (a), with
    `--memory-workers` loader processes; this process samples the resident memory of that
    training process and its loader processes every `--sample-s` from /proc (status: VmRSS,
    RssAnon, RssFile, RssShmem; smaps_rollup: Pss, Pss_Anon, Pss_File, Pss_Shmem). Reported: the
    peaks of their sums over the processes, `peak_rss_mib` (resident set summed: pages a loader
    shares with the training process after the fork count twice) and `peak_pss_mib` (each page
    once), each with its anonymous, file-backed and shared-memory parts: the memory-mapped arrow
    file's pages are file-backed page cache the kernel can drop when memory runs short,
    anonymous memory is not; the training and loader processes' own peaks, and the training
    process's baseline (before the first batch), against `budget_mib` and the data's size.
    `anon_within_budget`: the anonymous PSS peak within the budget; `rss_within_budget`: the
    summed RSS peak.

On these 2-core machines the training process runs `--threads` torch threads (default: the spec's
`runtime.threads_per_worker`, 1, as a job's worker does); DataLoader processes run one each. The
last line is one JSON object (also bench/out/data_loading.json); a PNG goes to
bench/out/data_loading.png (neither with `--no-files`).

    .venv/bin/python bench/data_loading.py [--quick] [--workdir bench/out/data_loading]
        [--rounds 10] [--turn-steps 40] [--warmup-steps 23] [--skip-steps N] [--per-class N]
        [--loader-workers N] [--image-backend auto|native|transformers] [--batch N]
        [--budget-mib 1024] [--data-factor 3] [--image-size 256] [--memory-workers N]
        [--parts throughput,memory] [--threads 1] [--no-files]

`--quick` (about a minute): 3 rounds of 30 steps, a 256 MiB budget (768 MiB of table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402
from _common import (  # noqa: E402
    MEMORY_ROLLUP,
    MEMORY_STATUS,
    MIB,
    ROOT,
    emit,
    environment,
    median,
    out_dir,
    pin_threads,
    process_memory,
    progress,
)

from pipetransformer.core.planner import plan_layout  # noqa: E402
from pipetransformer.core.sampler import IGNORE, ElasticSampler  # noqa: E402
from pipetransformer.core.spec import JobSpec, parse_spec  # noqa: E402
from pipetransformer.orchestrator.sources import resolve_submission  # noqa: E402
from pipetransformer.trainer.data import Split, load_dataset  # noqa: E402
from pipetransformer.trainer.feed import PREFETCH, Feed  # noqa: E402
from pipetransformer.trainer.optim import lr_at, set_lr  # noqa: E402
from pipetransformer.trainer.relayout import build_training  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
import assets  # noqa: E402  (examples/assets.py: the example's checkpoint and images)

STALL_GOAL = 0.05
EXAMPLE = ROOT / "examples" / "hf-vit-images.yaml"
DEFAULT_WORKDIR = ROOT / "bench" / "out" / "data_loading"


# -- one process group of one rank --------------------------------------------------------------


def _process_group(scratch: Path) -> None:
    if not dist.is_initialized():
        store = dist.FileStore(str(scratch / "pg-store"), 1)
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)


# -- training through the project's pieces ------------------------------------------------------


@dataclass
class StepTime:
    seconds: float  # the whole step: inputs, forward, backward, clipping, optimizer
    wait: float  # of which waiting for the inputs (Feed.wait_s for a data source)
    samples: int  # real samples (the last batch of an epoch is padded)
    epoch_start: bool  # an epoch's first step (where a reader per epoch would start)


@dataclass
class Variant:
    """One model copy trained on one form of the data, from where it left off."""

    name: str
    spec: JobSpec
    split: Any  # trainer.data.Split or trainer.sources.splits.SourceSplit
    workers: int
    epoch: int = 0
    cursor: int = 0
    step: int = 0
    times: list[StepTime] = field(default_factory=list)
    round_rates: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        spec, tspec = self.spec, self.spec.training
        self.layout = plan_layout(spec).layout
        self.pipe, self.optimizer = build_training(spec, self.layout, rank=0)
        self.sampler = ElasticSampler(len(self.split), tspec.global_batch_size, tspec.seed)
        # as the trainer makes it: the reader runs on across epochs up to the job's
        self.feed = Feed(self.split, self.sampler, workers=self.workers, epochs=tspec.epochs)
        self.total_steps = tspec.epochs * self.sampler.steps_per_epoch()

    def train(self, steps: int, skip: int = 0, on_step: Any = None) -> None:
        """`steps` steps as `Trainer.step` takes them (without its reports and freezing), epochs
        rolling over; all but the first `skip` are timed (none with skip >= steps)."""
        pipe, feed, tspec = self.pipe, self.feed, self.spec.training
        labels = self.split.labels
        spent = samples = 0.0
        for i in range(steps):
            t0 = time.perf_counter()
            w0 = feed.wait_s
            at = (self.epoch, self.cursor, 1, 0)
            b = self.sampler.batch(*at)
            inputs = feed.inputs(*at, b)
            wait = feed.wait_s - w0 if feed.streaming else time.perf_counter() - t0
            targets = labels[b.indices].clone()
            targets[~torch.from_numpy(b.valid)] = IGNORE
            set_lr(self.optimizer, lr_at(self.step % self.total_steps, self.total_steps, tspec))
            pipe.train_step(inputs, targets, b.loss_count, indices=b.indices)
            pipe.sync_and_clip(tspec.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - t0
            if i >= skip:
                self.times.append(StepTime(seconds, wait, b.global_valid, self.cursor == 0))
                spent += seconds
                samples += b.global_valid
            if on_step is not None:
                on_step(self, b, inputs)
            self.step += 1
            self.cursor = b.next_cursor
            if self.cursor >= len(self.split):
                self.epoch, self.cursor = self.epoch + 1, 0
        if spent:
            self.round_rates.append(samples / spent)

    def close(self) -> None:
        self.feed.close()

    def summary(self) -> dict[str, Any]:
        times = self.times
        total = sum(t.seconds for t in times)
        waits = [t.wait for t in times]
        steady = [t for t in times if not t.epoch_start]
        starts = [t.wait for t in times if t.epoch_start]
        out = {
            "samples_per_s": sum(t.samples for t in times) / total,
            "step_ms": 1e3 * total / len(times),
            "steps": len(times),
            "wait_ms_mean": 1e3 * sum(waits) / len(waits),
            "wait_ms_median": 1e3 * median(waits),
            "wait_ms_p95": 1e3 * float(np.percentile(waits, 95)),
            "wait_ms_max": 1e3 * max(waits),
            "wait_ms_epoch_start": 1e3 * median(starts) if starts else None,
            "wait_ms_steady_mean": 1e3 * sum(t.wait for t in steady) / len(steady)
            if steady
            else None,
        }
        if self.feed.streaming:
            out["stall_fraction"] = sum(waits) / total
            out["stall_fraction_steady"] = (
                sum(t.wait for t in steady) / sum(t.seconds for t in steady) if steady else None
            )
        return out


# -- (a) the CPU example: image folder vs the same images in memory ----------------------------


def example_assets(workdir: Path, per_class: int | None) -> tuple[Path, Path]:
    """The example's checkpoint (pretrained on digits 0-4) and digit image folder, made once."""
    root = workdir / f"vit-images-{per_class or 'all'}"
    if not (root / "done").exists():
        progress(f"making the example's ViT and image folder under {root}")
        shutil.rmtree(root, ignore_errors=True)
        images = assets.make_digit_images(root / "images", per_class=per_class)
        assets.pretrain_vit(assets.make_vit(root / "vit-tiny"), images)
        (root / "done").write_text("made by bench/data_loading.py\n")
    return root / "vit-tiny", root / "images"


def example_spec(
    vit: Path, images: Path, workers: int | None, backend: str | None, batch: int | None
) -> JobSpec:
    """examples/hf-vit-images.yaml on these assets, as one stage and one replica."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["model"]["pretrained"] = str(vit)
    raw["data"].update(train=str(images / "train"), test=str(images / "test"))
    if workers is not None:
        raw["data"]["loader_workers"] = workers
    if backend is not None:
        raw["data"]["image_backend"] = backend
    if batch is not None:
        raw["training"]["global_batch_size"] = batch
    raw["parallel"].update(stages=1, replicas=1)
    return resolve_submission(parse_spec(raw), ROOT)


def decode_ms_per_image(split: Any, n: int = 128) -> float:
    """The image processor's time on one row, read and decoded here (no loader processes)."""
    n = min(n, len(split))
    split.dataset[0]  # warm: first-call imports and caches
    t0 = time.perf_counter()
    for i in range(n):
        split.dataset[i]
    return 1e3 * (time.perf_counter() - t0) / n


def measure_throughput(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    vit, images = example_assets(args.workdir, args.per_class)
    spec = example_spec(vit, images, args.loader_workers, args.image_backend, args.batch)
    data = load_dataset(spec.data, spec.model)
    source = data.train
    # the job's length: as many epochs as the run takes, so the readers run on as a job's do
    per_epoch = -(-len(source) // spec.training.global_batch_size)
    epochs = -(-(args.warmup_steps + args.rounds * args.turn_steps) // per_epoch)
    spec = spec.model_copy(update={"training": spec.training.model_copy(update={"epochs": epochs})})
    backend = "transformers" if source.dataset.image.processor is not None else "native"
    t0 = time.perf_counter()
    decoded = Split(source.read(np.arange(len(source))), source.labels)
    decode_all_s = time.perf_counter() - t0
    progress(
        f"{len(source)} training images; decoded into memory in {decode_all_s:.2f} s "
        f"({backend} image processor)"
    )
    workers = spec.data.loader_workers
    variants = [
        Variant("image_folder", spec, source, workers),
        Variant("in_memory", spec, decoded, 0),
    ]
    first: dict[str, torch.Tensor] = {}

    def check(v: Variant, b: Any, inputs: torch.Tensor) -> None:
        if v.step == 0:
            first[v.name] = inputs.clone()

    # the steps a turn's start may get for free (batches read ahead while the other variant ran)
    skip = args.skip_steps
    if skip is None:
        skip = min(PREFETCH * max(workers, 1), args.turn_steps // 2)
    if not 0 <= skip < args.turn_steps:
        raise SystemExit(f"--skip-steps {skip}: needs 0 <= skip < --turn-steps")
    try:
        for v in variants:
            v.train(args.warmup_steps, skip=args.warmup_steps, on_step=check)
        progress(f"warm-up: {args.warmup_steps} steps of each")
        for r in range(args.rounds):
            for k in range(2):
                variants[(r + k) % 2].train(args.turn_steps, skip=skip)
            a, m = (v.round_rates[-1] for v in variants)
            progress(
                f"round {r + 1}/{args.rounds}: image folder {a:7.1f} samples/s, "
                f"in memory {m:7.1f} ({a / m:.3f})"
            )
    finally:
        for v in variants:
            v.close()
    # both variants train on the same inputs
    assert torch.equal(first["image_folder"], first["in_memory"])
    folder, memory = variants[0].summary(), variants[1].summary()
    ratios = [a / m for a, m in zip(variants[0].round_rates, variants[1].round_rates, strict=True)]
    m = spec.model
    stall = folder["stall_fraction"]
    return {
        "model": {
            "checkpoint": "examples/assets.py make_vit + pretrain_vit (the example's)",
            "dim": m.dim,
            "depth": m.depth,
            "image_size": m.image_size,
            "patch_size": m.patch_size,
        },
        "train_images": len(source),
        "global_batch": spec.training.global_batch_size,
        "steps_per_epoch": variants[0].sampler.steps_per_epoch(),
        "loader_workers": workers,
        "image_backend": backend,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "turn_steps": args.turn_steps,
        "skip_steps": skip,
        "warmup_steps": args.warmup_steps,
        "image_folder": folder,
        "in_memory": memory,
        "samples_per_s_ratio": folder["samples_per_s"] / memory["samples_per_s"],
        "round_ratio_median": median(ratios),
        "round_ratio_min": min(ratios),
        "round_ratio_max": max(ratios),
        "stall_fraction": stall,
        "wait_ms_per_step": folder["wait_ms_mean"],
        "decode_ms_per_image": decode_ms_per_image(source),
        "decode_all_s": decode_all_s,
        "goal": {"stall_fraction_max": STALL_GOAL, "met": stall < STALL_GOAL},
    }


# -- (b) memory: a table several times the budget -----------------------------------------------


def stored_png(pixels: np.ndarray) -> bytes:
    """An RGB PNG whose deflate blocks are stored, not compressed: as many bytes as its pixels
    (plus a byte per row and the chunks' headers). Written here: Pillow's encoder at
    compress_level=0 still filters every row and takes ~13x longer."""
    h, w, _ = pixels.shape
    raw = np.zeros((h, w * 3 + 1), np.uint8)  # filter type 0 (none) in each row's first byte
    raw[:, 1:] = pixels.reshape(h, w * 3)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), 0))
        + chunk(b"IEND", b"")
    )


def _write_table(path: Path, rows: int, size: int, seed: int, classes: int = 10) -> None:
    import datasets
    from datasets.arrow_writer import ArrowWriter

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=[str(c) for c in range(classes)]),
        }
    )
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".partial")
    with ArrowWriter(features=features, path=str(tmp)) as writer:
        for start in range(0, rows, 256):
            n = min(256, rows - start)
            pixels = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
            writer.write_batch(
                {
                    "image": [{"bytes": stored_png(p), "path": None} for p in pixels],
                    "label": rng.integers(0, classes, n).tolist(),
                }
            )
        writer.finalize()
    os.replace(tmp, path)


def table_assets(workdir: Path, budget_mib: float, factor: float, size: int) -> dict[str, Any]:
    """The table (train.arrow, test.arrow) and a tiny ViT taking 16x16 images, made once."""
    per_image = len(stored_png(np.zeros((size, size, 3), np.uint8)))
    rows = math.ceil(factor * budget_mib * MIB / per_image)
    root = workdir / f"table-{budget_mib:g}MiB-x{factor:g}-{size}px"
    if not (root / "done").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        progress(
            f"writing {rows} images of {size}x{size} ({rows * per_image / MIB:.0f} MiB) to {root}"
        )
        _write_table(root / "train.arrow", rows, size, seed=0)
        _write_table(root / "test.arrow", 64, size, seed=1)
        assets.make_vit(root / "vit-16", image_size=16, patch_size=4, hidden=32, layers=2, heads=2)
        (root / "done").write_text("made by bench/data_loading.py\n")
    return {
        "root": root,
        "rows": rows,
        "stored_bytes": (root / "train.arrow").stat().st_size,
        "decoded_bytes": rows * size * size * 3,
    }


def memory_spec(root: Path, workers: int, batch: int) -> JobSpec:
    raw = {
        "name": "data-loading-memory",
        "model": {"pretrained": str(root / "vit-16"), "num_classes": 10},
        "data": {
            "dataset": "table",
            "train": [str(root / "train.arrow")],
            "test": [str(root / "test.arrow")],
            "columns": {"image": "image", "label": "label"},
            "loader_workers": workers,
            "image_backend": "native",
        },
        "training": {"epochs": 1, "global_batch_size": batch, "lr": 0.001, "warmup_steps": 0},
        "parallel": {"stages": 1, "replicas": 1, "microbatches": 1},
    }
    return resolve_submission(parse_spec(raw), ROOT)


def _children(pid: int) -> list[int]:
    """`pid`'s descendants (the loader processes and anything they started)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids: list[int] = []
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids.extend(int(c) for c in f.read().split())
        except OSError:
            continue
        found.extend(kids)
        todo.extend(kids)
    return found


KINDS = [*MEMORY_STATUS, *MEMORY_ROLLUP]


class TreeSampler(threading.Thread):
    """Samples the resident memory of a process and its descendants until `stop()`."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self._stop_event = threading.Event()
        self.samples: list[dict[str, float]] = []  # t, processes, and the sums in MiB
        self.peak_main: dict[str, float] = {}
        self.peak_child: dict[str, float] = {}  # the largest of any loader process
        self.children_seen: set[int] = set()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def sample(self) -> None:
        kids = _children(self.pid)
        sums = dict.fromkeys(KINDS, 0.0)
        for p in [self.pid, *kids]:
            one = process_memory(p)
            if not one:
                continue
            for k in KINDS:
                sums[k] += one[k]
            peaks = self.peak_main if p == self.pid else self.peak_child
            for k, v in one.items():
                peaks[k] = max(peaks.get(k, 0.0), v)
            if p != self.pid:
                self.children_seen.add(p)
        sums["t"] = time.perf_counter() - self.t0
        sums["processes"] = 1 + len(kids)
        self.samples.append(sums)

    def peaks(self) -> dict[str, float]:
        return {k: max((s[k] for s in self.samples), default=0.0) for k in KINDS}


def memory_child(args: argparse.Namespace, scratch: Path) -> None:
    """The training process of (b): one full pass over the table, then one JSON line."""
    root = Path(args.memory_child)
    spec = memory_spec(root, args.memory_workers, args.memory_batch)
    _process_group(scratch)
    data = load_dataset(spec.data, spec.model)
    variant = Variant("table", spec, data.train, spec.data.loader_workers)
    baseline = process_memory("self")
    t0 = time.perf_counter()
    seen: set[int] = set()
    variant.train(
        variant.sampler.steps_per_epoch(),
        on_step=lambda v, b, inputs: seen.update(b.indices.tolist()),
    )
    wall = time.perf_counter() - t0
    variant.close()
    s = variant.summary()
    emit(
        {
            "rows": len(data.train),
            "rows_read": len(seen),
            "steps": s["steps"],
            "samples_per_s": s["samples_per_s"],
            "stall_fraction": s["stall_fraction"],
            "wall_s": wall,
            "loader_workers": spec.data.loader_workers,
            "baseline": {k: baseline[k] for k in ("rss", "rss_anon", "rss_file", "pss")},
            "threads": torch.get_num_threads(),
        }
    )


def measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    table = table_assets(args.workdir, args.budget_mib, args.data_factor, args.image_size)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--memory-child",
        str(table["root"]),
        "--memory-workers",
        str(args.memory_workers),
        "--memory-batch",
        str(args.memory_batch),
        "--threads",
        str(args.threads),
    ]
    progress(
        f"training one pass over {table['rows']} rows ({table['stored_bytes'] / MIB:.0f} MiB) "
        f"in a fresh process, {args.memory_workers} loader process(es)"
    )
    with tempfile.TemporaryFile("w+") as log:
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        sampler = TreeSampler(child.pid, args.sample_s)
        sampler.start()
        stdout, _ = child.communicate()
        sampler.stop()
        if child.returncode != 0:
            log.seek(0)
            raise SystemExit(f"the memory run failed ({child.returncode}):\n{log.read()[-4000:]}")
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    run = json.loads(lines[-1])
    peaks = sampler.peaks()
    budget = args.budget_mib
    return {
        "budget_mib": budget,
        "data_stored_mib": table["stored_bytes"] / MIB,
        "data_decoded_mib": table["decoded_bytes"] / MIB,
        "data_over_budget": table["stored_bytes"] / MIB / budget,
        "rows": table["rows"],
        "image_size_stored": args.image_size,
        "image_size_model": 16,
        "format": "arrow table (memory-mapped), PNG with stored deflate blocks, random RGB",
        "peak_rss_mib": peaks["rss"],
        "peak_rss_anon_mib": peaks["rss_anon"],
        "peak_rss_file_mib": peaks["rss_file"],
        "peak_rss_shmem_mib": peaks["rss_shmem"],
        "peak_pss_mib": peaks["pss"],
        "peak_pss_anon_mib": peaks["pss_anon"],
        "peak_pss_file_mib": peaks["pss_file"],
        "peak_pss_shmem_mib": peaks["pss_shmem"],
        "training_process_peak": sampler.peak_main,
        "loader_process_peak": sampler.peak_child,
        "loader_processes_seen": len(sampler.children_seen),
        "samples_taken": len(sampler.samples),
        "sample_s": args.sample_s,
        "pss_anon_over_baseline_mib": peaks["pss_anon"] - run["baseline"]["rss_anon"],
        "anon_within_budget": peaks["pss_anon"] <= budget,
        "rss_within_budget": peaks["rss"] <= budget,
        "timeline": sampler.samples[:: max(1, len(sampler.samples) // 400)],  # the plot's
        **run,
    }


# -- output -------------------------------------------------------------------------------------


def _rounded(value: Any) -> Any:
    """Floats to 4 significant digits, for a JSON line a person reads."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("throughput", "memory") if p in result]
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.4), squeeze=False)
    for ax, part in zip(axes[0], parts, strict=True):
        r = result[part]
        if part == "throughput":
            names = ["image_folder", "in_memory"]
            rates = [r[n]["samples_per_s"] for n in names]
            waits = [r[n]["wait_ms_mean"] / r[n]["step_ms"] for n in names]
            ax.bar(names, rates, color=["tab:blue", "tab:gray"])
            ax.set_ylabel("training samples/s")
            for i, (rate, wait) in enumerate(zip(rates, waits, strict=True)):
                ax.text(i, rate, f"{rate:.0f}/s\nwait {100 * wait:.1f} %", ha="center", va="bottom")
            ax.set_title(
                f"(a) example ViT, batch {r['global_batch']}, {r['loader_workers']} loader "
                f"worker(s): ratio {r['samples_per_s_ratio']:.3f}, stall "
                f"{100 * r['stall_fraction']:.1f} %",
                fontsize=9,
            )
            ax.set_ylim(0, max(rates) * 1.25)
        else:
            tl = r["timeline"]
            t = [s["t"] for s in tl]
            for key, label, color in (
                ("rss", "RSS (summed)", "black"),
                ("pss", "PSS", "tab:green"),
                ("pss_anon", "anonymous (PSS)", "tab:red"),
                ("pss_file", "file-backed (PSS)", "tab:blue"),
            ):
                ax.plot(t, [s[key] for s in tl], label=label, color=color)
            ax.axhline(r["budget_mib"], ls="--", color="tab:orange", label="budget")
            ax.set_xlabel("s since the training process started")
            ax.set_ylabel("MiB (training process + loader processes)")
            ax.set_title(
                f"(b) one pass over {r['data_stored_mib']:.0f} MiB "
                f"({r['data_over_budget']:.1f}x the budget)",
                fontsize=9,
            )
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run of about a minute")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="generated data")
    ap.add_argument("--parts", default="throughput,memory")
    ap.add_argument("--threads", type=int, default=None, help="default: the spec's (1)")
    # (a)
    ap.add_argument("--rounds", type=int, default=None, help="turns of each variant (10)")
    ap.add_argument("--turn-steps", type=int, default=None, help="steps per turn (40)")
    ap.add_argument("--skip-steps", type=int, default=None, help="untimed at a turn's start")
    ap.add_argument("--warmup-steps", type=int, default=None, help="untimed, each (23)")
    ap.add_argument("--per-class", type=int, default=None, help="images per digit (all)")
    ap.add_argument("--loader-workers", type=int, default=None, help="default: the example's")
    ap.add_argument("--image-backend", choices=("auto", "native", "transformers"), default=None)
    ap.add_argument("--batch", type=int, default=None, help="default: the example's")
    # (b)
    ap.add_argument("--budget-mib", type=float, default=None, help="(1024; quick: 256)")
    ap.add_argument("--data-factor", type=float, default=3.0, help="data size / budget")
    ap.add_argument("--image-size", type=int, default=256, help="stored image side (px)")
    ap.add_argument("--memory-workers", type=int, default=None, help="default: the example's")
    ap.add_argument("--memory-batch", type=int, default=64)
    ap.add_argument("--sample-s", type=float, default=0.1, help="memory sampling interval")
    ap.add_argument("--no-files", action="store_true", help="no PNG, no copy in bench/out/")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    example = yaml.safe_load(EXAMPLE.read_text())
    if args.rounds is None:
        args.rounds = 3 if args.quick else 10
    if args.turn_steps is None:
        args.turn_steps = 30 if args.quick else 40
    if args.warmup_steps is None:
        args.warmup_steps = 10 if args.quick else 23
    if args.budget_mib is None:
        args.budget_mib = 256.0 if args.quick else 1024.0
    if args.memory_workers is None:
        args.memory_workers = int(example["data"].get("loader_workers", 2))
    if args.threads is None:
        args.threads = parse_spec(example).runtime.threads_per_worker
    args.workdir = args.workdir.resolve()
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    pin_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="data-loading-") as scratch:
        if args.memory_child:
            memory_child(args, Path(scratch))
            return
        parts = {p.strip() for p in args.parts.split(",") if p.strip()}
        unknown = parts - {"throughput", "memory"}
        if unknown:
            raise SystemExit(f"--parts: unknown {', '.join(sorted(unknown))}")
        args.workdir.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {"benchmark": "data_loading", "quick": args.quick}
        if "throughput" in parts:
            _process_group(Path(scratch))
            result["throughput"] = measure_throughput(args, Path(scratch))
        if "memory" in parts:
            result["memory"] = measure_memory(args)
        result["environment"] = environment()
        if dist.is_initialized():
            dist.destroy_process_group()
    if not args.no_files:
        _plot(result, out_dir() / "data_loading.png")
    result.get("memory", {}).pop("timeline", None)
    result = _rounded(result)
    emit(result, save_as=None if args.no_files else "data_loading.json")


if __name__ == "__main__":
    main()
