"""Text and chat data for causal language modelling (trainer/sources/lm): the pure packing core on
integer lists, then corpora in every file format through a byte-level BPE tokenizer trained here
(nothing is downloaded): round trips, chat assistant masks under both of the template's ways,
the errors, the token cache (hit, invalidation, corruption), exactly-once reading through a
DataLoader, and bounded chunks."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipetransformer.core.sampler import ElasticSampler
from pipetransformer.trainer.sources import DataError
from pipetransformer.trainer.sources.dataset import ElasticBatches
from pipetransformer.trainer.sources.lm import (
    IGNORE,
    LMData,
    open_lm_splits,
    pack,
    pack_documents,
    pack_window,
    split_documents,
    tokenize_files,
)
from pipetransformer.trainer.sources.lm import encode as encode_module
from pipetransformer.trainer.sources.lm.packing import (
    concat_documents,
    count_labels,
    num_windows,
    stream_reader,
    subset_reader,
    subset_starts,
    token_dtype,
    window_range,
)

# --- the pure core ---------------------------------------------------------------------------

EOS, PAD = 1, 0
DOCS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]  # stream: 5 6 7 1 | 8 9 1 | 10 11 12 13 1
MASKS = [[0, 1, 1], [0, 1], [0, 0, 1, 1]]  # chat: which tokens are the assistant's


def _pairs(windows: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[list, list, list]]:
    return [(x[0].tolist(), x[1].tolist(), y.tolist()) for x, y in windows]


def test_pack_window_flags_and_labels_per_mode() -> None:
    """T = 4 over a 12-token stream: 3 windows of 5 tokens overlapping by one, the tail padded.
    Hand-made expectations for each mode."""
    n = IGNORE
    assert _pairs(pack_documents(DOCS, 4, EOS, PAD)) == [
        ([5, 6, 7, 1], [1, 0, 0, 0], [6, 7, 1, n]),  # EOS does not predict document 2's first
        ([8, 9, 1, 10], [1, 0, 0, 1], [9, 1, n, 11]),  # column 0 starts a segment mid-document
        ([11, 12, 13, 1], [1, 0, 0, 0], [12, 13, 1, n]),  # the tail: padding is never a label
    ]
    assert _pairs(pack_documents(DOCS, 4, EOS, PAD, cross_document_attention=True)) == [
        ([5, 6, 7, 1], [1, 0, 0, 0], [6, 7, 1, 8]),
        ([8, 9, 1, 10], [1, 0, 0, 0], [9, 1, 10, 11]),
        ([11, 12, 13, 1], [1, 0, 0, 0], [12, 13, 1, n]),
    ]
    # chat: only the assistant's tokens are labels (the appended EOS is not one)
    assert _pairs(pack_documents(DOCS, 4, EOS, PAD, masks=MASKS)) == [
        ([5, 6, 7, 1], [1, 0, 0, 0], [6, 7, n, n]),
        ([8, 9, 1, 10], [1, 0, 0, 1], [9, n, n, n]),
        ([11, 12, 13, 1], [1, 0, 0, 0], [12, 13, n, n]),
    ]
    # a short tail: its padding is a segment of its own
    (x, y), *_ = pack_documents([[5, 6]], 6, EOS, PAD)
    assert x[0].tolist() == [5, 6, 1, 0, 0, 0] and x[1].tolist() == [1, 0, 0, 1, 0, 0]
    assert y.tolist() == [6, 1, n, n, n, n]
    # a document already ending with EOS gets no second one
    tokens, offsets, _ = concat_documents([[5, EOS], [6]], EOS)
    assert tokens.tolist() == [5, 1, 6, 1] and offsets.tolist() == [0, 2, 4]
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    with pytest.raises(ValueError, match="2 .. 5 tokens"):
        pack_window(np.array([5]), np.array([True]), None, 4, False, PAD)


@pytest.mark.parametrize("cross", [False, True])
def test_counts_and_subsets_agree_with_the_packed_labels(cross: bool) -> None:
    """On random streams: `count_labels` (chunked, vectorised) equals the labels `pack_window`
    leaves; a subset read from the whole stream equals the subset's documents packed alone."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(2, 50, rng.integers(1, 12)).tolist() for _ in range(40)]
    masks = [rng.integers(0, 2, len(d)).tolist() for d in docs]
    for m in (None, masks):
        tokens, offsets, mask = concat_documents(docs, EOS, m)
        for t in (1, 3, 7, 16):
            packed = pack_documents(docs, t, EOS, PAD, m, cross)
            assert len(packed) == num_windows(len(tokens), t)
            want = [int((y != IGNORE).sum()) for _, y in packed]
            read = stream_reader(tokens, offsets, mask)
            assert count_labels(read, len(tokens), t, cross, chunk_tokens=10).tolist() == want
        chosen = np.array([1, 4, 5, 20, 39])
        starts = subset_starts(offsets, chosen)
        sub = subset_reader(tokens, offsets, mask, chosen, starts)
        alone = pack_documents(
            [docs[i] for i in chosen], 5, EOS, PAD, None if m is None else [m[i] for i in chosen]
        )
        for i, (x, y) in enumerate(alone):
            a, b = window_range(i, int(starts[-1]), 5)
            w, s, mm = sub(a, b)
            x2, y2 = pack_window(w, s, mm, 5, False, PAD)
            assert np.array_equal(x, x2) and np.array_equal(y, y2)


