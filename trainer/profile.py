"""Measured per-block profiles for the AutoPipe planner, and the micro-batch count chosen from them.

A short profiling pass runs the real model (`trainer.models.build_model`) on the current device,
one unit at a time (the embedding, each block, the head), for one micro-batch of a given size:
forward and backward time (median over repeats after warm-up; each sample averages enough calls
to be well above the timer's resolution), bytes of the unit's output (what crosses a cut after
it), parameter bytes, and the bytes autograd saves for backward (counted with
`torch.autograd.graph.saved_tensors_hooks`, one count per storage, parameters excluded). Blocks of
identical shape have their times pooled (the median over the group), so timer noise cannot
decide between equivalent cuts.

Profiles are cached as JSON per (model spec, device name and threads, micro-batch size, torch
version) under `$PIPETRANSFORMER_CACHE/profiles` (default `~/.cache/pipetransformer/profiles`):
measuring is cheap but not free, and its answer is specific to the hardware it ran on.

The micro-batch count is measured too, not tabled: small models carry a large fixed cost per
micro-batch (kernel launches, Python dispatch), so splitting a batch finer does not shrink a
micro-batch's time in proportion, and the bubble-versus-overhead trade-off
`(m + S - 1) * T(b = B/m)` has to be read off measurements at each candidate size.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from orchestrator.spec import JobSpec, ModelSpec
from orchestrator.state import Layout
from trainer.models import build_model, model_input_shape
from trainer.partition import (
    BlockProfile,
    Plan,
    PlanError,
    Profile,
    microbatch_candidates,
    plan,
)

PROFILE_FORMAT = 3  # bump when what is measured changes, so old cache entries are not reused
_MIN_SAMPLE_S = 2e-3  # a timing sample averages calls until it lasts about this long


def cache_dir() -> Path:
    """Where profiles are cached: `$PIPETRANSFORMER_CACHE/profiles`, default
    `~/.cache/pipetransformer/profiles`."""
    root = os.environ.get("PIPETRANSFORMER_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "pipetransformer"
    return base / "profiles"


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def device_name(device: str | torch.device | None = None) -> str:
    """A name for the hardware a profile was measured on (threads included on CPU, as they
    change the times)."""
    dev = _device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{cpu}:{torch.get_num_threads()}threads"


def cache_key(model_spec: ModelSpec, microbatch: int, device: str | torch.device | None) -> str:
    """Hash of everything a profile depends on."""
    ident = {
        "format": PROFILE_FORMAT,
        "model": model_spec.model_dump(mode="json"),
        "device": device_name(device),
        "microbatch": microbatch,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def synchronize(dev: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs kernels asynchronously), so a timer read
    afterwards covers it; a no-op on the CPU."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _example_input(spec: ModelSpec, batch: int, dev: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    shape = model_input_shape(spec, batch)
    if spec.family == "bert":
        return torch.randint(0, spec.vocab_size or 2, shape, generator=gen).to(dev)
    return torch.randn(shape, generator=gen).to(dev)


def _saved_bytes(module: nn.Module, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run `run()` counting the bytes autograd saves for backward: one count per storage, and
    not the module's own parameters (they are weights, already counted as such)."""
    param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_storages:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(seen.values())


