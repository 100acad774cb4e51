"""Text and chat data for causal language modelling: a user's corpus tokenised once into a
memory-mapped token cache found again by content, packed into sequences of seq_len tokens.

    from pipetransformer.trainer.sources.lm import LMData, open_lm_splits
    train, test = open_lm_splits(["a.jsonl"], checkpoint_dir, LMData(seq_len=2048, mode="chat"))
    inputs, labels = train[0]           # int64 [2, T] (ids, document starts), int64 [T]
    train.counted_tokens([0, 5, 7])     # the labels those sequences count

Modules: `reading` (files in chunks, digests), `encode` (rows to documents: text, chat and its
assistant mask; `LMData`), `packing` (the pure core: the stream, windows, inputs, labels,
counts, the document-level split), `cache` (the token cache's entries: layout, key, atomic
writes, checks), `dataset` (`pack`, `PackedSequences`, `open_lm_splits`). Each module's
docstring holds its decisions. Importing this package imports numpy, torch and `datasets`;
transformers only when a corpus is tokenised."""

from pipetransformer.trainer.sources.lm.cache import (
    DEFAULT_CHUNK_ROWS,
    FORMAT,
    TokenCache,
    tokenize_files,
)
from pipetransformer.trainer.sources.lm.dataset import PackedSequences, open_lm_splits, pack
from pipetransformer.trainer.sources.lm.encode import DEFAULT_ROLES, LMData
from pipetransformer.trainer.sources.lm.packing import (
    IGNORE,
    pack_documents,
    pack_window,
    split_documents,
)

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_ROLES",
    "FORMAT",
    "IGNORE",
    "LMData",
    "PackedSequences",
    "TokenCache",
    "open_lm_splits",
    "pack",
    "pack_documents",
    "pack_window",
    "split_documents",
    "tokenize_files",
]