def test_split_documents_is_seeded_and_whole() -> None:
    train, test = split_documents(100, 0.2, seed=7)
    assert len(test) == 20 and len(train) == 80
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(100))
    again = split_documents(100, 0.2, seed=7)
    assert np.array_equal(again[1], test) and not np.array_equal(
        split_documents(100, 0.2, 8)[1], test
    )
    assert [len(s) for s in split_documents(3, 0.01, 0)] == [2, 1]  # at least one held out
    with pytest.raises(ValueError, match="cannot be split"):
        split_documents(1, 0.5, 0)


# --- a tokenizer and corpora made here -------------------------------------------------------

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
WITH_MARKERS = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{%- if m['role'] == 'assistant' -%}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{%- else -%}{{ m['content'] + '<|im_end|>' + '\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
WITHOUT_MARKERS = WITH_MARKERS.replace("{% generation %}", "").replace("{% endgeneration %}", "")
STRICT = (  # raises on roles other than user and assistant, as some templates do
    "{%- for m in messages -%}{%- if m['role'] not in ['user', 'assistant'] -%}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor -%}"
)
STRICT_MARKERS = (  # the same, its assistant turns marked: rendered a batch at a time
    "{%- for m in messages -%}{%- if m['role'] not in ['user', 'assistant'] -%}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{%- endif -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}{%- endfor -%}"
)


def _words(i: int) -> str:
    words = "the cat sat on a mat while dogs ran far away from home".split()
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(words, int(rng.integers(1, 9)))) + f" {i}."


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One byte-level BPE tokenizer saved under several chat templates: `markers`,
    `prefixes`, `strict` (raising on a system message), `strict_markers` and `none` (no
    template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tokenizers")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator([_words(i) for i in range(200)] + ["user assistant system"], trainer)
    for name, template in [
        ("markers", WITH_MARKERS),
        ("prefixes", WITHOUT_MARKERS),
        ("strict", STRICT),
        ("strict_markers", STRICT_MARKERS),
        ("none", None),
    ]:
        tok = PreTrainedTokenizerFast(
            tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
        )
        tok.pad_token = "<pad>"
        if template is not None:
            tok.chat_template = template
        tok.save_pretrained(str(root / name))
    return root


@pytest.fixture(scope="module")
def tok(tokenizers_dir: Path) -> Any:
    """The `markers` tokenizer, loaded."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizers_dir / "markers"))


def _write(rows: list[dict], path: Path, fmt: str) -> Path:
    """`rows` as a file (or directory) of format `fmt`."""
    if fmt == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        path = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    elif fmt == "arrow":  # the IPC file format
        path = path.with_suffix(".arrow")
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table, max_chunksize=7)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


FORMATS = ["jsonl", "parquet", "arrow", "disk"]


@pytest.fixture
def count_encodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every chunk handed to the tokenizer (Encoder.encode), as they come."""
    seen: list[int] = []
    original = encode_module.Encoder.encode

    def encode(self: Any, chunk: Any) -> Any:
        seen.append(len(chunk.values))
        return original(self, chunk)

    monkeypatch.setattr(encode_module.Encoder, "encode", encode)
    return seen


def _stream_text(ds: Any, tok: Any) -> str:
    """The split's stream decoded back from its packed sequences' inputs (pads left out)."""
    ids = ds.read(range(len(ds)))[0][:, 0].reshape(-1).tolist()
    return tok.decode([i for i in ids if i != tok.pad_token_id])


@pytest.mark.parametrize("fmt", FORMATS)
def test_text_round_trip_every_format(
    fmt: str, tmp_path: Path, tokenizers_dir: Path, tok: Any
) -> None:
    """Training and held-out files of each format: decoding the packed sequences gives back the
    documents with EOS between them, document-start flags sit on each document's first token,
    and the counts are the labels not IGNORE."""
    train_docs = [_words(i) for i in range(23)]
    test_docs = [_words(100 + i) for i in range(5)]
    train_file = _write(
        [{"text": d, "id": i} for i, d in enumerate(train_docs)], tmp_path / "tr", fmt
    )
    test_file = _write([{"text": d} for d in test_docs], tmp_path / "te", fmt)
    train, test = open_lm_splits(
        train_file,
        tokenizers_dir / "markers",
        LMData(seq_len=16),
        test=test_file,
        cache_dir=tmp_path / "cache",
    )
    eos = tok.eos_token
    assert _stream_text(train, tok) == "".join(d + eos for d in train_docs)
    assert _stream_text(test, tok) == "".join(d + eos for d in test_docs)
    assert train.cache.meta["dtype"] == "uint16" and train.cache.num_documents == 23
    starts = 0
    for i in range(len(train)):
        x, y = train[i]
        assert x.shape == (2, 16) and y.shape == (16,) and x.dtype == y.dtype == torch.int64
        assert x[1, 0] == 1 and int((y != IGNORE).sum()) == train.counted[i]
        flags = x[1, 1:].nonzero().flatten() + 1
        assert all(int(x[0, f - 1]) == tok.eos_token_id for f in flags)  # a document starts
        assert all(int(y[f - 1]) == IGNORE for f in flags)  # EOS does not predict it
        starts += len(flags)
    assert starts >= 15  # most of the 22 documents after the first start inside a window
    assert train.counted_tokens(range(len(train))) == train.num_labels
    # every token after the first is a label once, less the 22 later documents' first tokens
    assert train.num_labels == train.cache.num_tokens - 1 - 22
    # one causal sequence per window: flags [1, 0, ..., 0], every next token a label
    cross = pack(train.cache, cross_document_attention=True)
    assert cross.path != train.path and cross.num_labels == train.cache.num_tokens - 1
    x, y = cross[1]
    assert x[1].tolist() == [1] + [0] * 15 and (y != IGNORE).all()
    assert torch.equal(x[0], train[1][0][0])


def test_held_out_fraction_is_whole_documents(
    tmp_path: Path, tokenizers_dir: Path, tok: Any
) -> None:
    docs = [_words(i) for i in range(30)]
    f = _write([{"body": d} for d in docs], tmp_path / "all", "jsonl")
    data = LMData(seq_len=12, column="body")
    kw = {"test_fraction": 0.2, "seed": 5, "cache_dir": tmp_path / "cache"}
    train, test = open_lm_splits(f, tokenizers_dir / "markers", data, **kw)
    train_idx, test_idx = split_documents(30, 0.2, 5)
    eos = tok.eos_token
    assert _stream_text(train, tok) == "".join(docs[i] + eos for i in train_idx)
    assert _stream_text(test, tok) == "".join(docs[i] + eos for i in test_idx)
    assert train.num_documents == 24 and test.num_documents == 6
    again, _ = open_lm_splits(f, tokenizers_dir / "markers", data, **kw)
    assert again.path == train.path and torch.equal(again[3][0], train[3][0])


CONVERSATIONS = [
    [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "where is the cat"},
        {"role": "assistant", "content": "on the mat"},
        {"role": "user", "content": "and the dogs"},
        {"role": "assistant", "content": "far away"},
    ],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat sat"}],
    [
        {"role": "user", "content": "a tool"},
        {"role": "assistant", "content": "calling it"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "it says 42"},
    ],
]


@pytest.mark.parametrize("template", ["markers", "prefixes"])
def test_chat_labels_count_exactly_the_assistant_tokens(
    template: str, tmp_path: Path, tokenizers_dir: Path, tok: Any
) -> None:
    """Packed conversations (several to a sequence, some cut between two): the counted labels
    decode to the assistant messages with their end-of-turn tokens and nothing else, whether the
    template marks them ({% generation %}) or they come from rendering prefixes."""
    rows = [{"messages": CONVERSATIONS[i % 3]} for i in range(9)]
    f = _write(rows, tmp_path / "chat", "jsonl")
    (train, _) = open_lm_splits(
        f,
        tokenizers_dir / template,
        LMData(seq_len=64, mode="chat"),
        test=f,
        cache_dir=tmp_path / "cache",
    )
    assert train.cache.meta["chat_assistant_mask"] == template
    counted = [int(v) for i in range(len(train)) for v in train[i][1] if v != IGNORE]
    want = "".join(
        m["content"] + "<|im_end|>" for r in rows for m in r["messages"] if m["role"] == "assistant"
    )
    assert tok.decode(counted) == want
    assert sum(int(c) for c in train.counted) == len(counted) == train.num_labels
    stream = tok.decode([int(t) for t in train.cache.tokens])
    assert stream.count("<|endoftext|>") == 9 and stream.count("<|im_start|>assistant") == 15


def test_chat_markers_and_prefixes_give_the_same_sequences(
    tmp_path: Path, tokenizers_dir: Path
) -> None:
    f = _write([{"messages": c} for c in CONVERSATIONS * 2], tmp_path / "chat", "parquet")
    data = LMData(seq_len=64, mode="chat")
    a, _ = open_lm_splits(f, tokenizers_dir / "markers", data, test=f, cache_dir=tmp_path / "c")
    b, _ = open_lm_splits(f, tokenizers_dir / "prefixes", data, test=f, cache_dir=tmp_path / "c")
    assert a.cache.path != b.cache.path and len(a) == len(b)
    for i in range(len(a)):
        assert all(torch.equal(u, v) for u, v in zip(a[i], b[i], strict=True))


ERRORS = [
    # (mode, template, rows, what the message says)
    ("chat", "none", [{"messages": CONVERSATIONS[1]}], "has no chat template"),
    ("chat", "markers", [{"messages": CONVERSATIONS[1]}] * 2 + [{"messages": CONVERSATIONS[0] * 3}], r"row 2: the conversation is \d+ tokens .*longer than seq_len 40"),
    ("chat", "markers", [{"messages": CONVERSATIONS[1]}] * 2 + [{"messages": [{"role": "bot", "content": "x"}]}], "row 2: message 0 has role 'bot'"),
    ("chat", "strict", [{"messages": CONVERSATIONS[1]}] * 2 + [{"messages": CONVERSATIONS[0]}], "row 2: the chat template .* refuses .*Only user and assistant"),
    ("chat", "strict_markers", [{"messages": CONVERSATIONS[1]}] * 2 + [{"messages": CONVERSATIONS[0]}], "row 2: the chat template .* refuses .*Only user and assistant"),
    ("chat", "prefixes", [{"messages": CONVERSATIONS[1]}] * 2 + [{"messages": CONVERSATIONS[1][:1]}], "row 2: the conversation has no assistant message"),
    ("chat", "markers", [{"messages": CONVERSATIONS[1]}] * 2 + [{"messages": []}], "row 2: column 'messages' is empty"),
    ("text", "markers", [{"text": "a"}, {"text": "b"}, {"text": None}], "row 2: column 'text' is empty"),
    ("text", "markers", [{"text": "a"}, {"text": "b"}, {"text": ""}], "row 2: column 'text' is empty"),
    ("text", "markers", [{"text": "a"}, {"text": "b"}, {"text": 7}], "row 2: column 'text' holds int 7, not text"),
    ("text", "markers", [{"body": "a"}], "has no column 'text'; its columns are body"),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "template", "rows", "message"), ERRORS)
