"""How much AutoCache saves, measured on the machine (`measure_prefix_costs`, `PrefixCosts`):
the frozen prefix's recomputation against lookups from the memory tier and from the files (page
cache warm and cold), side by side.
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pipetransformer.trainer.cache.memory import MemoryTier
from pipetransformer.trainer.cache.prefix import PrefixRunner
from pipetransformer.trainer.cache.storage import ActivationCache
from pipetransformer.trainer.device import synchronize


@dataclass(frozen=True)
class PrefixCosts:
    """Measured time per batch (medians, seconds) of the frozen prefix at `boundary`: recomputing
    it, serving it from the cache with every row in RAM, every row in the files with the page
    cache warm, and cold (read from the device), and storing a batch. The files are None when
    they were not measured (a cache whose memory tier holds every row never reads them)."""

    boundary: int
    batch_size: int
    compute_s: float
    ram_s: float
    disk_warm_s: float | None
    disk_s: float | None
    store_s: float

    def lookup_s(self, ram_fraction: float = 1.0, cold: bool = True) -> float:
        """Expected lookup time of a batch when `ram_fraction` of the rows are in RAM."""
        f = min(max(ram_fraction, 0.0), 1.0)
        if f == 1.0:
            return self.ram_s
        disk = self.disk_s if cold else self.disk_warm_s
        if disk is None:
            raise ValueError("the files were not measured: only a share of 1.0 in RAM is known")
        return f * self.ram_s + (1 - f) * disk

    def speedup(self, ram_fraction: float = 1.0, cold: bool = True) -> float:
        lookup = self.lookup_s(ram_fraction, cold)
        return self.compute_s / lookup if lookup > 0 else math.inf


def measure_prefix_costs(
    prefix: PrefixRunner,
    inputs: torch.Tensor,
    boundary: int,
    *,
    directory: str | Path | None = None,
    repeats: int = 7,
    pool_batches: int = 8,
    memory: MemoryTier = "host",
    device: torch.device | str | None = None,
    lookups: PrefixCosts | None = None,
    files: bool = True,
) -> PrefixCosts:
    """Time, side by side (interleaved repeats, medians), the prefix work of one training batch
    (`inputs`, whose length is the batch size) at `boundary`: recomputation vs a cache hit from
    RAM, from the files (warm page cache) and from the files after evicting the page cache.

    A scratch cache of `pool_batches` x batch rows (the outputs of `inputs`, tiled) is made in a
    temporary folder under `directory` (the real cache's file system: that is what is measured)
    and removed afterwards; each repeat reads a random batch of its rows. `memory` and `device`
    are the real cache's (`ActivationCache`), so the memory tier measured is the one it uses;
    rows are served to `device` (default: the inputs' device).

    `lookups`: an earlier measurement of the same cache at the same batch size. Serving and
    storing a row costs the same whatever the boundary (rows have one shape), so only the
    recomputation is measured and the rest is taken from it: no scratch files are written.
    `files=False`: the cache's memory tier holds every row, so its files are never read and
    are not measured (`disk_s` and `disk_warm_s` are None)."""
    with torch.no_grad():
        out = prefix.compute(inputs, boundary)
    b = len(inputs)
    if lookups is not None:
        if lookups.batch_size != b:
            raise ValueError(f"lookups were measured at batch {lookups.batch_size}, not {b}")
        return replace(
            lookups,
            boundary=boundary,
            compute_s=_median_time(lambda: prefix.compute(inputs, boundary), out.device, repeats),
        )
    tokens, dim = out.shape[1], out.shape[2]
    pool_batches = max(1, pool_batches)
    pool = b * pool_batches
    # rows are stored from where they come: a device tier without files takes them on the
    # device (tiling them on the host would time a host copy the job never makes)
    home = out.device if memory == "device" and not files else torch.device("cpu")
    tiled = out.to(home).repeat((pool_batches, 1, 1))
    fps = [f"measure-{k}" for k in range(boundary + 1)]
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="cache-measure-", dir=directory)
    rng = np.random.default_rng(0)
    try:
        kw = dict(dtype=out.dtype, shared=False, memory=memory, device=device)
        ram = ActivationCache(Path(scratch) / "ram", pool, tokens, dim, ram_bytes=1 << 62, **kw)
        caches = [ram]
        if files:
            disk = ActivationCache(Path(scratch) / "disk", pool, tokens, dim, ram_bytes=0, **kw)
            caches.append(disk)
        for c in caches:
            c.set_boundary(boundary, fps)
        all_idx = np.arange(pool)
        t_store = []
        for k in range(pool_batches):
            sel = all_idx[k * b : (k + 1) * b]
            for c in caches:  # the time of the last: the files where they are measured
                t0 = time.perf_counter()
                c.store(sel, tiled[sel])
                took = time.perf_counter() - t0
            t_store.append(took)
        times: dict[str, list[float]] = {"compute": [], "ram": [], "warm": [], "cold": []}

        def timed(fn) -> float:
            return _timed(fn, out.device)

        for _ in range(max(1, repeats)):
            sel = rng.choice(pool, size=b, replace=False)
            times["compute"].append(timed(lambda: prefix.compute(inputs, boundary)))
            times["ram"].append(timed(lambda s=sel: ram.get_or_compute(s, inputs, prefix)))
            if not files:
                continue
            times["warm"].append(timed(lambda s=sel: disk.get_or_compute(s, inputs, prefix)))
            disk.drop_page_cache()
            sel = rng.choice(pool, size=b, replace=False)
            times["cold"].append(timed(lambda s=sel: disk.get_or_compute(s, inputs, prefix)))
        for c in caches:
            if c.stats().misses:  # every read above must have been a hit
                raise RuntimeError("cache measurement saw misses")
            c.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = statistics.median
    return PrefixCosts(
        boundary=boundary,
        batch_size=b,
        compute_s=med(times["compute"]),
        ram_s=med(times["ram"]),
        disk_warm_s=med(times["warm"]) if files else None,
        disk_s=med(times["cold"]) if files else None,
        store_s=med(t_store),
    )


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    # without the syncs, recompute on a GPU would time only its kernel launches
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def _median_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    with torch.no_grad():
        return statistics.median(_timed(fn, device) for _ in range(max(1, repeats)))