def _measure_unit(
    module: nn.Module,
    inp: torch.Tensor,
    dev: torch.device,
    repeats: int,
    warmup: int,
    input_grad: bool = True,
) -> tuple[BlockProfile, torch.Tensor]:
    """Forward/backward medians of one unit on `inp`; returns its profile and its output.
    `input_grad`: whether backward also computes the input's gradient (a block's input is an
    activation that earlier units need a gradient for; the model's raw input is not)."""

    def fresh_input() -> torch.Tensor:
        return inp.detach().requires_grad_(True) if input_grad else inp

    out, act_bytes = _saved_bytes(module, lambda: module(fresh_input()))
    grad = torch.randn_like(out)
    out_bytes = out.numel() * out.element_size()
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())

    def once() -> tuple[float, float]:
        x = fresh_input()
        synchronize(dev)
        t0 = time.perf_counter()
        y = module(x)
        synchronize(dev)
        t1 = time.perf_counter()
        y.backward(grad)
        synchronize(dev)
        t2 = time.perf_counter()
        # a training step starts from no gradients, so the backward allocates them every time
        module.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1

    for _ in range(max(1, warmup)):
        once()
    f, b = once()
    inner = max(1, min(200, math.ceil(_MIN_SAMPLE_S / max(f + b, 1e-7))))
    fwd, bwd = [], []
    for _ in range(max(1, repeats)):
        fs, bs = zip(*(once() for _ in range(inner)), strict=True)
        fwd.append(sum(fs) / inner)
        bwd.append(sum(bs) / inner)
    prof = BlockProfile(
        forward_s=statistics.median(fwd),
        backward_s=statistics.median(bwd),
        output_bytes=out_bytes,
        param_bytes=param_bytes,
        activation_bytes=act_bytes,
    )
    return prof, out.detach()


def _measure(
    spec: ModelSpec, microbatch: int, dev: torch.device, repeats: int, warmup: int, seed: int
) -> Profile:
    model = build_model(spec, seed).to(dev).train()
    x = _example_input(spec, microbatch, dev)
    embed, h = _measure_unit(model.embed, x, dev, repeats, warmup, input_grad=False)
    blocks = []
    for i in range(spec.depth):
        # chain real activations through, so each block sees the values it would in training
        prof, h = _measure_unit(model.blocks[str(i)], h, dev, repeats, warmup)
        blocks.append(prof)
    head, _ = _measure_unit(model.head, h, dev, repeats, warmup)
    return Profile(_pool_identical(blocks), embed, head, microbatch, device_name(dev))


