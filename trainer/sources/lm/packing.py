"""The pure packing core: documents' tokens laid back to back and cut into training sequences.
Numpy only (no tokenizer, no files), so it is tested on integer lists.

The stream. Every document's tokens followed by the end-of-document token (EOS; not added
twice when the document already ends with it), documents back to back: `tokens`, with
`offsets` (where each document starts; the last entry is the stream's length) and, for chat
data, `mask` (1 where a token is one the model learns to predict: an assistant's).

The windows. With T = seq_len, window i covers the stream's tokens [i*T, i*T + T + 1): its
inputs are the first T, its labels the last T (each position's label is the next token), so
consecutive windows share one token and every token but the first is a label exactly once.
There are ceil((M - 1) / T) windows in a stream of M tokens; the last, the tail, may hold fewer
than T + 1 tokens and is padded (the pad token in the inputs, IGNORE in the labels).

One window packs to
- inputs int64 [2, T]: row 0 the token ids, row 1 the document-start flags: 1 at the first token
  of every document inside the window, and at column 0 always (a window starts a segment, even
  mid-document); with `cross_document_attention` row 1 is [1, 0, ..., 0] (one causal sequence);
- labels int64 [T]: the next token's id, IGNORE (-100) where no loss is taken: where the next
  token starts a document (so an EOS does not learn to predict the next document's first token;
  not with `cross_document_attention`), where the next token is not one to learn (`mask` 0: a
  chat's system and user turns and its template's markup) and in the padding.
The padding of the tail is a segment of its own (flag 1 at its first position)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

IGNORE = -100  # a label no loss is taken on (the elastic sampler's, core.sampler.IGNORE)
UINT16_VOCAB = 1 << 16  # a vocabulary up to this many ids is stored as uint16

# (start, stop) in a stream -> (tokens, document-start flags, mask or None), each [stop - start]
RangeReader = Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray | None]]


def token_dtype(vocab_size: int) -> np.dtype:
    """How token ids are stored: uint16 when every id fits, else uint32."""
    if vocab_size <= 0 or vocab_size > 1 << 32:
        raise ValueError(f"a vocabulary of {vocab_size} ids cannot be stored")
    return np.dtype(np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32)


def with_eos(ids: Sequence[int] | np.ndarray, eos_id: int) -> np.ndarray:
    """A document's ids ending with EOS (appended unless it is already the last)."""
    a = np.asarray(ids, dtype=np.int64)
    if len(a) and a[-1] == eos_id:
        return a
    return np.append(a, np.int64(eos_id))


