"""AutoCache's storage (`ActivationCache`): one row `[tokens, dim]` per training sample (keyed by
the sample's index in the train split) for the current boundary F, in a memory tier
(`trainer.cache.memory`: rows 0 .. ram_rows-1, bounded by `ram_bytes`) over the node's shared
files (`trainer.cache.files`).

`get_or_compute` serves a batch: hits from the cache, misses advanced incrementally from the
previous boundary's cached rows when they exist (running only blocks [F_old, F)), otherwise
computed from the inputs; misses are stored. Validity and concurrency: the package docstring
(trainer/cache/__init__.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipetransformer.core.spec import ModelSpec
from pipetransformer.trainer.cache.files import FileTier, Level
from pipetransformer.trainer.cache.memory import (
    CURRENT,
    DEFAULT_RAM_BYTES,
    SOURCE,
    MemoryRows,
    MemoryTier,
    as_index,
    on,
    resolve_memory,
)
from pipetransformer.trainer.cache.prefix import PrefixRunner
from pipetransformer.trainer.cache.stats import CacheStats

if TYPE_CHECKING:
    from pipetransformer.trainer.cache.policy import CacheDecision, CachePolicy
    from pipetransformer.trainer.cache.timing import PrefixCosts

Indices = torch.Tensor | np.ndarray | Sequence[int]


def _sizes(
    num_samples: int, row_bytes: int, ram_bytes: int, disk_bytes: int | None, shared: bool
) -> tuple[int, int]:
    """(rows in the memory tier, rows that can be cached at all) for these budgets."""
    ram_rows = min(num_samples, ram_bytes // row_bytes)
    if shared:
        capacity = num_samples if disk_bytes is None else min(num_samples, disk_bytes // row_bytes)
        ram_rows = min(ram_rows, capacity)  # RAM rows are written through to the files
    else:
        spill = num_samples - ram_rows
        disk_rows = spill if disk_bytes is None else min(spill, disk_bytes // row_bytes)
        capacity = ram_rows + disk_rows
    return ram_rows, capacity


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.2f} GiB"


class ActivationCache:
    """Frozen-prefix outputs per training sample, for the current boundary F.

    Rows are `[tokens, dim]` tensors of `dtype` (the prefix's output dtype, float32 under either
    precision; stored bit for bit, never converted). Sample `i` lives in row `i`:

    - Memory tier: rows `0 .. ram_rows-1` in a tensor of this process, `ram_rows = ram_bytes //
      row_bytes` (allocated lazily; `bytes_ram` counts rows held; its hits count as `hits_ram`).
      `memory` says where it lives: `host` (default), `pinned` or `device` (see `MemoryRows`).
      `choose_memory` picks one. `device` (where rows are served; required for `device`) is also
      `get_or_compute`'s default output device.
    - Files under `directory` (node-local): rows `0 .. capacity-1`, where `capacity` is every
      sample unless `disk_bytes` caps the files; samples beyond `capacity` are never cached.
      With `shared=True` (default) every row is written through to the files (copied to the host
      once per stored row in every memory mode), so the node's other processes see it; with
      `shared=False` (one process per node) memory-tier rows stay there only and the files hold
      just the rows that spill beyond the budget. Rows read from the files go through pinned
      staging to a CUDA device in the `pinned` and `device` modes.

    Batched API: `lookup` / `store` for the current level, `get_or_compute` for a training batch
    (hit, advance from the previous level, or compute), `advance` to move a whole level eagerly.
    Indices are positions in the train split, `0 <= i < num_samples`; duplicates are allowed
    (padding repeats a sample). Call `set_boundary` before anything else and at every freeze
    change. See the package docstring (trainer/cache/__init__.py) for validity and concurrency
    assumptions."""

    def __init__(
        self,
        directory: str | Path,
        num_samples: int,
        tokens: int,
        dim: int,
        *,
        ram_bytes: int = DEFAULT_RAM_BYTES,
        disk_bytes: int | None = None,
        dtype: torch.dtype = torch.float32,
        shared: bool = True,
        memory: MemoryTier = "host",
        device: torch.device | str | None = None,
    ):
        if num_samples <= 0 or tokens <= 0 or dim <= 0:
            raise ValueError("num_samples, tokens and dim must be positive")
        if ram_bytes < 0 or (disk_bytes is not None and disk_bytes < 0):
            raise ValueError("ram_bytes and disk_bytes must be >= 0")
        memory, served = resolve_memory(memory, device)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.num_samples, self.tokens, self.dim, self.dtype = num_samples, tokens, dim, dtype
        self.shared = shared
        self.row_bytes = tokens * dim * torch.empty((), dtype=dtype).element_size()
        ram_rows, capacity = _sizes(num_samples, self.row_bytes, ram_bytes, disk_bytes, shared)
        self._ram = MemoryRows(ram_rows, tokens, dim, dtype, memory, served)
        self._files = FileTier(
            directory,
            num_samples=num_samples,
            capacity=capacity,
            first=0 if shared else ram_rows,  # first row kept in the files
            row=(tokens, dim, dtype),
            row_bytes=self.row_bytes,
        )
        self.boundary: int | None = None
        self._lookups: dict[int, PrefixCosts] = {}  # measured lookup costs by batch size
        self._counts = dict.fromkeys(
            ("hits_ram", "hits_disk", "misses", "advanced", "computed", "stored"), 0
        )

    @property
    def memory(self) -> MemoryTier:
        """Where the memory tier lives: `host`, `pinned` or `device` (see the class docstring)."""
        return self._ram.memory

    @property
    def device(self) -> torch.device | None:
        """Where rows are served by default (None: where the inputs are)."""
        return self._ram.device

    @property
    def tier_device(self) -> torch.device:
        """Where the memory tier's rows (and `lookup`'s values) live."""
        return self._ram.tier_device

    @property
    def ram_rows(self) -> int:
        """Rows `0 .. ram_rows-1` live in the memory tier."""
        return self._ram.rows

    @property
    def capacity(self) -> int:
        """Rows that can be cached at all (samples with index >= capacity never are)."""
        return self._files.capacity

    @property
    def directory(self) -> Path:
        """The node-local folder of the files."""
        return self._files.directory

    @classmethod
    def for_model(
        cls, directory: str | Path, spec: ModelSpec, num_samples: int, **kwargs
    ) -> ActivationCache:
        """A cache shaped for `spec`'s hidden states (`spec.tokens` x `spec.width`)."""
        return cls(directory, num_samples, spec.tokens, spec.width, **kwargs)

    # -- levels -----------------------------------------------------------------------------

    def set_boundary(
        self, boundary: int, fingerprints: Sequence[str], *, prune: bool = True
    ) -> None:
        """Switch to boundary F (>= 1) for frozen weights identified by `fingerprints`
        (`FrozenPrefix.fingerprints(F)`, length F + 1).

        The source for incremental advance is the highest level below F whose rows were made by
        the same weights: the previous level of this process, or files left by another process or
        an earlier run. With `prune`, files of every other level in the directory are removed
        (they can no longer be read: F never decreases). Same boundary and fingerprint: no-op."""
        if boundary < 1:
            raise ValueError(
                f"the cache needs a frozen prefix: boundary must be >= 1, got {boundary}"
            )
        if len(fingerprints) != boundary + 1:
            raise ValueError(
                f"need {boundary + 1} fingerprints (embedding + blocks [0, k) for k = 0 .. "
                f"{boundary}), got {len(fingerprints)}"
            )
        if self.boundary is not None and boundary < self.boundary:
            raise ValueError(f"the freeze boundary never decreases ({self.boundary} -> {boundary})")
        files = self._files
        stem = files.stem(boundary, fingerprints[boundary])
        if files.level is not None and files.level.stem == stem:
            return
        source = files.source_for(boundary, fingerprints)
        # RAM rows of the old level become source rows if the old level is the source
        self._ram.demote(keep=source is not None and source is files.level)
        files.enter(boundary, fingerprints[boundary], source)
        self.boundary = boundary
        if prune:
            files.prune()

    # -- rows -------------------------------------------------------------------------------

    def _indices(self, indices: Indices) -> np.ndarray:
        if isinstance(indices, torch.Tensor):
            idx = indices.detach().to("cpu").numpy()
        else:
            idx = np.asarray(indices)
        idx = idx.astype(np.int64, copy=False).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"sample indices must lie in [0, {self.num_samples})")
        return idx

    def _ram_tensor(self) -> torch.Tensor:
        """The memory tier's tensor (tests/test_cuda_cache.py checks where it lives)."""
        return self._ram.tensor()

    def _masks(
        self, idx: np.ndarray, level: Level | None, state: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Which of `idx` are held at one level: in this process's RAM tier, in the files."""
        ram_hit = self._ram.holds(idx, state)
        return ram_hit, self._files.holds(idx, level, skip=ram_hit)

    def _read(
        self, idx: np.ndarray, level: Level | None, state: int, promote: bool
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """(hit mask, which hits came from RAM, rows for the hits in order) at one level; the rows
        are fresh tensors on `tier_device` (pinned host memory in the `pinned` mode)."""
        ram_hit, disk_hit = self._masks(idx, level, state)
        dev = self.tier_device
        on_device = self.memory == "device"
        hits = ram_hit | disk_hit
        from_ram = ram_hit[hits]
        n_hits = int(hits.sum())
        ram = self._ram
        if not disk_hit.any():  # the common case with a big RAM tier: no files
            return hits, from_ram, ram.gather(idx[ram_hit]) if n_hits else ram.empty(0)
        assert level is not None
        # the files' rows land in host memory first: pinned where an asynchronous copy to the
        # device follows, or where they are the output of the `pinned` mode
        rows_np = idx[disk_hit]
        n_disk = rows_np.size
        staged = ram.host_empty(
            n_disk, pin=on_device or (self.memory == "pinned" and n_disk == n_hits)
        )
        raw = staged.view(n_disk, -1).view(torch.uint8).numpy()
        np.take(level.rows, rows_np, axis=0, out=raw, mode="clip")
        staged = on(staged, dev)
        if n_disk == n_hits:
            out = staged
        else:
            out = ram.empty(n_hits)
            out.index_copy_(0, as_index(np.flatnonzero(from_ram), dev), ram.gather(idx[ram_hit]))
            out.index_copy_(0, as_index(np.flatnonzero(~from_ram), dev), staged)
        if promote and self.ram_rows:
            up = rows_np < self.ram_rows  # written by another process: keep a RAM copy
            if up.any():
                src = staged if up.all() else staged[as_index(np.flatnonzero(up), dev)]
                ram.put(rows_np[up], src, state)
        return hits, from_ram, out

    def servable(self, indices: Indices) -> np.ndarray:
        """Which of `indices` `get_or_compute` can serve without their inputs: rows held at the
        current level (in this process's memory tier or the files, whoever wrote them), or at
        the source level, to be advanced through the blocks in between. Counts nothing."""
        if self.boundary is None:
            raise RuntimeError("set_boundary() first")
        idx = self._indices(indices)
        ram, disk = self._masks(idx, self._files.level, CURRENT)
        ok = ram | disk
        if not ok.all():
            rest = idx[~ok]
            ram, disk = self._masks(rest, self._files.source, SOURCE)
            ok[~ok] = ram | disk
        return ok

    def lookup(self, indices: Indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the current level for `indices`: `(hits, values)`, `hits` a bool tensor (CPU)
        over the indices, `values` `[hits.sum(), tokens, dim]` in the order of the hits, on
        `tier_device`: the CUDA device for `memory="device"`, else the CPU (pinned memory for
        `memory="pinned"`, ready for an asynchronous copy)."""
        if self.boundary is None:
            raise RuntimeError("set_boundary() first")
        idx = self._indices(indices)
        hits, from_ram, out = self._read(idx, self._files.level, CURRENT, promote=True)
        n_ram = int(from_ram.sum())
        self._counts["hits_ram"] += n_ram
        self._counts["hits_disk"] += int(hits.sum()) - n_ram
        self._counts["misses"] += int((~hits).sum())
        return torch.from_numpy(hits), out

    def store(self, indices: Indices, outputs: torch.Tensor) -> None:
        """Write the prefix outputs `[len(indices), tokens, dim]` (on any device) of `indices` at
        the current level (rows beyond `capacity` are skipped). The row is written before its
        present flag. A device tier takes rows on its device without a host copy; rows for the
        files are copied to the host once."""
        if self.boundary is None:
            raise RuntimeError("set_boundary() first")
        idx = self._indices(indices)
        want = (idx.size, self.tokens, self.dim)
        if tuple(outputs.shape) != want or outputs.dtype != self.dtype:
            raise ValueError(
                f"expected outputs of shape {list(want)} and dtype {self.dtype}, "
                f"got {list(outputs.shape)} {outputs.dtype}"
            )
        outputs = outputs.detach()
        if self.memory != "device":
            outputs = outputs.to("cpu")  # once: both tiers are on the host
        keep = idx < self.capacity
        ram_sel = keep & (idx < self.ram_rows)
        disk_sel = keep & (idx >= self._files.first) & (self._files.level is not None)

        def pick(mask: np.ndarray) -> torch.Tensor:
            if mask.all():
                return outputs
            return outputs[as_index(np.flatnonzero(mask), outputs.device)]

        if ram_sel.any():
            self._ram.put(idx[ram_sel], pick(ram_sel), CURRENT)
        if disk_sel.any():
            self._files.write(idx[disk_sel], pick(disk_sel).to("cpu"))
        self._counts["stored"] += int(keep.sum())

    def get_or_compute(
        self,
        indices: Indices,
        inputs: torch.Tensor | None,
        prefix: PrefixRunner,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The prefix output at the current boundary for a batch: cached rows where present,
        rows of the source level advanced through blocks [source, F) where those are present,
        the rest computed from `inputs` (aligned with `indices`); new rows are stored. Returns
        `[len(indices), tokens, dim]` on `device` (default: the cache's `device` when it was
        given, else `inputs`' device), equal to `prefix.compute(inputs, F)`. Pass the pipeline's
        device when the inputs stay on the CPU (only the misses' inputs are then moved, by the
        prefix). Cached rows reach a CUDA device asynchronously from pinned staging in the
        `pinned` mode, and by a gather on the device in the `device` mode. `inputs` may be None
        where every row is `servable`: nothing is computed then (a row that is not raises)."""
        if self.boundary is None:
            raise RuntimeError("set_boundary() first")
        idx = self._indices(indices)
        if inputs is not None and len(inputs) != idx.size:
            raise ValueError(f"{len(inputs)} inputs for {idx.size} indices")
        hits_t, values = self.lookup(idx)
        hits = hits_t.numpy()
        if device is not None:
            device = torch.device(device)
        else:
            device = self.device
            if device is None:
                device = inputs.device if inputs is not None else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if hits.all():
            return on(values, device)
        out = torch.empty((idx.size, self.tokens, self.dim), dtype=self.dtype, device=device)
        if hits.any():
            out[as_index(np.flatnonzero(hits), device)] = on(values, device)
        miss_pos = np.flatnonzero(~hits)
        miss_idx = idx[miss_pos]
        todo = np.ones(miss_pos.size, dtype=bool)
        source = self._files.source
        if source is not None:
            src_hit, _, src_rows = self._read(miss_idx, source, SOURCE, promote=False)
            if src_hit.any():
                # to the output's device first (asynchronously from pinned staging); the prefix
                # moves them on if it lives elsewhere
                adv = prefix.run_blocks(on(src_rows, device), source.boundary, self.boundary)
                self.store(miss_idx[src_hit], adv)
                out[as_index(miss_pos[src_hit], device)] = adv.to(device)
                self._counts["advanced"] += int(src_hit.sum())
                todo = ~src_hit
        if todo.any():
            if inputs is None:
                raise ValueError(
                    f"{int(todo.sum())} rows are not cached at F={self.boundary} or below, and "
                    "no inputs were given to compute them"
                )
            pos = miss_pos[todo]
            fresh = prefix.compute(inputs[as_index(pos, inputs.device)], self.boundary)
            self.store(miss_idx[todo], fresh)
            out[as_index(pos, device)] = fresh.to(device)
            self._counts["computed"] += int(todo.sum())
        return out

    def advance(
        self, prefix: PrefixRunner, indices: Indices | None = None, batch_size: int = 256
    ) -> int:
        """Eagerly move rows from the source level to the current one (blocks [source, F) on
        each), for `indices` (default: every row), skipping rows already current or absent from
        the source. Several processes can share the work by passing disjoint `indices`. Returns
        the number of rows advanced. `get_or_compute` does the same lazily per batch."""
        if self.boundary is None:
            raise RuntimeError("set_boundary() first")
        source = self._files.source
        if source is None:
            return 0
        idx = np.arange(self.capacity) if indices is None else self._indices(indices)
        idx = idx[idx < self.capacity]
        done = 0
        for start in range(0, idx.size, batch_size):
            chunk = idx[start : start + batch_size]
            in_ram, on_disk = self._masks(chunk, self._files.level, CURRENT)
            chunk = chunk[~(in_ram | on_disk)]
            src_hit, _, rows = self._read(chunk, source, SOURCE, promote=False)
            if src_hit.any():
                self.store(chunk[src_hit], prefix.run_blocks(rows, source.boundary, self.boundary))
                done += int(src_hit.sum())
        self._counts["advanced"] += done
        return done

    # -- bookkeeping ------------------------------------------------------------------------

    @property
    def ram_fraction(self) -> float:
        """Share of the cacheable samples whose rows live in the RAM tier."""
        return self.ram_rows / self.capacity if self.capacity else 0.0

    def decide(
        self, policy: CachePolicy, prefix: PrefixRunner, inputs: torch.Tensor, boundary: int
    ) -> CacheDecision:
        """`decide_cache` for this cache: its disk tier measured where its files live (the
        node-local cache directory, not /tmp), lookups expected at its own RAM fraction, served
        from its own memory tier. Serving and storing rows is measured once per batch size and
        reused at later boundaries (rows have one shape): a re-layout measures only the
        recomputation of its prefix."""
        # the policy measures scratch caches of this class: imported here, not at the top
        from pipetransformer.trainer.cache.policy import decide_cache

        decision = decide_cache(
            policy,
            prefix,
            inputs,
            boundary,
            directory=self.directory,
            ram_fraction=self.ram_fraction,
            memory=self.memory,
            device=self.device,
            lookups=self._lookups.get(len(inputs)),
        )
        if decision.costs is not None:
            self._lookups[len(inputs)] = decision.costs
        if not policy.enabled:
            return decision
        return replace(decision, reason=f"{self.needs()}; {decision.reason}")

    def needs(self) -> str:
        """What the cache holds and where, for a person: `needs 18.9 MiB for 286 rows of
        128x129 float32 (66.0 KiB each): 286 in RAM, 0 on disk, 0 recomputed`."""
        total = self.num_samples * self.row_bytes
        on_disk = self.capacity - self.ram_rows
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"needs {_mib(total)} for {self.num_samples:,} rows of {self.tokens}x{self.dim} "
            f"{dtype} ({self.row_bytes / 1024:.1f} KiB each): {self.ram_rows:,} in "
            f"{'GPU memory' if self.memory == 'device' else 'RAM'}, {on_disk:,} on disk, "
            f"{self.num_samples - self.capacity:,} recomputed"
        )

    def stats(self) -> CacheStats:
        level, source = self._files.level, self._files.source
        on_disk = int(np.count_nonzero(level.present)) if level is not None else 0
        return CacheStats(
            boundary=self.boundary,
            source_boundary=None if source is None else source.boundary,
            bytes_ram=self._ram.count(CURRENT) * self.row_bytes,
            bytes_disk=on_disk * self.row_bytes,
            ram_rows=self.ram_rows,
            capacity=self.capacity,
            **self._counts,
        )

    def drop_page_cache(self) -> None:
        """Evict the current level's rows file from the OS page cache (measurements only)."""
        if self._files.level is not None:
            self._files.level.drop_page_cache()

    def close(self) -> None:
        self._files.close()
        self._ram.close()
        self.boundary = None

    def __enter__(self) -> ActivationCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
