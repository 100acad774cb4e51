"""Users' data sources: an image folder, `datasets` tables (a `save_to_disk` directory, parquet,
arrow, JSON lines, CSV), tokenised text and SQuAD-style question answering, read lazily from
memory-mapped arrow through a torch `Dataset` whose row order the elastic sampler
(`core.sampler`) drives. `trainer.data.load_dataset` opens them for a job
(`trainer.sources.splits`).

The modules import `datasets`, `transformers` and Pillow (the `hf` extra) at their top, so import
them by name: `from trainer.sources.tabular import open_split`."""

from __future__ import annotations

import os
from pathlib import Path


class DataError(ValueError):
    """A user's data cannot be used as given; the message names the file, the column and the row
    where one is known, so the user can fix the data rather than the code."""


def cache_root() -> Path:
    """Where derived data is kept between runs: $PIPETRANSFORMER_CACHE, else
    ~/.cache/pipetransformer."""
    root = os.environ.get("PIPETRANSFORMER_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "pipetransformer"