def test_errors_name_the_row_and_write_nothing(
    mode: str, template: str, rows: list[dict], message: str, tmp_path: Path, tokenizers_dir: Path
) -> None:
    f = _write(rows, tmp_path / "bad", "jsonl")
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=message) as err:
        tokenize_files(f, tokenizers_dir / template, LMData(seq_len=40, mode=mode), cache_dir=cache)  # type: ignore[arg-type]
    assert str(f) in str(err.value) or "chat template" in str(err.value)
    left = [p.name for p in (cache / "lm-tokens").iterdir() if p.name != ".locks"]
    assert left == [], "an error leaves no entry, whole or partial"


def test_cache_hit_invalidation_and_corruption(
    tmp_path: Path, tokenizers_dir: Path, count_encodes: list[int]
) -> None:
    f = _write([{"text": _words(i)} for i in range(50)], tmp_path / "c", "jsonl")
    kw = {"cache_dir": tmp_path / "cache", "chunk_rows": 16}
    data, tok_dir = LMData(seq_len=10), tokenizers_dir / "markers"
    first = tokenize_files(f, tok_dir, data, **kw)
    assert count_encodes == [16, 16, 16, 2]
    tokens = np.array(first.tokens)
    count_encodes.clear()
    again = tokenize_files(f, tok_dir, data, **kw)
    assert count_encodes == [] and again.path == first.path, "a hit reads, never tokenises"
    assert tokenize_files(f, tok_dir, LMData(seq_len=11), **kw).path != first.path
    assert count_encodes, "seq_len is part of the key"

    # a bit flipped in the tokens: detected by the checksum, rebuilt the same
    count_encodes.clear()
    raw = bytearray((first.path / "tokens.bin").read_bytes())
    raw[5] ^= 0xFF
    (first.path / "tokens.bin").write_bytes(bytes(raw))
    rebuilt = tokenize_files(f, tok_dir, data, **kw)
    assert count_encodes and rebuilt.path == first.path and np.array_equal(rebuilt.tokens, tokens)
    # a torn (short) file: detected by its size even without the checksum
    count_encodes.clear()
    with (first.path / "offsets.bin").open("r+b") as fh:
        fh.truncate(16)
    tokenize_files(f, tok_dir, data, verify="size", **kw)
    assert count_encodes
    # a killed build leaves a tmp directory: the next build removes it
    stale = first.path.parent / f"{first.path.name}.tmp-999-dead"
    stale.mkdir()
    (first.path / "meta.json").unlink()  # an entry without its meta is not whole
    tokenize_files(f, tok_dir, data, **kw)
    assert not stale.exists()

    # the data's content changed: a new entry
    count_encodes.clear()
    f.write_text(f.read_text().replace("cat", "dog"))
    changed = tokenize_files(f, tok_dir, data, **kw)
    assert count_encodes and changed.path != first.path
    assert not np.array_equal(np.array(changed.tokens), tokens)


