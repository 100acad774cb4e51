"""AutoCache's memory tier (`MemoryRows`): one process's rows `0 .. rows-1` in host, pinned or
device memory, which level each row holds, and the copies between host and GPU it relies on.

The memory tier (`memory=`, picked by `choose_memory`) lives in pageable host memory (`host`,
the default and the only choice without CUDA), in pinned host memory (`pinned`: rows are
gathered into fresh pinned staging tensors and copied to the GPU with `non_blocking=True`; the
caching host allocator records the copy's stream, so a staging block is reused only after its
copy) or on the GPU itself (`device`: a hit is a gather on the device, no host copy; files are
still written through from the host). The bookkeeping (which rows are present) is on the host
in every mode. Files are always host memory; their rows reach a GPU through pinned staging in
the `pinned` and `device` modes.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

MemoryTier = Literal["host", "pinned", "device"]
MEMORY_TIERS = ("host", "pinned", "device")

DEFAULT_RAM_BYTES = 256 << 20  # the memory tier's default budget per process

# RAM-tier row states
EMPTY, SOURCE, CURRENT = 0, 1, 2


def resolve_memory(
    memory: str, device: torch.device | str | None
) -> tuple[MemoryTier, torch.device | None]:
    """The effective memory mode and served device (validated)."""
    allowed = ", ".join(repr(m) for m in MEMORY_TIERS)
    if memory not in MEMORY_TIERS:
        raise ValueError(f"memory must be one of {allowed} (got {memory!r})")
    dev = torch.device(device) if device is not None else None
    if memory == "device":
        if dev is None:
            raise ValueError("memory='device' needs the device the rows are served to")
        if dev.type == "cpu":
            return "host", dev  # a memory tier "on the CPU device" is the host tier
        if dev.type != "cuda":
            raise ValueError(
                f"memory='device' supports CUDA devices (got {dev}); use memory='host'"
            )
    if memory in ("pinned", "device") and not torch.cuda.is_available():
        raise ValueError(
            f"memory={memory!r} needs CUDA (pinned host memory and device memory are for "
            f"GPU copies) and this machine has none: use memory='host' (allowed: {allowed})"
        )
    if dev is not None and dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return memory, dev  # type: ignore[return-value]


def on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. A host-to-CUDA copy is asynchronous when `t` is pinned (a fresh staging
    tensor that nobody writes to afterwards: the caching host allocator records the copy's stream
    and recycles the block only once the copy is done); any other copy is synchronous."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and t.is_pinned():
        return t.to(device, non_blocking=True)
    return t.to(device)


def as_index(positions: np.ndarray, device: torch.device) -> torch.Tensor:
    """Row positions (int64) as an index tensor on `device`; to CUDA via pinned memory and an
    asynchronous copy, so the host does not wait for the device's queued work."""
    t = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class MemoryRows:
    """Rows `0 .. rows-1` of one process (`[tokens, dim]` each, of `dtype`), allocated lazily
    where `memory` says (`resolve_memory`'s mode and served device), and the state of each
    (`EMPTY`, `SOURCE`: a row of the source level, `CURRENT`: a row of the current level), kept on
    the host in every mode. `memory` is one of:

    - `host` (default): pageable CPU memory; rows served to a GPU are copied synchronously.
    - `pinned`: page-locked CPU memory (needs CUDA). Rows are gathered into fresh pinned
      staging tensors and copied to a CUDA `device` with `non_blocking=True`. The caching host
      allocator rounds a pinned block up to a power of two (unless `pinned_max_round_threshold`
      is set in `PYTORCH_CUDA_ALLOC_CONF`), so the tier may pin up to twice `ram_bytes`.
    - `device`: on `device` (a CUDA device): a hit is an `index_select` there, with no host
      copy; stored rows already on the device are written without a round trip. With
      `memory="device"` and a CPU `device` the tier is simply `host`."""

    def __init__(
        self,
        rows: int,
        tokens: int,
        dim: int,
        dtype: torch.dtype,
        memory: MemoryTier,
        device: torch.device | None,
    ):
        self.memory, self.device = memory, device
        self.rows = rows
        self.shape = (tokens, dim)
        self.dtype = dtype
        self.state = np.zeros(rows, dtype=np.int8)
        self._tensor: torch.Tensor | None = None

    @property
    def tier_device(self) -> torch.device:
        """Where the memory tier's rows (and `lookup`'s values) live."""
        if self.memory == "device":
            assert self.device is not None
            return self.device
        return torch.device("cpu")

    def host_empty(self, n: int, pin: bool | None = None) -> torch.Tensor:
        """A fresh host tensor for `n` rows, pinned (staging for copies to CUDA) by default in the
        `pinned` and `device` modes."""
        pin = self.memory != "host" if pin is None else pin
        return torch.empty((n, *self.shape), dtype=self.dtype, pin_memory=pin)

    def empty(self, n: int) -> torch.Tensor:
        """A fresh tensor for `n` rows where `lookup` returns them (`tier_device`)."""
        if self.memory == "device":
            return torch.empty((n, *self.shape), dtype=self.dtype, device=self.tier_device)
        return self.host_empty(n)

    def tensor(self) -> torch.Tensor:
        """The tier's rows, allocated at first use."""
        if self._tensor is None:
            shape = (self.rows, *self.shape)
            if self.memory == "device":
                self._tensor = torch.empty(shape, dtype=self.dtype, device=self.tier_device)
            else:
                pin = self.memory == "pinned"
                self._tensor = torch.empty(shape, dtype=self.dtype, pin_memory=pin)
        return self._tensor

    def holds(self, idx: np.ndarray, state: int) -> np.ndarray:
        """Which of `idx` this tier holds in `state`."""
        n = idx.size
        if self.rows and n and idx.max() < self.rows:
            return self.state[idx] == state
        hit = np.zeros(n, dtype=bool)
        if self.rows:
            inside = idx < self.rows
            hit[inside] = self.state[idx[inside]] == state
        return hit

    def count(self, state: int) -> int:
        """Rows held in `state`."""
        return int((self.state == state).sum())

    def gather(self, rows: np.ndarray) -> torch.Tensor:
        """Rows `rows` in one gather, as a fresh tensor on `tier_device` (pinned host memory in
        the `pinned` mode)."""
        if self.memory == "device":
            return self.tensor().index_select(0, as_index(rows, self.tier_device))
        out = self.host_empty(rows.size)
        torch.index_select(self.tensor(), 0, torch.from_numpy(rows), out=out)
        return out

    def put(self, rows: np.ndarray, values: torch.Tensor, state: int) -> None:
        """Write `values` (aligned with `rows`, on any device) into rows `rows`, now in `state`."""
        tier = self.tensor()
        tier.index_copy_(0, as_index(rows, tier.device), values.to(tier.device))
        self.state[rows] = state

    def demote(self, keep: bool) -> None:
        """At a boundary change: current rows become source rows if `keep` (the old level is the
        new source), every other row is empty."""
        self.state[:] = np.where(keep & (self.state == CURRENT), SOURCE, EMPTY)

    def close(self) -> None:
        self._tensor = None
