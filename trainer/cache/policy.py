"""When AutoCache is used (`CachePolicy`, `decide_cache`, `CacheDecision`) and where its memory
tier lives (`choose_memory`).

The cache is used only where it is cheaper than recomputation, measured on the machine
(`trainer.cache.timing`), and never with data augmentation: a cached row is only valid for the
same input tensor, and random augmentation makes the inputs, hence the prefix outputs, different
every epoch, so a cached row would silently replay one augmented view forever (the job spec
exposes `cache: off | auto | on`, and augmentation forces `off`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch

from pipetransformer.trainer.cache.memory import MemoryTier
from pipetransformer.trainer.cache.prefix import PrefixRunner
from pipetransformer.trainer.cache.timing import PrefixCosts, measure_prefix_costs

CacheMode = Literal["off", "auto", "on"]


def choose_memory(
    device: torch.device | str, ram_bytes: int, free_device_bytes: int | None
) -> MemoryTier:
    """Where the memory tier of a cache serving `device` should live (`ActivationCache`'s
    `memory`): `host` on the CPU (and any non-CUDA device); on CUDA, `device` when the tier
    (`ram_bytes`: pass the size it will really take, at most num_samples x row bytes) fits in
    half of `free_device_bytes` (e.g. `torch.cuda.mem_get_info(device)[0]`), leaving the other
    half to training, else `pinned` (also when the free memory is unknown)."""
    if torch.device(device).type != "cuda":
        return "host"
    if free_device_bytes is not None and 0 <= ram_bytes <= free_device_bytes // 2:
        return "device"
    return "pinned"


@dataclass(frozen=True)
class CachePolicy:
    """When the cache is used. `mode` mirrors the job spec's `cache: off | auto | on`:

    - `off`: never.
    - `on`: whenever blocks are frozen.
    - `auto` (default): where measured cheaper, i.e. lookup time x `min_speedup` <= recompute time.

    `augmentation=True` (random data augmentation: inputs differ every epoch, so cached outputs
    would be wrong) forces the cache off; asking for `on` with augmentation is an error."""

    mode: CacheMode = "auto"
    augmentation: bool = False
    min_speedup: float = 1.2

    def __post_init__(self) -> None:
        if self.mode not in ("off", "auto", "on"):
            raise ValueError(f"cache must be one of off, auto, on (got {self.mode!r})")
        if self.mode == "on" and self.augmentation:
            raise ValueError(
                "cache: on is invalid with data augmentation (augmented inputs differ every "
                "epoch, so cached frozen-prefix outputs would be wrong); use cache: off or auto"
            )
        if not self.min_speedup > 0:
            raise ValueError(f"min_speedup must be > 0 (got {self.min_speedup})")

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and not self.augmentation

    def should_use_cache(self, measured_compute_s: float, measured_lookup_s: float) -> bool:
        """Whether to serve the frozen prefix from the cache, given the measured time per batch
        to recompute it and to read it from the cache."""
        if not self.enabled:
            return False
        if self.mode == "on":
            return True
        return measured_lookup_s * self.min_speedup <= measured_compute_s


@dataclass(frozen=True)
class CacheDecision:
    use: bool
    reason: str  # for the worker's events and logs
    costs: PrefixCosts | None = None
    directory: str | None = None  # where the disk tier was measured (None: the system's temp)
    ram_fraction: float | None = None  # share of rows the RAM tier holds, as assumed

    def as_dict(self) -> dict:
        return {
            "use": self.use,
            "reason": self.reason,
            "costs": asdict(self.costs) if self.costs else None,
            "directory": self.directory,
            "ram_fraction": self.ram_fraction,
        }


def decide_cache(
    policy: CachePolicy,
    prefix: PrefixRunner,
    inputs: torch.Tensor,
    boundary: int,
    *,
    directory: str | Path | None = None,
    ram_fraction: float = 1.0,
    repeats: int = 7,
    memory: MemoryTier = "host",
    device: torch.device | str | None = None,
    lookups: PrefixCosts | None = None,
) -> CacheDecision:
    """Whether the first stage's rank should serve blocks [0, boundary) from the cache for
    batches like `inputs`. `off`/augmentation: no (nothing measured); `on`: yes; `auto`: measure
    (`measure_prefix_costs`) and compare recomputation with the expected lookup time at
    `ram_fraction` (`ActivationCache.ram_fraction`), the file part read cold, with the cache's
    `memory` tier serving `device`. `lookups`: what an earlier measurement of the same cache at
    the same batch size found for serving and storing rows (only recomputation is measured
    again; see `measure_prefix_costs`)."""
    if not policy.enabled:
        why = "data augmentation makes cached outputs invalid" if policy.augmentation else "off"
        return CacheDecision(False, f"cache off: {why}")
    if policy.mode == "on":
        return CacheDecision(True, "cache on (spec)")
    costs = measure_prefix_costs(
        prefix,
        inputs,
        boundary,
        directory=directory,
        repeats=repeats,
        memory=memory,
        device=device,
        lookups=lookups,
        files=ram_fraction < 1.0,  # a memory tier holding every row never reads the files
    )
    lookup = costs.lookup_s(ram_fraction)
    use = policy.should_use_cache(costs.compute_s, lookup)
    reason = (
        f"measured at F={boundary}, batch {costs.batch_size}: recompute "
        f"{costs.compute_s * 1e3:.2f} ms vs cache {lookup * 1e3:.2f} ms with "
        f"{ram_fraction:.0%} of rows in RAM ({costs.speedup(ram_fraction):.1f}x; needs "
        f"{policy.min_speedup}x)"
    )
    where = None if directory is None else str(directory)
    return CacheDecision(use, reason, costs, where, ram_fraction)