def test_epoch_reads_every_sequence_once(tmp_path: Path, tokenizers_dir: Path) -> None:
    """Sequence ids from the elastic sampler, through a DataLoader with worker processes, two
    replicas then one mid-epoch: each id read once, rows equal to the dataset's own; the padded
    last batch's extra entries have no labels. The Dataset pickles small and reopens lazily."""
    f = _write([{"text": _words(i)} for i in range(60)], tmp_path / "c", "parquet")
    train, _ = open_lm_splits(
        f, tokenizers_dir / "markers", LMData(seq_len=8), test=f, cache_dir=tmp_path / "cache"
    )
    n = len(train)
    assert n > 20
    blob = pickle.dumps(train)
    assert len(blob) < 4096
    copy = pickle.loads(blob)
    assert copy._arrays == {} and all(
        torch.equal(u, v) for u, v in zip(copy[7], train[7], strict=True)
    )

    sampler = ElasticSampler(n, global_batch=6, seed=1)
    seen: list[int] = []
    cursor = 0
    for replicas, steps in ((2, 2), (1, None)):
        for replica in range(replicas):
            batches = ElasticBatches(sampler, 0, cursor, replicas, replica, steps)
            loader = torch.utils.data.DataLoader(train, batch_sampler=batches, num_workers=2)
            for keys, (x, y) in zip(batches, loader, strict=True):
                for k, key in enumerate(keys):
                    want_x, want_y = train[key.index]
                    assert torch.equal(x[k], want_x)
                    if key.valid:
                        seen.append(key.index)
                        assert torch.equal(y[k], want_y)
                    else:
                        assert (y[k] == IGNORE).all()
        cursor = batches.end_cursor
    assert sorted(seen) == list(range(n))
    valid = np.array([True, True, False])
    assert train.counted_tokens([0, 1, 2], valid) == int(train.counted[0] + train.counted[1])


