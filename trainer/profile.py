"""Measured per-block profiles for the AutoPipe planner (the planner's only I/O edge).

A short profiling pass runs the real model's units (`models.units.initial_units`: the embedding,
each block, the head, one on the device at a time) on the training device (the rank's own:
profiling the GPU while training on the CPU, or the reverse, would plan for the wrong machine) at
the job's precision, for one micro-batch of a given size: forward and backward time (median
over repeats after warm-up; each sample averages enough calls to be well above the timer's
resolution; CUDA events on a GPU, which time the kernels rather than their launch), bytes of the
unit's output (what crosses a cut after it), parameter bytes, and the bytes autograd saves for
backward (counted with `torch.autograd.graph.saved_tensors_hooks`, one count per storage,
parameters excluded). Blocks of identical shape have their times pooled (the median over the
group), so timer noise cannot decide between equivalent cuts.

Measurements are stored as JSON per (model spec, device name and threads, precision, micro-batch
size, torch version) under `profile_cache_dir()` (`$PIPETRANSFORMER_CACHE/profiles`, default
`~/.cache/pipetransformer/profiles`; not AutoCache's activation cache) and reused: measuring is
cheap but not free, and its answer is specific to the hardware it ran on.

`measured_layout` is the workers' planning call: it measures at every micro-batch size that
`core.planner.profile_sizes` names and plans with `core.planner.plan_layout`. Several sizes
are measured, not scaled from one: small models carry a large fixed cost per micro-batch (kernel
launches, Python dispatch), so splitting a batch finer does not shrink a micro-batch's time in
proportion, and the bubble-versus-overhead trade-off `(m + S - 1) * T(b = B/m)` has to be read
off measurements at each candidate size.
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

from pipetransformer.core import planner
from pipetransformer.core.partition import BlockProfile, Profile
from pipetransformer.core.planner import Planned
from pipetransformer.core.spec import JobSpec, ModelSpec
from pipetransformer.core.state import Layout
from pipetransformer.models.stage import Precision, autocast, to_weights_dtype, weights_dtype
from pipetransformer.models.units import example_input, initial_units
from pipetransformer.trainer.device import synchronize

PROFILE_FORMAT = 4  # bump when what is measured changes, so old stored profiles are not reused
_MIN_SAMPLE_S = 2e-3  # a timing sample averages calls until it lasts about this long


def profile_cache_dir() -> Path:
    """Where measured profiles are stored for reuse: `$PIPETRANSFORMER_CACHE/profiles`, default
    `~/.cache/pipetransformer/profiles`."""
    root = os.environ.get("PIPETRANSFORMER_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "pipetransformer"
    return base / "profiles"


def _device(device: str | torch.device | None) -> torch.device:
    # the CPU unless told: a worker passes its training device (never "whatever is present")
    return torch.device("cpu") if device is None else torch.device(device)


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


def profile_key(
    model_spec: ModelSpec,
    microbatch: int,
    device: str | torch.device | None,
    precision: Precision = "fp32",
) -> str:
    """Hash of everything a profile depends on."""
    ident = {
        "format": PROFILE_FORMAT,
        "model": model_spec.model_dump(mode="json"),
        "device": device_name(device),
        "precision": precision,
        "microbatch": microbatch,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _example_input(spec: ModelSpec, batch: int, dev: torch.device) -> torch.Tensor:
    return example_input(spec, batch, torch.Generator().manual_seed(0)).to(dev)


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


class _Clock:
    """Elapsed seconds between marks: CUDA events on a GPU (the kernels' time, read once the
    device is idle), the wall clock around a synchronisation on the CPU."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.dev = dev

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def between(self, a: object, b: object) -> float:
        if self.cuda:
            b.synchronize()  # type: ignore[attr-defined]
            return a.elapsed_time(b) / 1e3  # type: ignore[attr-defined]
        return b - a  # type: ignore[operator]


