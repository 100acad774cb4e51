"""Users' data sources (issue 23, first piece): an image folder, `datasets` tables (a
`save_to_disk` directory, parquet, arrow, JSON lines, CSV), tokenised text and SQuAD-style question
answering, read lazily from memory-mapped arrow through a torch `Dataset` whose row order the
elastic sampler (`core.sampler`) drives.

Nothing here is imported by the rest of the trainer yet (wiring into the job spec and the workers
is a later piece). The modules import `datasets`, `transformers` and Pillow (the `hf` extra) at
their top, so import them by name: `from trainer.sources.tabular import open_table`."""

from __future__ import annotations


class DataError(ValueError):
    """A user's data cannot be used as given; the message names the file, the column and the row
    where one is known, so the user can fix the data rather than the code."""
