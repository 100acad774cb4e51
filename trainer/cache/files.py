"""AutoCache's file tier (`FileTier`): per boundary F (a level, `Level`), one preallocated
memory-mapped file of rows and one of present flags on a node-local path, which the processes of
a node share; the level a process writes and the lower one its misses are advanced from.

A level's file names carry a key of its boundary, the fingerprint of the frozen weights and
precision, the data shape and the machine's boot id, so that other weights, another precision or
a reboot (rows possibly torn by the crash) never reuse its rows. Concurrency rules (node-local
files, one-byte flags written after their row, pruning while others map the files): the package
docstring (trainer/cache/__init__.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

FILE_PREFIX = "prefix-F"


@functools.cache
def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class Level:
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


class FileTier:
    """The levels under `directory` for rows `0 .. capacity-1` of `[tokens, dim]` `dtype` values
    (`row_bytes` each), of which this process keeps rows from `first` on in the files (0 when
    every row is written through; the memory tier's size when only its spill is): `level`, the
    current one, and `source`, the one below it that misses are advanced from (or None)."""

    def __init__(
        self,
        directory: Path,
        *,
        num_samples: int,
        capacity: int,
        first: int,
        row: tuple[int, int, torch.dtype],
        row_bytes: int,
    ):
        self.directory = directory
        self.num_samples, self.capacity, self.first = num_samples, capacity, first
        self.row, self.row_bytes = row, row_bytes
        self.level: Level | None = None
        self.source: Level | None = None

    def stem(self, boundary: int, fingerprint: str) -> Path:
        tokens, dim, dtype = self.row
        blob = json.dumps(
            {
                "v": 1,
                "boundary": boundary,
                "fingerprint": fingerprint,
                "num_samples": self.num_samples,
                "capacity": self.capacity,
                "row": [tokens, dim, str(dtype)],
                "boot": boot_id(),
            },
            sort_keys=True,
        )
        key = hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()
        return self.directory / f"{FILE_PREFIX}{boundary:03d}-{key}"

    def open(self, boundary: int, fingerprint: str, create: bool) -> Level | None:
        if self.capacity == 0:
            return None
        try:
            return Level(
                self.stem(boundary, fingerprint), boundary, self.capacity, self.row_bytes, create
            )
        except FileNotFoundError:
            return None

    def source_for(self, boundary: int, fingerprints: Sequence[str]) -> Level | None:
        """The highest level below `boundary` whose rows were made by the same weights: the
        current level, or files left by another process or an earlier run."""
        old = self.level
        if old is not None and old.boundary < boundary:
            if old.stem == self.stem(old.boundary, fingerprints[old.boundary]):
                return old
        for k in range(boundary - 1, 0, -1):
            source = self.open(k, fingerprints[k], create=False)
            if source is not None:
                return source
        return None

    def enter(self, boundary: int, fingerprint: str, source: Level | None) -> None:
        """Make `boundary` the current level (its files created) and `source` the source, closing
        the levels that are neither."""
        for level in (self.source, self.level):
            if level is not None and level is not source:
                level.close()
        self.source = source
        self.level = self.open(boundary, fingerprint, create=True)

    def prune(self) -> None:
        """Remove the files of every level in the directory but the current and source ones."""
        keep = {lv.stem.name for lv in (self.level, self.source) if lv is not None}
        for path in self.directory.glob(f"{FILE_PREFIX}*"):
            if path.suffix in (".rows", ".present") and path.with_suffix("").name not in keep:
                try:
                    path.unlink()
                except FileNotFoundError:  # another process of the node pruned it first
                    pass

    def holds(self, idx: np.ndarray, level: Level | None, skip: np.ndarray) -> np.ndarray:
        """Which of `idx` `level`'s files hold, leaving out those in `skip` (held elsewhere)."""
        hit = np.zeros(idx.size, dtype=bool)
        if level is not None and not skip.all():
            cand = ~skip & (idx < self.capacity) & (idx >= self.first)
            hit[cand] = level.present[idx[cand]] != 0
        return hit

    def write(self, rows: np.ndarray, values: torch.Tensor) -> None:
        """Rows (host tensor, aligned with `rows`) into the current level's files, each before
        its present flag."""
        assert self.level is not None
        raw = values.contiguous().view(rows.size, -1).view(torch.uint8).numpy()
        self.level.rows[rows] = raw
        self.level.present[rows] = 1  # after the row: a set flag means a complete row

    def close(self) -> None:
        for level in (self.level, self.source):
            if level is not None:
                level.close()
        self.level = self.source = None