def _measure_unit(
    module: nn.Module,
    inp: torch.Tensor,
    dev: torch.device,
    repeats: int,
    warmup: int,
    input_grad: bool = True,
    precision: Precision = "fp32",
) -> tuple[BlockProfile, torch.Tensor]:
    """Forward/backward medians of one unit on `inp`; returns its profile and its output.
    `input_grad`: whether backward also computes the input's gradient (a block's input is an
    activation that earlier units need a gradient for; the model's raw input is not)."""

    def fresh_input() -> torch.Tensor:
        return inp.detach().requires_grad_(True) if input_grad else inp

    def forward(x: torch.Tensor) -> torch.Tensor:
        with autocast(dev, precision):  # as StageModule runs it
            return module(to_weights_dtype(x, precision)).float()

    out, act_bytes = _saved_bytes(module, lambda: forward(fresh_input()))
    grad = torch.randn_like(out)
    out_bytes = out.numel() * out.element_size()
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())

    clock = _Clock(dev)

    def once() -> tuple[float, float]:
        x = fresh_input()
        synchronize(dev)
        t0 = clock.mark()
        y = forward(x)
        t1 = clock.mark()
        if y.requires_grad:  # else nothing here trains (a frozen embedding under adapters)
            y.backward(grad)
        t2 = clock.mark()
        # a training step starts from no gradients, so the backward allocates them every time
        module.zero_grad(set_to_none=True)
        return clock.between(t0, t1), clock.between(t1, t2)

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
    spec: ModelSpec,
    microbatch: int,
    dev: torch.device,
    repeats: int,
    warmup: int,
    seed: int,
    precision: Precision = "fp32",
) -> Profile:
    def unit(name: str) -> nn.Module:
        # one unit on the device at a time (the weights `build_model` gives it): the planning
        # rank measures beside its own training state, and the whole model need not fit
        # (in the parameters' dtype the job computes with: bf16 under `bf16-weights`)
        built = initial_units(spec, seed, [name])[name]
        return built.to(dev, weights_dtype(precision)).train()

    x = _example_input(spec, microbatch, dev)
    kw = {"repeats": repeats, "warmup": warmup, "precision": precision}
    embed, h = _measure_unit(unit("embed"), x, dev, input_grad=False, **kw)
    blocks = []
    for i in range(spec.depth):
        # chain real activations through, so each block sees the values it would in training
        prof, h = _measure_unit(unit(f"blocks.{i}"), h, dev, **kw)
        blocks.append(prof)
    head, _ = _measure_unit(unit("head"), h, dev, **kw)
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
    *,
    reuse: bool = True,
    repeats: int = 7,
    warmup: int = 2,
    seed: int = 0,
    profile_dir: str | Path | None = None,
    precision: Precision = "fp32",
) -> Profile:
    """The model's per-unit profile at micro-batch size `microbatch` on `device` (default: the
    CPU) at `precision`, reusing a stored measurement when there is one (`reuse=False` neither
    reads nor stores one; `profile_dir` overrides `profile_cache_dir()`)."""
    if microbatch < 1:
        raise ValueError(f"micro-batch size must be positive, got {microbatch}")
    dev = _device(device)
    folder = Path(profile_dir) if profile_dir is not None else profile_cache_dir()
    key = profile_key(model_spec, microbatch, dev, precision)
    path = folder / f"{model_spec.family}-d{model_spec.depth}-b{microbatch}-{key[:20]}.json"
    if reuse and path.is_file():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return Profile.from_dict(data["profile"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a torn or stale entry: measure again and overwrite it
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        prof = _measure(model_spec, microbatch, dev, repeats, warmup, seed, precision)
    if reuse:
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
    *,
    reuse: bool = True,
    repeats: int = 7,
    warmup: int = 2,
    seed: int = 0,
    profile_dir: str | Path | None = None,
    precision: Precision = "fp32",
) -> dict[int, Profile]:
    """Profiles at several micro-batch sizes, keyed by size."""
    return {
        b: measure_profile(
            model_spec,
            b,
            device,
            reuse=reuse,
            repeats=repeats,
            warmup=warmup,
            seed=seed,
            profile_dir=profile_dir,
            precision=precision,
        )
        for b in sorted(set(microbatches))
    }


def measured_layout(
    spec: JobSpec,
    *,
    world: int | None = None,
    boundary: int = 0,
    current: Layout,
    device: str | torch.device | None = None,
) -> Planned:
    """`core.planner.plan_layout` from measurement on `device` (the planning rank's training
    device; default the CPU) at the job's precision: measures the model at the
    micro-batch sizes `planner.profile_sizes` names (stored measurements reused), then plans.
    At start-up (`boundary` 0, `world` the spec's) S and R stay the spec's; otherwise (after a
    freeze, or in a re-formed world) `freeze.relayout` says what is searched: S' x R' = `world`
    ('elastic'), the current R ('repartition'), or nothing, measuring nothing ('off': the
    stages stay). See core.planner."""
    sizes = planner.profile_sizes(spec, world=world, boundary=boundary, current=current)
    profiles = (
        measure_profiles(spec.model, sizes, device, precision=spec.training.precision)
        if sizes
        else {}
    )
    return planner.plan_layout(
        spec, world=world, boundary=boundary, current=current, profiles=profiles
    )