def test_a_restart_reads_the_rest_of_the_epoch_once(tmp_path: Path, tokenizers_dir: Path) -> None:
    """A job killed mid-epoch resumes from its last committed cursor in new processes: the
    splits opened again (from the token cache, and from a fresh one: tokenising again packs the
    same sequences), a new sampler, another replica count. The committed steps before the kill
    and the steps after the restart read every packed sequence of the epoch once; the steps
    after the commit that the kill lost are read again, as they are trained again."""
    f = _write([{"text": _words(i)} for i in range(60)], tmp_path / "c", "jsonl")

    def open_train(cache: str):  # noqa: ANN202
        return open_lm_splits(
            f, tokenizers_dir / "markers", LMData(seq_len=8), test=f, cache_dir=tmp_path / cache
        )[0]

    first = open_train("cache")
    n, epoch = len(first), 1

    def read(split, cursor: int, replicas: int, steps: int | None) -> tuple[list, int]:  # noqa: ANN001
        sampler = ElasticSampler(n, global_batch=6, seed=3)  # a new one, as a new process has
        batches = [
            ElasticBatches(sampler, epoch, cursor, replicas, r, steps) for r in range(replicas)
        ]
        rows = [
            (key.index, split[key.index])
            for b in batches
            for keys in b
            for key in keys
            if key.valid
        ]
        return rows, batches[0].end_cursor

    committed, cursor = read(first, 0, 2, 3)  # 3 steps, then a checkpoint at the cursor
    lost, _ = read(first, cursor, 2, 2)  # 2 more steps, then the kill: never committed
    for restarted in (open_train("cache"), open_train("fresh")):  # the token cache, a new one
        after, end = read(restarted, cursor, 1, None)  # one replica after the restart
        assert end == n
        ids = [i for i, _ in committed + after]
        assert sorted(ids) == list(range(n))  # each sequence once in the epoch
        assert {i for i, _ in lost} <= {i for i, _ in after}  # the lost steps' again
        for i, (x, y) in after:
            assert torch.equal(x, first[i][0]) and torch.equal(y, first[i][1])


def test_tokenisation_is_chunked(
    tmp_path: Path, tokenizers_dir: Path, count_encodes: list[int]
) -> None:
    """A corpus of 6000 rows in two files reaches the tokenizer 500 rows at a time, never
    whole; offsets and tokens come out as one stream."""
    rows = [{"text": f"the cat {i}"} for i in range(6000)]
    files = [
        _write(rows[:3500], tmp_path / "a", "jsonl"),
        _write(rows[3500:], tmp_path / "b", "arrow"),
    ]
    cache = tokenize_files(
        files,
        tokenizers_dir / "markers",
        LMData(seq_len=64),
        cache_dir=tmp_path / "c",
        chunk_rows=500,
    )
    assert max(count_encodes) == 500 and sum(count_encodes) == 6000 and len(count_encodes) == 12
    assert cache.num_documents == 6000 and cache.offsets[-1] == cache.num_tokens
    assert (cache.path / "tokens.bin").stat().st_size == 2 * cache.num_tokens  # uint16
    assert np.all(cache.tokens[np.asarray(cache.offsets[1:]) - 1] == cache.eos_id)
