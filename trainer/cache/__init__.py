"""AutoCache: per-sample cache of the frozen prefix's output (embedding + blocks [0, F)).

Once the first F blocks (and the embedding below them) are frozen, the hidden states they produce
for a training sample never change, so the first stage's rank can read them instead of
recomputing them every epoch. Frozen layers then stop costing forward time as well as backward.
The held-out rows get a cache of their own (the trainer's `heldout_cache`, used wherever the
training rows' is): an evaluation after the first at a boundary runs only the blocks above it.

Modules (each docstring says more):

- `prefix`: `FrozenPrefix` runs the frozen part forward-only (eval mode, no autograd, under the
  model's `autocast(device, precision)`) and fingerprints its weights and precision; the worker
  runs its frozen blocks through it on the cached *and* the uncached path.
- `storage`: `ActivationCache` stores one row `[tokens, dim]` per training sample (keyed by the
  sample's index in the train split) for the current boundary F: a memory tier over
  preallocated memory-mapped files on a node-local path, which the processes of a node share.
  `get_or_compute` serves a batch: hits from the cache, misses advanced incrementally from the
  previous boundary's cached rows when they exist (running only blocks [F_old, F)), otherwise
  computed from the inputs; misses are stored. `stats`: its counters (`CacheStats`).
- `memory`: the memory tier (`MemoryRows`, a preallocated tensor holding rows 0 .. ram_rows-1,
  bounded by `ram_bytes`) in pageable host, pinned host or device memory.
- `files`: the file tier (`FileTier`: one file of rows and one of present flags per boundary).
- `policy` / `timing`: `CachePolicy` / `decide_cache` / `measure_prefix_costs`: the cache is
  used only where it is cheaper than recomputation, measured on the machine, and never with
  data augmentation; `choose_memory` picks the memory tier.

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

from pipetransformer.trainer.cache.memory import DEFAULT_RAM_BYTES, MemoryTier
from pipetransformer.trainer.cache.policy import (
    CacheDecision,
    CacheMode,
    CachePolicy,
    choose_memory,
    decide_cache,
)
from pipetransformer.trainer.cache.prefix import FrozenPrefix, PrefixRunner
from pipetransformer.trainer.cache.stats import CacheStats
from pipetransformer.trainer.cache.storage import ActivationCache, Indices
from pipetransformer.trainer.cache.timing import PrefixCosts, measure_prefix_costs

__all__ = [
    "DEFAULT_RAM_BYTES",
    "ActivationCache",
    "CacheDecision",
    "CacheMode",
    "CachePolicy",
    "CacheStats",
    "FrozenPrefix",
    "Indices",
    "MemoryTier",
    "PrefixCosts",
    "PrefixRunner",
    "choose_memory",
    "decide_cache",
    "measure_prefix_costs",
]
