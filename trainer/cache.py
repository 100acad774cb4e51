"""AutoCache: per-sample cache of the frozen prefix's output (embedding + blocks [0, F)).

Once the first F blocks (and the embedding below them) are frozen, the hidden states they produce
for a training sample never change, so the first stage's rank can read them instead of
recomputing them every epoch. Frozen layers then stop costing forward time as well as backward.

Pieces:

- `FrozenPrefix` runs the frozen part forward-only (eval mode, no autograd, under the model's
  `autocast(device, precision)`) and fingerprints its weights and precision. Its output is float32
  under either precision (bf16 autocast computes the matrix products in bfloat16; the residual
  stream and the cached rows stay float32). The worker must run its frozen blocks through it on
  the cached *and* the uncached path, so that both give the same numbers (eval mode: no dropout;
  the same precision). Its device is read from the modules' parameters at each call, so a prefix
  built on meta-device modules follows them to where `to_empty` materialises them.
- `ActivationCache` stores one row `[tokens, dim]` per training sample (keyed by the sample's index
  in the train split) for the current boundary F: a memory tier (a preallocated tensor holding
  rows 0 .. ram_rows-1, bounded by `ram_bytes`) over preallocated memory-mapped files on a
  node-local path (one file of rows and one of present flags per boundary), which the processes
  of a node share. `get_or_compute` serves a batch: hits from the cache, misses advanced
  incrementally from the previous boundary's cached rows when they exist (running only blocks
  [F_old, F)), otherwise computed from the inputs; misses are stored.
- The memory tier (`memory=`, picked by `choose_memory`) lives in pageable host memory (`host`,
  the default and the only choice without CUDA), in pinned host memory (`pinned`: rows are
  gathered into fresh pinned staging tensors and copied to the GPU with `non_blocking=True`; the
  caching host allocator records the copy's stream, so a staging block is reused only after its
  copy) or on the GPU itself (`device`: a hit is a gather on the device, no host copy; files are
  still written through from the host). The bookkeeping (which rows are present) is on the host
  in every mode. Files are always host memory; their rows reach a GPU through pinned staging in
  the `pinned` and `device` modes.
- `CachePolicy` / `decide_cache` / `measure_prefix_costs`: the cache is used only where it is
  cheaper than recomputation, measured on the machine, and never with data augmentation.

Correctness (docs/architecture.md, Invariants 8: a cached frozen-prefix output equals
recomputing it):

- The embedding and blocks [0, F) are frozen (bit-identical; docs/architecture.md, Invariants 3)
  for as long as level F is in use: the embedding lies below block 0, so it freezes with the first
  block. The cache does not watch the weights between `set_boundary` calls; it checks them
  (fingerprints) at each one.
- A cached row is only valid for the same input tensor. Random data augmentation makes the inputs,
  hence the prefix outputs, different every epoch, and a cached row would silently replay one
  augmented view forever: with augmentation the cache must be off (`CachePolicy` enforces it; the
  job spec exposes `cache: off | auto | on`, and augmentation forces `off`).
- Rows are keyed by the boundary F and a fingerprint of the frozen weights (embedding + blocks
  [0, F), see `FrozenPrefix.fingerprints`) and of the precision, the data shape and the boot id
  of the machine. A job resumed from a checkpoint whose frozen weights differ (e.g. it froze again
  at another step) or that runs in another precision gets a fresh level instead of stale rows; a
  machine that rebooted (rows possibly torn by the crash) never reuses its files.
- Bit-exactness: a hit returns the stored bits in every memory mode. On CPU (same dtype, eval
  mode, no_grad) recomputing a batch gives the same bits, so a cached row equals recomputing it
  (tests/test_cache.py checks this for both model families and both precisions; across batch
  sizes, float results can differ in the last bits, see the tests). On GPUs, kernels may pick
  batch-size-dependent algorithms; there it is equal within float rounding (bf16: within bfloat16
  rounding; tests/test_cuda_cache.py).
- Incremental advance is exact by construction: blocks [F_old, F_new) applied to the cached
  output of [0, F_old) perform the same operations on the same values as computing [0, F_new).

Concurrency (several processes of one node, e.g. the first-stage ranks of several replicas):

- The files must be on a node-local file system (memory mappings of one file are coherent only
  within one kernel; not NFS). Every process opens them with the same `num_samples`, shape, dtype
  and `disk_bytes` (they are part of the level's key); `ram_bytes` may differ per process.
- Present flags are one byte per sample, not bits: setting one is a single byte store, so writers
  of different samples never read-modify-write a shared word and cannot lose each other's updates.
- A row is written before its flag. Replicas own disjoint samples in a step, so a row has one
  writer at a time; should two processes ever compute the same row, they write identical bytes.
  A reader that sees a flag set by another process in an *earlier* step (the only case in
  training: samples move between replicas only from one step to the next, across collectives,
  which are full memory barriers) sees the whole row; x86-64 orders the stores anyway.
- `set_boundary` must be called with the same arguments by every process at the same step (the
  freeze decision is broadcast). It removes files of older levels; processes that still map them
  keep valid mappings (POSIX unlink semantics).
- Process crash mid-store: the flag is not set, the row is simply recomputed. The memory tier is
  per process (host or device memory); in the default `shared=True` mode every row is also
  written through to the files, so other processes (and this one after a restart) see it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import torch
from torch import nn

from core.spec import ModelSpec
from trainer.models import Precision, autocast, num_tokens
from trainer.profile import synchronize

CacheMode = Literal["off", "auto", "on"]
Indices = torch.Tensor | np.ndarray | Sequence[int]

_FILE_PREFIX = "prefix-F"
DEFAULT_RAM_BYTES = 256 << 20  # the memory tier's default budget per process


# ---------------------------------------------------------------------------------------------
# the frozen part of the model


class PrefixRunner(Protocol):
    """What the cache needs from the model: compute the prefix output from the inputs, and run
    blocks [start, end) on hidden states (for incremental advance)."""

    def compute(self, inputs: torch.Tensor, boundary: int) -> torch.Tensor: ...

    def run_blocks(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor: ...


class FrozenPrefix:
    """Forward-only runner over a model's embedding and its blocks (`blocks.<i>`).

    Runs in eval mode (no dropout; each module's train/eval flag is restored afterwards) under
    `torch.no_grad()` and `autocast(device, precision)` (trainer.models: bfloat16 matrix products
    for `bf16`, as `StageModule` runs them), so outputs carry no autograd history, are
    deterministic and are float32 under either precision. Only blocks below the boundary asked
    for are touched. Inputs are moved to `device`: where the embedding's parameters are now (read
    at each call, not at construction: modules built on the meta device and materialised later
    with `to_empty(device=...)` report their real device)."""

    def __init__(
        self,
        embed: nn.Module,
        blocks: Mapping[int, nn.Module] | Mapping[str, nn.Module],
        *,
        precision: Precision = "fp32",
    ):
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16 (got {precision!r})")
        self.embed = embed
        self.blocks = {int(k): m for k, m in blocks.items()}
        self.precision: Precision = precision
        self._digests: dict[tuple, str] = {}

    @classmethod
    def of(cls, model: nn.Module, *, precision: Precision | None = None) -> FrozenPrefix:
        """From a module with `.embed` and `.blocks` (e.g. `build_model(...)` or the first
        `StageModule` holding the frozen blocks). `precision` defaults to the module's own
        (`StageModule.precision`), else fp32."""
        if getattr(model, "embed", None) is None:
            raise ValueError("the frozen prefix needs the embedding (the model's first stage)")
        if precision is None:
            precision = getattr(model, "precision", "fp32")
        return cls(model.embed, model.blocks, precision=precision)

    @property
    def device(self) -> torch.device:
        """The device of the embedding's first parameter (of the lowest block's when the
        embedding has none; the CPU when neither has any)."""
        for module in (self.embed, *(self.blocks[i] for i in sorted(self.blocks))):
            first = next(iter(module.parameters()), None)
            if first is not None:
                return first.device
        return torch.device("cpu")

    def _check(self, start: int, end: int) -> None:
        missing = [i for i in range(start, end) if i not in self.blocks]
        if missing:
            raise ValueError(f"frozen prefix does not hold blocks {missing}")

    @contextmanager
    def _frozen(self, modules: list[nn.Module], device: torch.device) -> Iterator[None]:
        modes = [m.training for m in modules]
        for m in modules:
            m.eval()
        try:
            with torch.no_grad(), autocast(device, self.precision):
                yield
        finally:
            for m, mode in zip(modules, modes, strict=True):
                m.train(mode)

    def compute(self, inputs: torch.Tensor, boundary: int) -> torch.Tensor:
        """Embedding + blocks [0, boundary) on `inputs` (a batch); float32."""
        self._check(0, boundary)
        blocks = [self.blocks[i] for i in range(boundary)]
        device = self.device
        with self._frozen([self.embed, *blocks], device):
            x = self.embed(inputs.to(device))
            for block in blocks:
                x = block(x)
        return x.float()

    def run_blocks(self, x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Blocks [start, end) on hidden states `x` (a batch); float32."""
        self._check(start, end)
        blocks = [self.blocks[i] for i in range(start, end)]
        device = self.device
        with self._frozen(blocks, device):
            x = x.to(device)
            for block in blocks:
                x = block(x)
        return x.float()

    def _digest(self, name: str, module: nn.Module) -> str:
        tensors = list(module.state_dict(keep_vars=True).items())
        meta = [k for k, t in tensors if t.is_meta]
        if meta:
            raise RuntimeError(
                f"{name}.{meta[0]} is on the meta device: materialise the module (to_empty + "
                "load its weights) before fingerprinting it"
            )
        # in-place updates bump a tensor's version counter, so an unchanged key means unchanged
        # values: frozen blocks are hashed once (the device is part of the key: pointers of
        # different devices may coincide)
        memo = (name, tuple((k, str(t.device), t.data_ptr(), t._version) for k, t in tensors))
        if memo not in self._digests:
            h = hashlib.blake2b(digest_size=16)
            h.update(f"{name}:{type(module).__name__}".encode())
            for key, t in tensors:
                # the bytes on the CPU: the same weights give the same digest on any device
                t = t.detach().to("cpu").contiguous().reshape(-1)
                h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes())
            self._digests[memo] = h.hexdigest()
        return self._digests[memo]

    def fingerprints(self, boundary: int) -> list[str]:
        """Chained fingerprints of the frozen weights and the compute precision: element k
        identifies embedding + blocks [0, k), for k = 0 .. boundary. A cache level at boundary k
        is valid for these weights iff its key was made with element k, so any older level whose
        fingerprint still matches can serve as the source of an incremental advance. Rows made
        under bf16 differ from fp32 ones by far more than rounding, so the precision is part of
        the chain (fp32 chains are unchanged from before precision existed); the device is not
        (CPU and GPU rows agree within float rounding, and the digest hashes CPU bytes)."""
        self._check(0, boundary)
        head = self._digest("embed", self.embed)
        if self.precision != "fp32":
            head = hashlib.blake2b(f"{head}:{self.precision}".encode(), digest_size=16).hexdigest()
        chain = [head]
        for i in range(boundary):
            h = hashlib.blake2b(digest_size=16)
            h.update(chain[-1].encode())
            h.update(self._digest(f"blocks.{i}", self.blocks[i]).encode())
            chain.append(h.hexdigest())
        return chain