def concat_documents(
    documents: Sequence[Sequence[int] | np.ndarray],
    eos_id: int,
    masks: Sequence[Sequence[int] | np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(tokens int64 [M], offsets int64 [D + 1], mask bool [M] or None) of documents laid back
    to back, each followed by EOS (`with_eos`; an appended EOS has mask 0). The token cache
    writes the same stream a chunk at a time."""
    parts, mask_parts, offsets = [], [], [0]
    for k, doc in enumerate(documents):
        ids = with_eos(doc, eos_id)
        parts.append(ids)
        offsets.append(offsets[-1] + len(ids))
        if masks is not None:
            m = np.zeros(len(ids), dtype=bool)
            given = np.asarray(masks[k], dtype=bool)
            m[: len(given)] = given
            mask_parts.append(m)
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    mask = None
    if masks is not None:
        mask = np.concatenate(mask_parts) if mask_parts else np.zeros(0, bool)
    return tokens, np.asarray(offsets, dtype=np.int64), mask


def num_windows(stream_tokens: int, seq_len: int) -> int:
    """Windows of a stream of `stream_tokens` tokens: ceil((M - 1) / T), the tail included."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive (got {seq_len})")
    return max(0, -(-(stream_tokens - 1) // seq_len))


def window_range(index: int, stream_tokens: int, seq_len: int) -> tuple[int, int]:
    """The stream range [start, stop) window `index` reads (T + 1 tokens, fewer in the tail)."""
    start = index * seq_len
    return start, min(start + seq_len + 1, stream_tokens)


def targets_counted(
    starts: np.ndarray, mask: np.ndarray | None, cross_document_attention: bool
) -> np.ndarray:
    """bool [L]: whether each position's token counts as a label (its first is never one)."""
    counted = np.ones(len(starts), dtype=bool) if mask is None else mask.astype(bool, copy=True)
    if not cross_document_attention:
        counted &= ~starts.astype(bool)
    return counted


def pack_window(
    tokens: np.ndarray,
    starts: np.ndarray,
    mask: np.ndarray | None,
    seq_len: int,
    cross_document_attention: bool,
    pad_id: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(inputs int64 [2, T], labels int64 [T]) of one window: `tokens` its L <= T + 1 stream
    tokens (2 <= L), `starts` whether each begins a document, `mask` whether each is one to
    learn (None: all are)."""
    t, n = seq_len, len(tokens)
    if not 2 <= n <= t + 1 or len(starts) != n or (mask is not None and len(mask) != n):
        raise ValueError(f"a window holds 2 .. {t + 1} tokens with flags of the same length")
    ids = np.full(t + 1, pad_id, dtype=np.int64)
    ids[:n] = tokens
    counted = np.zeros(t + 1, dtype=bool)
    counted[:n] = targets_counted(starts, mask, cross_document_attention)
    inputs = np.zeros((2, t), dtype=np.int64)
    inputs[0] = ids[:t]
    if not cross_document_attention:
        flags = np.zeros(t + 1, dtype=np.int64)
        flags[:n] = starts
        if n <= t:
            flags[n] = 1  # the padding: a segment of its own
        inputs[1] = flags[:t]
    inputs[1, 0] = 1
    labels = np.where(counted[1:], ids[1:], IGNORE)
    return inputs, labels


def count_labels(
    read: RangeReader,
    stream_tokens: int,
    seq_len: int,
    cross_document_attention: bool,
    chunk_tokens: int = 1 << 20,
) -> np.ndarray:
    """int64 [W]: the labels each window counts (what `pack_window` leaves not IGNORE), in one
    pass over the stream, about `chunk_tokens` tokens read at a time."""
    t = seq_len
    total = num_windows(stream_tokens, t)
    out = np.zeros(total, dtype=np.int64)
    step = max(1, chunk_tokens // t)
    for w0 in range(0, total, step):
        w1 = min(total, w0 + step)
        a, b = w0 * t, min(w1 * t + 1, stream_tokens)
        _, starts, mask = read(a, b)
        targets = np.zeros((w1 - w0) * t, dtype=bool)
        targets[: b - a - 1] = targets_counted(starts, mask, cross_document_attention)[1:]
        out[w0:w1] = targets.reshape(w1 - w0, t).sum(axis=1)
    return out


def stream_reader(tokens: np.ndarray, offsets: np.ndarray, mask: np.ndarray | None) -> RangeReader:
    """A `RangeReader` over a whole stream (`tokens` may be a memory map: only the range is
    read)."""

    def read(a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        flags = np.zeros(b - a, dtype=bool)
        lo, hi = np.searchsorted(offsets, [a, b], side="left")
        flags[np.asarray(offsets[lo:hi], dtype=np.int64) - a] = True
        m = None if mask is None else np.asarray(mask[a:b], dtype=bool)
        return np.asarray(tokens[a:b], dtype=np.int64), flags, m

    return read


def subset_reader(
    tokens: np.ndarray,
    offsets: np.ndarray,
    mask: np.ndarray | None,
    documents: np.ndarray,
    starts: np.ndarray,
) -> RangeReader:
    """A `RangeReader` over the stream of some documents only (`documents`: their indices, in
    the order they are laid; `starts` int64 [S + 1]: where each begins in that stream,
    `subset_starts`), read from the whole stream without copying it."""

    def read(a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        x = np.arange(a, b, dtype=np.int64)
        k = np.searchsorted(starts, x, side="right") - 1
        begin = np.asarray(starts[k], dtype=np.int64)
        src = np.asarray(offsets[np.asarray(documents[k])], dtype=np.int64) + (x - begin)
        m = None if mask is None else np.asarray(mask[src], dtype=bool)
        return np.asarray(tokens[src], dtype=np.int64), x == begin, m

    return read


def subset_starts(offsets: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """int64 [S + 1]: where each of `documents` begins when they are laid back to back."""
    lengths = np.diff(np.asarray(offsets, dtype=np.int64))[np.asarray(documents, dtype=np.int64)]
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def pack_documents(
    documents: Sequence[Sequence[int] | np.ndarray],
    seq_len: int,
    eos_id: int,
    pad_id: int,
    masks: Sequence[Sequence[int] | np.ndarray] | None = None,
    cross_document_attention: bool = False,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every window of `documents` packed (`concat_documents`, then `pack_window` per window):
    the reference the memory-mapped path (`PackedSequences`) agrees with, windows without a
    counted label included."""
    tokens, offsets, mask = concat_documents(documents, eos_id, masks)
    read = stream_reader(tokens, offsets, mask)
    out = []
    for i in range(num_windows(len(tokens), seq_len)):
        a, b = window_range(i, len(tokens), seq_len)
        window, starts, m = read(a, b)
        out.append(pack_window(window, starts, m, seq_len, cross_document_attention, pad_id))
    return out


def split_documents(
    num_documents: int, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) document indices, each sorted: round(fraction * D) documents (at
    least one, and at least one left to train on) drawn by a permutation seeded with `seed`.
    Deterministic for the same D, fraction and seed; documents are never cut between splits.
    Adding documents changes the draw."""
    if not 0 < fraction < 1:
        raise ValueError(f"the held-out fraction must be in (0, 1) (got {fraction})")
    if num_documents < 2:
        raise ValueError(f"{num_documents} document(s) cannot be split in two")
    k = min(max(round(fraction * num_documents), 1), num_documents - 1)
    order = np.random.default_rng([seed, 0x4C4D]).permutation(num_documents)
    return np.sort(order[k:]).astype(np.int64), np.sort(order[:k]).astype(np.int64)
