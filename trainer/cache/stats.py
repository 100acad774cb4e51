"""What an `ActivationCache` reports (`CacheStats`): its counters and its current level's
footprint, for the worker's events and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


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