# ---------------------------------------------------------------------------------------------
# the cache


@dataclass(frozen=True)
class CacheStats:
    """Counters of this process since the cache was opened (hits and misses are samples), and
    the current level's footprint."""

    boundary: int | None
    source_boundary: int | None  # level that misses are advanced from, if any
    hits_ram: int
    hits_disk: int
    misses: int  # samples not in the current level (advanced + computed)
    advanced: int  # misses served by running blocks [source, F) on a cached source row
    computed: int  # misses computed from the inputs
    stored: int  # rows written
    bytes_ram: int  # rows of the current level held in this process's RAM tier
    bytes_disk: int  # rows of the current level present in the shared files
    ram_rows: int
    capacity: int  # rows that can be cached at all (samples with index >= capacity never are)

    @property
    def hits(self) -> int:
        return self.hits_ram + self.hits_disk

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@functools.cache
def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class _Level:
    """One boundary's shared files: `<stem>.rows` (capacity x row_bytes, sparse until written)
    and `<stem>.present` (one byte per row, set after the row is written)."""

    def __init__(self, stem: Path, boundary: int, capacity: int, row_bytes: int, create: bool):
        self.stem, self.boundary = stem, boundary
        self.rows_path = stem.with_suffix(".rows")
        self.present_path = stem.with_suffix(".present")
        sizes = ((self.rows_path, capacity * row_bytes), (self.present_path, capacity))
        for path, size in sizes:
            flags = os.O_RDWR | (os.O_CREAT if create else 0)
            fd = os.open(path, flags, 0o644)  # FileNotFoundError when not creating
            try:
                if os.fstat(fd).st_size < size:
                    if not create:
                        raise FileNotFoundError(f"{path} is incomplete")
                    os.ftruncate(fd, size)  # idempotent across racing creators: only extends
            finally:
                os.close(fd)
        self.rows = np.memmap(self.rows_path, np.uint8, "r+", shape=(capacity, row_bytes))
        self.present = np.memmap(self.present_path, np.uint8, "r+", shape=(capacity,))

    def drop_page_cache(self) -> None:
        """Write dirty rows back and evict the rows file from the page cache (this process's
        mapping included), so the next reads come from the device: for measurements only."""
        self.rows.flush()
        mm = getattr(self.rows, "_mmap", None)
        if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)
        fd = os.open(self.rows_path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Flush and drop this object's mappings (unmapped once no array refers to them)."""
        for name in ("rows", "present"):
            arr = self.__dict__.pop(name, None)
            if arr is not None:
                arr.flush()


# RAM-tier row states
_EMPTY, _SOURCE, _CURRENT = 0, 1, 2


MemoryTier = Literal["host", "pinned", "device"]
_MEMORY_TIERS = ("host", "pinned", "device")


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


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. A host-to-CUDA copy is asynchronous when `t` is pinned (a fresh staging
    tensor that nobody writes to afterwards: the caching host allocator records the copy's stream
    and recycles the block only once the copy is done); any other copy is synchronous."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and t.is_pinned():
        return t.to(device, non_blocking=True)
    return t.to(device)


def _index(positions: np.ndarray, device: torch.device) -> torch.Tensor:
    """Row positions (int64) as an index tensor on `device`; to CUDA via pinned memory and an
    asynchronous copy, so the host does not wait for the device's queued work."""
    t = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


class ActivationCache:
    """Frozen-prefix outputs per training sample, for the current boundary F.

    Rows are `[tokens, dim]` tensors of `dtype` (the prefix's output dtype, float32 under either
    precision; stored bit for bit, never converted). Sample `i` lives in row `i`:

    - Memory tier: rows `0 .. ram_rows-1` in a tensor of this process, `ram_rows = ram_bytes //
      row_bytes` (allocated lazily; `bytes_ram` counts rows held; its hits count as `hits_ram`).
      `memory` says where it lives:
      - `host` (default): pageable CPU memory; rows served to a GPU are copied synchronously.
      - `pinned`: page-locked CPU memory (needs CUDA). Rows are gathered into fresh pinned
        staging tensors and copied to a CUDA `device` with `non_blocking=True`. The caching host
        allocator rounds a pinned block up to a power of two (unless `pinned_max_round_threshold`
        is set in `PYTORCH_CUDA_ALLOC_CONF`), so the tier may pin up to twice `ram_bytes`.
      - `device`: on `device` (a CUDA device): a hit is an `index_select` there, with no host
        copy; stored rows already on the device are written without a round trip. With
        `memory="device"` and a CPU `device` the tier is simply `host`.
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
    change. See the module docstring for validity and concurrency assumptions."""

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
        self.memory, self.device = self._memory_tier(memory, device)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.num_samples, self.tokens, self.dim, self.dtype = num_samples, tokens, dim, dtype
        self.shared = shared
        self.row_bytes = tokens * dim * torch.empty((), dtype=dtype).element_size()
        ram_rows = min(num_samples, ram_bytes // self.row_bytes)
        if shared:
            capacity = (
                num_samples
                if disk_bytes is None
                else min(num_samples, disk_bytes // self.row_bytes)
            )
            ram_rows = min(ram_rows, capacity)  # RAM rows are written through to the files
        else:
            spill = num_samples - ram_rows
            disk_rows = spill if disk_bytes is None else min(spill, disk_bytes // self.row_bytes)
            capacity = ram_rows + disk_rows
        self.ram_rows, self.capacity = ram_rows, capacity
        self._disk_from = 0 if shared else ram_rows  # first row kept in the files
        self._ram: torch.Tensor | None = None
        self._ram_state = np.zeros(ram_rows, dtype=np.int8)
        self.boundary: int | None = None
        self._level: _Level | None = None
        self._source: _Level | None = None
        self._source_boundary: int | None = None
        self._counts = dict.fromkeys(
            ("hits_ram", "hits_disk", "misses", "advanced", "computed", "stored"), 0
        )

    @staticmethod
    def _memory_tier(
        memory: str, device: torch.device | str | None
    ) -> tuple[MemoryTier, torch.device | None]:
        """The effective memory mode and served device (validated)."""
        allowed = ", ".join(repr(m) for m in _MEMORY_TIERS)
        if memory not in _MEMORY_TIERS:
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

    @property
    def tier_device(self) -> torch.device:
        """Where the memory tier's rows (and `lookup`'s values) live."""
        if self.memory == "device":
            assert self.device is not None
            return self.device
        return torch.device("cpu")

    def _host_empty(self, n: int, pin: bool | None = None) -> torch.Tensor:
        """A fresh host tensor for `n` rows, pinned (staging for copies to CUDA) by default in the
        `pinned` and `device` modes."""
        pin = self.memory != "host" if pin is None else pin
        return torch.empty((n, self.tokens, self.dim), dtype=self.dtype, pin_memory=pin)

    def _tier_empty(self, n: int) -> torch.Tensor:
        """A fresh tensor for `n` rows where `lookup` returns them (`tier_device`)."""
        if self.memory == "device":
            dev = self.tier_device
            return torch.empty((n, self.tokens, self.dim), dtype=self.dtype, device=dev)
        return self._host_empty(n)

    @classmethod
    def for_model(
        cls, directory: str | Path, spec: ModelSpec, num_samples: int, **kwargs
    ) -> ActivationCache:
        """A cache shaped for `spec`'s hidden states (`num_tokens(spec)` x `spec.dim`)."""
        return cls(directory, num_samples, num_tokens(spec), spec.dim, **kwargs)

    # -- levels -----------------------------------------------------------------------------

    def _stem(self, boundary: int, fingerprint: str) -> Path:
        blob = json.dumps(
            {
                "v": 1,
                "boundary": boundary,
                "fingerprint": fingerprint,
                "num_samples": self.num_samples,
                "capacity": self.capacity,
                "row": [self.tokens, self.dim, str(self.dtype)],
                "boot": _boot_id(),
            },
            sort_keys=True,
        )
        key = hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()
        return self.directory / f"{_FILE_PREFIX}{boundary:03d}-{key}"

    def _open(self, boundary: int, fingerprint: str, create: bool) -> _Level | None:
        if self.capacity == 0:
            return None
        try:
            return _Level(
                self._stem(boundary, fingerprint), boundary, self.capacity, self.row_bytes, create
            )
        except FileNotFoundError:
            return None

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
        stem = self._stem(boundary, fingerprints[boundary])
        if self._level is not None and self._level.stem == stem:
            return
        old, old_boundary = self._level, self.boundary
        source, source_boundary = None, None
        if old is not None and old_boundary is not None and old_boundary < boundary:
            if old.stem == self._stem(old_boundary, fingerprints[old_boundary]):
                source, source_boundary = old, old_boundary
        if source is None:
            for k in range(boundary - 1, 0, -1):
                source = self._open(k, fingerprints[k], create=False)
                if source is not None:
                    source_boundary = k
                    break
        # RAM rows of the old level become source rows if the old level is the source
        keep = source is not None and source is old
        self._ram_state[:] = np.where(keep & (self._ram_state == _CURRENT), _SOURCE, _EMPTY)
        for level in (self._source, old):
            if level is not None and level is not source:
                level.close()
        self._source, self._source_boundary = source, source_boundary
        self._level = self._open(boundary, fingerprints[boundary], create=True)
        self.boundary = boundary
        if prune:
            self._prune()

    def _prune(self) -> None:
        keep = {lv.stem.name for lv in (self._level, self._source) if lv is not None}
        for path in self.directory.glob(f"{_FILE_PREFIX}*"):
            if path.suffix in (".rows", ".present") and path.with_suffix("").name not in keep:
                try:
                    path.unlink()
                except FileNotFoundError:  # another process of the node pruned it first
                    pass

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
        if self._ram is None:
            shape = (self.ram_rows, self.tokens, self.dim)
            if self.memory == "device":
                self._ram = torch.empty(shape, dtype=self.dtype, device=self.tier_device)
            else:
                self._ram = torch.empty(shape, dtype=self.dtype, pin_memory=self.memory == "pinned")
        return self._ram

    def _masks(
        self, idx: np.ndarray, level: _Level | None, state: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Which of `idx` are held at one level: in this process's RAM tier, in the files."""
        n = idx.size
        if self.ram_rows and n and idx.max() < self.ram_rows:
            ram_hit = self._ram_state[idx] == state
        else:
            ram_hit = np.zeros(n, dtype=bool)
            if self.ram_rows:
                in_ram = idx < self.ram_rows
                ram_hit[in_ram] = self._ram_state[idx[in_ram]] == state
        disk_hit = np.zeros(n, dtype=bool)
        if level is not None and not ram_hit.all():
            cand = ~ram_hit & (idx < self.capacity) & (idx >= self._disk_from)
            disk_hit[cand] = level.present[idx[cand]] != 0
        return ram_hit, disk_hit

    def _read(
        self, idx: np.ndarray, level: _Level | None, state: int, promote: bool
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """(hit mask, which hits came from RAM, rows for the hits in order) at one level; the rows
        are fresh tensors on `tier_device` (pinned host memory in the `pinned` mode)."""
        ram_hit, disk_hit = self._masks(idx, level, state)
        dev = self.tier_device
        on_device = self.memory == "device"
        hits = ram_hit | disk_hit
        from_ram = ram_hit[hits]
        n_hits = int(hits.sum())

        def gather(rows: np.ndarray) -> torch.Tensor:  # memory-tier rows, one gather
            if on_device:
                return self._ram_tensor().index_select(0, _index(rows, dev))
            out = self._host_empty(rows.size)
            torch.index_select(self._ram_tensor(), 0, torch.from_numpy(rows), out=out)
            return out

        if not disk_hit.any():  # the common case with a big RAM tier: no files
            return hits, from_ram, gather(idx[ram_hit]) if n_hits else self._tier_empty(0)
        assert level is not None
        # the files' rows land in host memory first: pinned where an asynchronous copy to the
        # device follows, or where they are the output of the `pinned` mode
        rows_np = idx[disk_hit]
        n_disk = rows_np.size
        staged = self._host_empty(
            n_disk, pin=on_device or (self.memory == "pinned" and n_disk == n_hits)
        )
        raw = staged.view(n_disk, -1).view(torch.uint8).numpy()
        np.take(level.rows, rows_np, axis=0, out=raw, mode="clip")
        staged = _on(staged, dev)
        if n_disk == n_hits:
            out = staged
        else:
            out = self._tier_empty(n_hits)
            out.index_copy_(0, _index(np.flatnonzero(from_ram), dev), gather(idx[ram_hit]))
            out.index_copy_(0, _index(np.flatnonzero(~from_ram), dev), staged)
        if promote and self.ram_rows:
            up = rows_np < self.ram_rows  # written by another process: keep a RAM copy
            if up.any():
                ram_idx = rows_np[up]
                src = staged if up.all() else staged[_index(np.flatnonzero(up), dev)]
                self._ram_tensor().index_copy_(0, _index(ram_idx, dev), src)
                self._ram_state[ram_idx] = state
        return hits, from_ram, out

    def lookup(self, indices: Indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the current level for `indices`: `(hits, values)`, `hits` a bool tensor (CPU)
        over the indices, `values` `[hits.sum(), tokens, dim]` in the order of the hits, on
        `tier_device`: the CUDA device for `memory="device"`, else the CPU (pinned memory for
        `memory="pinned"`, ready for an asynchronous copy)."""
        if self.boundary is None:
            raise RuntimeError("set_boundary() first")
        idx = self._indices(indices)
        hits, from_ram, out = self._read(idx, self._level, _CURRENT, promote=True)
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
        disk_sel = keep & (idx >= self._disk_from) & (self._level is not None)

        def pick(mask: np.ndarray) -> torch.Tensor:
            if mask.all():
                return outputs
            return outputs[_index(np.flatnonzero(mask), outputs.device)]

        if ram_sel.any():
            rows = idx[ram_sel]
            ram = self._ram_tensor()
            ram.index_copy_(0, _index(rows, ram.device), pick(ram_sel).to(ram.device))
            self._ram_state[rows] = _CURRENT
        if disk_sel.any():
            self._write_files(idx[disk_sel], pick(disk_sel).to("cpu"))
        self._counts["stored"] += int(keep.sum())

    def _write_files(self, rows: np.ndarray, values: torch.Tensor) -> None:
        """Rows (host tensor, aligned with `rows`) into the current level's files, each before
        its present flag."""
        assert self._level is not None
        raw = values.contiguous().view(rows.size, -1).view(torch.uint8).numpy()
        self._level.rows[rows] = raw
        self._level.present[rows] = 1  # after the row: a set flag means a complete row

    def get_or_compute(
        self,
        indices: Indices,
        inputs: torch.Tensor,
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
        `pinned` mode, and by a gather on the device in the `device` mode."""
        if self.boundary is None:
            raise RuntimeError("set_boundary() first")
        idx = self._indices(indices)
        if len(inputs) != idx.size:
            raise ValueError(f"{len(inputs)} inputs for {idx.size} indices")
        hits_t, values = self.lookup(idx)
        hits = hits_t.numpy()
        if device is not None:
            device = torch.device(device)
        else:
            device = self.device if self.device is not None else inputs.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if hits.all():
            return _on(values, device)
        out = torch.empty((idx.size, self.tokens, self.dim), dtype=self.dtype, device=device)
        if hits.any():
            out[_index(np.flatnonzero(hits), device)] = _on(values, device)
        miss_pos = np.flatnonzero(~hits)
        miss_idx = idx[miss_pos]
        todo = np.ones(miss_pos.size, dtype=bool)
        if self._source_boundary is not None:
            src_hit, _, src_rows = self._read(miss_idx, self._source, _SOURCE, promote=False)
            if src_hit.any():
                # to the output's device first (asynchronously from pinned staging); the prefix
                # moves them on if it lives elsewhere
                adv = prefix.run_blocks(_on(src_rows, device), self._source_boundary, self.boundary)
                self.store(miss_idx[src_hit], adv)
                out[_index(miss_pos[src_hit], device)] = adv.to(device)
                self._counts["advanced"] += int(src_hit.sum())
                todo = ~src_hit
        if todo.any():
            pos = miss_pos[todo]
            fresh = prefix.compute(inputs[_index(pos, inputs.device)], self.boundary)
            self.store(miss_idx[todo], fresh)
            out[_index(pos, device)] = fresh.to(device)
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
        if self._source_boundary is None:
            return 0
        idx = np.arange(self.capacity) if indices is None else self._indices(indices)
        idx = idx[idx < self.capacity]
        done = 0
        for start in range(0, idx.size, batch_size):
            chunk = idx[start : start + batch_size]
            in_ram, on_disk = self._masks(chunk, self._level, _CURRENT)
            chunk = chunk[~(in_ram | on_disk)]
            src_hit, _, rows = self._read(chunk, self._source, _SOURCE, promote=False)
            if src_hit.any():
                self.store(
                    chunk[src_hit], prefix.run_blocks(rows, self._source_boundary, self.boundary)
                )
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
        from its own memory tier."""
        return decide_cache(
            policy,
            prefix,
            inputs,
            boundary,
            directory=self.directory,
            ram_fraction=self.ram_fraction,
            memory=self.memory,
            device=self.device,
        )

    def stats(self) -> CacheStats:
        ram_held = int((self._ram_state == _CURRENT).sum())
        on_disk = int(np.count_nonzero(self._level.present)) if self._level is not None else 0
        return CacheStats(
            boundary=self.boundary,
            source_boundary=self._source_boundary,
            bytes_ram=ram_held * self.row_bytes,
            bytes_disk=on_disk * self.row_bytes,
            ram_rows=self.ram_rows,
            capacity=self.capacity,
            **self._counts,
        )

    def drop_page_cache(self) -> None:
        """Evict the current level's rows file from the OS page cache (measurements only)."""
        if self._level is not None:
            self._level.drop_page_cache()

    def close(self) -> None:
        for level in (self._level, self._source):
            if level is not None:
                level.close()
        self._level = self._source = None
        self._ram = None
        self.boundary = None

    def __enter__(self) -> ActivationCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# when to use it


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
class PrefixCosts:
    """Measured time per batch (medians, seconds) of the frozen prefix at `boundary`: recomputing
    it, serving it from the cache with every row in RAM, every row in the files with the page
    cache warm, and cold (read from the device), and storing a batch."""

    boundary: int
    batch_size: int
    compute_s: float
    ram_s: float
    disk_warm_s: float
    disk_s: float
    store_s: float

    def lookup_s(self, ram_fraction: float = 1.0, cold: bool = True) -> float:
        """Expected lookup time of a batch when `ram_fraction` of the rows are in RAM."""
        f = min(max(ram_fraction, 0.0), 1.0)
        return f * self.ram_s + (1 - f) * (self.disk_s if cold else self.disk_warm_s)

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
) -> PrefixCosts:
    """Time, side by side (interleaved repeats, medians), the prefix work of one training batch
    (`inputs`, whose length is the batch size) at `boundary`: recomputation vs a cache hit from
    RAM, from the files (warm page cache) and from the files after evicting the page cache.

    A scratch cache of `pool_batches` x batch rows (the outputs of `inputs`, tiled) is made in a
    temporary folder under `directory` (the real cache's file system: that is what is measured)
    and removed afterwards; each repeat reads a random batch of its rows. `memory` and `device`
    are the real cache's (`ActivationCache`), so the memory tier measured is the one it uses;
    rows are served to `device` (default: the inputs' device)."""
    with torch.no_grad():
        out = prefix.compute(inputs, boundary)
    b = len(inputs)
    tokens, dim = out.shape[1], out.shape[2]
    pool_batches = max(1, pool_batches)
    pool = b * pool_batches
    tiled = out.to("cpu").repeat((pool_batches, 1, 1))
    fps = [f"measure-{k}" for k in range(boundary + 1)]
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="cache-measure-", dir=directory)
    rng = np.random.default_rng(0)
    try:
        kw = dict(dtype=out.dtype, shared=False, memory=memory, device=device)
        ram = ActivationCache(Path(scratch) / "ram", pool, tokens, dim, ram_bytes=1 << 62, **kw)
        disk = ActivationCache(Path(scratch) / "disk", pool, tokens, dim, ram_bytes=0, **kw)
        for c in (ram, disk):
            c.set_boundary(boundary, fps)
        all_idx = np.arange(pool)
        t_store = []
        for k in range(pool_batches):
            sel = all_idx[k * b : (k + 1) * b]
            t0 = time.perf_counter()
            disk.store(sel, tiled[sel])
            t_store.append(time.perf_counter() - t0)
            ram.store(sel, tiled[sel])
        times: dict[str, list[float]] = {"compute": [], "ram": [], "warm": [], "cold": []}

        def timed(fn) -> float:
            # without the syncs, recompute on a GPU would time only its kernel launches
            synchronize(out.device)
            t0 = time.perf_counter()
            fn()
            synchronize(out.device)
            return time.perf_counter() - t0

        for _ in range(max(1, repeats)):
            sel = rng.choice(pool, size=b, replace=False)
            times["compute"].append(timed(lambda: prefix.compute(inputs, boundary)))
            times["ram"].append(timed(lambda s=sel: ram.get_or_compute(s, inputs, prefix)))
            times["warm"].append(timed(lambda s=sel: disk.get_or_compute(s, inputs, prefix)))
            disk.drop_page_cache()
            sel = rng.choice(pool, size=b, replace=False)
            times["cold"].append(timed(lambda s=sel: disk.get_or_compute(s, inputs, prefix)))
        for c in (ram, disk):
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
        disk_warm_s=med(times["warm"]),
        disk_s=med(times["cold"]),
        store_s=med(t_store),
    )


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
) -> CacheDecision:
    """Whether the first stage's rank should serve blocks [0, boundary) from the cache for
    batches like `inputs`. `off`/augmentation: no (nothing measured); `on`: yes; `auto`: measure
    (`measure_prefix_costs`) and compare recomputation with the expected lookup time at
    `ram_fraction` (`ActivationCache.ram_fraction`), the file part read cold, with the cache's
    `memory` tier serving `device`."""
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