def _pool_identical(blocks: list[BlockProfile]) -> tuple[BlockProfile, ...]:
    """Blocks of identical shape (same parameter, output and saved-activation bytes) do the same
    work, so their times are pooled: each gets the median over the group. Without this, the
    planner would place cuts by timer noise between twins (a 2% jitter decides which of two
    equivalent splits "wins"); with it, twins tie and the tie-breaking rule decides."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for j, b in enumerate(blocks):
        groups.setdefault((b.param_bytes, b.output_bytes, b.activation_bytes), []).append(j)
    out = list(blocks)
    for members in groups.values():
        if len(members) > 1:
            fwd = statistics.median(blocks[j].forward_s for j in members)
            bwd = statistics.median(blocks[j].backward_s for j in members)
            for j in members:
                out[j] = replace(blocks[j], forward_s=fwd, backward_s=bwd)
    return tuple(out)


def measure_profile(
    model_spec: ModelSpec,
    microbatch: int,
    device: str | torch.device | None = None,
    cache: bool = True,
    *,
    repeats: int = 7,
    warmup: int = 2,
    seed: int = 0,
    cache_path: str | Path | None = None,
) -> Profile:
    """The model's per-unit profile at micro-batch size `microbatch` on `device` (cuda if
    available, else cpu), from the cache when present (`cache=False` neither reads nor writes
    it; `cache_path` overrides `cache_dir()`)."""
    if microbatch < 1:
        raise ValueError(f"micro-batch size must be positive, got {microbatch}")
    dev = _device(device)
    folder = Path(cache_path) if cache_path is not None else cache_dir()
    key = cache_key(model_spec, microbatch, dev)
    path = folder / f"{model_spec.family}-d{model_spec.depth}-b{microbatch}-{key[:20]}.json"
    if cache and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return Profile.from_dict(data["profile"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a torn or stale entry: measure again and overwrite it
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        prof = _measure(model_spec, microbatch, dev, repeats, warmup, seed)
    if cache:
        folder.mkdir(parents=True, exist_ok=True)
        payload = {"key": key, "torch": torch.__version__, "profile": prof.to_dict()}
        # write-then-rename, so a concurrent reader never sees half a file
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=1)
        os.replace(tmp, path)
    return prof


def measure_profiles(
    model_spec: ModelSpec,
    microbatches: Iterable[int],
    device: str | torch.device | None = None,
    cache: bool = True,
    *,
    repeats: int = 7,
    warmup: int = 2,
    seed: int = 0,
    cache_path: str | Path | None = None,
) -> dict[int, Profile]:
    """Profiles at several micro-batch sizes, keyed by size."""
    return {
        b: measure_profile(
            model_spec,
            b,
            device,
            cache,
            repeats=repeats,
            warmup=warmup,
            seed=seed,
            cache_path=cache_path,
        )
        for b in sorted(set(microbatches))
    }


def choose_microbatches(
    model_spec: ModelSpec,
    stages: int,
    replica_batch: int,
    *,
    replicas: int = 1,
    freeze_boundary: int = 0,
    cached: bool = False,
    memory_cap: float = math.inf,
    bandwidth: float = math.inf,
    schedule: str = "gpipe",
    recompute: bool = False,
    profiles: dict[int, Profile] | None = None,
    device: str | torch.device | None = None,
    cache: bool = True,
    cache_path: str | Path | None = None,
) -> int:
    """The micro-batch count m for S = `stages` with the lowest predicted step time
    `(m + S - 1) * T(b) + all-reduce`, where T(b) is the planner's bottleneck stage time measured
    at micro-batch size b = replica_batch / m. Candidates: the divisors of `replica_batch` in
    [S, 6S] (PipeTransformer's range), all divisors if none lies there. Missing sizes are
    measured (and cached); `profiles` supplies measurements keyed by micro-batch size."""
    candidates = microbatch_candidates(stages, replica_batch)
    sizes = {replica_batch // m for m in candidates}
    measured = dict(profiles or {})
    missing = sizes - set(measured)
    if missing:
        measured.update(measure_profiles(model_spec, missing, device, cache, cache_path=cache_path))
    best = plan(
        {b: measured[b] for b in sizes},
        devices=stages * replicas,
        global_batch=replica_batch * replicas,
        freeze_boundary=freeze_boundary,
        cached=cached,
        memory_cap=memory_cap,
        bandwidth=bandwidth,
        microbatches=candidates,
        stages=stages,
        replicas=replicas,
        schedule=schedule,
        recompute=recompute,
    )
    return best.microbatches


def measured_plan(
    model_spec: ModelSpec,
    devices: int,
    global_batch: int,
    *,
    freeze_boundary: int = 0,
    cached: bool = False,
    memory_cap: float = math.inf,
    bandwidth: float = math.inf,
    stages: int | None = None,
    replicas: int | None = None,
    schedule: str = "gpipe",
    recompute: bool = False,
    device: str | torch.device | None = None,
    cache: bool = True,
    cache_path: str | Path | None = None,
    repeats: int = 7,
) -> Plan:
    """AutoPipe end to end: measure the model at every micro-batch size the search can reach
    (S x R <= devices, m in [S, 6S]), then plan (S, R, m and the partition) on those
    measurements."""
    L = model_spec.depth
    stage_opts = [stages] if stages else list(range(1, min(devices, L) + 1))
    sizes: set[int] = set()
    for S in stage_opts:
        rep_opts = [replicas] if replicas else list(range(1, devices // S + 1))
        for R in rep_opts:
            if global_batch % R:
                continue
            sizes |= {global_batch // R // m for m in microbatch_candidates(S, global_batch // R)}
    if not sizes:
        raise PlanError(
            f"no replica count divides global batch {global_batch} on {devices} devices"
        )
    profiles = measure_profiles(
        model_spec, sizes, device, cache, repeats=repeats, cache_path=cache_path
    )
    return plan(
        profiles,
        devices=devices,
        global_batch=global_batch,
        freeze_boundary=freeze_boundary,
        cached=cached,
        memory_cap=memory_cap,
        bandwidth=bandwidth,
        stages=stages,
        replicas=replicas,
        schedule=schedule,
        recompute=recompute,
    )


def autopipe_layout(spec: JobSpec, layout: Layout) -> tuple[Layout, str]:
    """The layout a job should run with, planned from measurement on this device: AutoPipe's
    partition when `parallel.partition` is 'autopipe', and the micro-batch count when
    `parallel.microbatches` is 'auto' (otherwise the spec's value and the current cuts hold).
    S and R stay the spec's (the launched world). Returns the next layout version and a
    one-line reason for the record."""
    p = spec.parallel
    replica_batch = spec.training.global_batch_size // p.replicas
    counts = (
        microbatch_candidates(p.stages, replica_batch)
        if p.microbatches == "auto"
        else [p.microbatches]
    )
    profiles = measure_profiles(spec.model, {replica_batch // m for m in counts})
    keep_cuts = None if p.partition == "autopipe" else [s.start for s in layout.stages[1:]]
    best = plan(
        profiles,
        devices=p.world_size,
        global_batch=spec.training.global_batch_size,
        freeze_boundary=layout.freeze_boundary,
        microbatches=counts,
        stages=p.stages,
        replicas=p.replicas,
        schedule=p.schedule,
        recompute=p.recomputes_any,
        allowed_cuts=keep_cuts,
    )
    new = best.to_layout(version=layout.version + 1, schedule=p.schedule)
    new = new.model_copy(update={"planner": "autopipe"})
    return new, f"autopipe: {best.summary()}"


def relayout_plan(
    spec: JobSpec, layout: Layout, freeze_boundary: int, world: int
) -> tuple[Layout, str]:
    """AutoPipe + AutoDP after freezing: the frozen prefix [0, F) leaves the pipeline (it runs
    forward-only before the first stage, or comes from the cache), the active blocks are packed
    onto S' stages and the freed ranks become replicas, S' x R' = `world`. Every S' dividing the
    world is planned on the measured profile (cuts only after F, so stage 0 starts at F) and the
    fastest predicted one wins. Returns the next layout version and the reason for the record."""
    p, L, f = spec.parallel, spec.model.depth, freeze_boundary
    gb = spec.training.global_batch_size
    shapes = [
        (s, world // s)
        for s in range(1, world + 1)
        if world % s == 0 and s <= L - f and gb % (world // s) == 0
    ]
    if not shapes:
        raise PlanError(f"no stages x replicas = {world} fits {L - f} active blocks and batch {gb}")
    counts: dict[tuple[int, int], list[int]] = {}
    for s, r in shapes:
        fixed = p.microbatches != "auto" and (gb // r) % p.microbatches == 0
        counts[(s, r)] = [p.microbatches] if fixed else microbatch_candidates(s, gb // r)
    sizes = {gb // r // m for (s, r), ms in counts.items() for m in ms}
    profiles = measure_profiles(spec.model, sizes)
    plans = []
    for (s, r), ms in counts.items():
        plans.append(
            plan(
                {b: profiles[b] for b in {gb // r // m for m in ms}},
                devices=world,
                global_batch=gb,
                freeze_boundary=f,
                microbatches=ms,
                stages=s,
                replicas=r,
                schedule=p.schedule,
                recompute=p.recomputes_any,
                allowed_cuts=range(f + 1, L),
            )
        )
    best = min(plans, key=lambda pl: (pl.step_time_s, pl.stages))
    ranges = [(max(a, f), b) for a, b in best.ranges]  # frozen blocks leave the pipeline
    new = Layout.build(
        ranges,
        num_blocks=L,
        replicas=best.replicas,
        microbatches=best.microbatches,
        schedule=p.schedule,
        version=layout.version + 1,
        freeze_boundary=f,
        planner="autopipe",
    )
    return new, f"F={f}: {best.summary()}"
