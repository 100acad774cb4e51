"""The token cache: a corpus tokenised once into memory-mapped files, found again by content.

Layout, under `<cache>/lm-tokens/` (`<cache>` is `trainer.sources.cache_root()` unless given):

    <key>/                     one complete entry; the key digests what it depends on
      meta.json                format, mode, column, seq_len, data files' and tokenizer's
                               digests, dtype, EOS and pad ids, counts, each file's bytes and
                               SHA-256
      tokens.bin               uint16 (a vocabulary up to 65536 ids) or uint32 [M]: every
                               document's tokens and its EOS, documents back to back
      offsets.bin              int64 [D + 1]: where each document starts (the last: M)
      mask.bin                 uint8 [M], chat only: 1 on the tokens to learn (assistant's)
      packed-<digest>/         one packing of it (`dataset.PackedSequences`): its meta.json,
                               sequences.npy (each sequence's window), counted.npy (labels it
                               counts), for a subset of documents documents.npy and starts.npy
    <key>.tmp-<pid>-<hex>/     an entry being written; renamed to <key>/ once whole
    .locks/<key>               an empty file locked (flock) while <key> is built

The key is the SHA-256 of the format version (`FORMAT`), the data files' digests in order
(`reading.file_digest`: their content, not their paths), the tokenizer's digest, seq_len, the
column, the mode and the roles. Entries are written whole and renamed into place (a killed
process leaves a tmp directory, removed by the next build, never a torn entry) and checked when
opened: a missing or short file, or with `verify="full"` (the default) one whose SHA-256
differs, makes the entry rebuilt. A DataError while tokenising removes what was written.
Processes building the same entry at once take turns on its lock; the later ones find it
built."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipetransformer.trainer.sources import DataError, cache_root
from pipetransformer.trainer.sources.lm.encode import Encoder, LMData, load_tokenizer
from pipetransformer.trainer.sources.lm.packing import token_dtype
from pipetransformer.trainer.sources.lm.reading import (
    Files,
    PathLike,
    as_paths,
    file_digest,
    read_column,
    tokenizer_digest,
)

FORMAT = 1  # raise when what an entry holds, or how it is made, changes
DEFAULT_CHUNK_ROWS = 1024
Verify = Literal["full", "size"]
log = logging.getLogger(__name__)


# --- entries: written whole, checked when opened -----------------------------------------------


class _Writer:
    """Appends arrays to a file as `dtype`, hashing what it writes."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.file = path.open("wb")
        self.dtype, self.hash, self.count = dtype, hashlib.sha256(), 0

    def write(self, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, dtype=self.dtype).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.count += len(values)

    def close(self) -> dict[str, Any]:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"bytes": self.count * self.dtype.itemsize, "sha256": self.hash.hexdigest()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def describe_files(directory: Path, names: list[str]) -> dict[str, Any]:
    """Each file's bytes and SHA-256, for an entry's meta.json."""
    return {
        n: {"bytes": (directory / n).stat().st_size, "sha256": _sha256(directory / n)}
        for n in names
    }


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    """meta.json, synced: written last, so an entry without it is not whole."""
    path = directory / "meta.json"
    with path.open("w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def check_entry(directory: Path, verify: Verify) -> dict[str, Any] | None:
    """An entry's meta if it is whole and its files are as written (sizes; SHA-256 too with
    "full"), else None."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            return None
        for name, want in meta["files"].items():
            path = directory / name
            if path.stat().st_size != want["bytes"]:
                log.warning(
                    "%s: %s holds %d bytes, not %d",
                    directory,
                    name,
                    path.stat().st_size,
                    want["bytes"],
                )
                return None
            if verify == "full" and _sha256(path) != want["sha256"]:
                log.warning("%s: %s is not as written (SHA-256 differs)", directory, name)
                return None
        return meta
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _locked(root: Path, key: str) -> Iterator[None]:
    locks = root / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / key).open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def entry(
    root: Path, key: str, build: Callable[[Path], None], verify: Verify
) -> tuple[Path, dict[str, Any]]:
    """The entry `root/key` and its meta: opened if whole, else built by `build(tmp)` (which
    writes every file and meta.json last) into a tmp directory renamed into place under the
    key's lock. Whatever `build` raises leaves nothing behind."""
    path = root / key
    meta = check_entry(path, verify)
    if meta is not None:
        return path, meta
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root, key):
        meta = check_entry(path, verify)  # built by another process meanwhile
        if meta is not None:
            return path, meta
        for stale in root.glob(f"{key}.tmp-*"):  # a killed build's (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if path.exists():
            log.warning("rebuilding the cache entry %s: it is incomplete or corrupt", path)
            trash = root / f"{key}.tmp-old-{secrets.token_hex(4)}"
            path.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
        tmp = root / f"{key}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            build(tmp)
            _sync_dir(tmp)
            tmp.rename(path)
            _sync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    meta = check_entry(path, "size")
    if meta is None:
        raise RuntimeError(f"the cache entry {path} was written but does not read back")
    return path, meta


# --- the token cache ---------------------------------------------------------------------------


@dataclass
class TokenCache:
    """One tokenised corpus (an entry of the layout above). Its arrays are memory maps opened
    when first used; the object pickles as its path and meta."""

    path: Path
    meta: dict[str, Any]
    _arrays: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def open(cls, path: PathLike, verify: Verify = "full") -> TokenCache:
        meta = check_entry(Path(path), verify)
        if meta is None:
            raise DataError(f"{path} is not a whole token cache entry")
        return cls(Path(path), meta)

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "meta": self.meta, "_arrays": {}}

    def _array(self, name: str, dtype: np.dtype | str, length: int) -> np.ndarray:
        if name not in self._arrays:
            if length == 0:
                self._arrays[name] = np.zeros(0, dtype=dtype)
            else:
                self._arrays[name] = np.memmap(
                    self.path / name, dtype=dtype, mode="r", shape=(length,)
                )
        return self._arrays[name]

    @property
    def tokens(self) -> np.ndarray:
        """uint16/uint32 [M]: the stream (`packing`), memory-mapped."""
        return self._array("tokens.bin", self.meta["dtype"], self.num_tokens)

    @property
    def offsets(self) -> np.ndarray:
        """int64 [D + 1]: where each document starts in the stream."""
        return self._array("offsets.bin", np.int64, self.num_documents + 1)

    @property
    def mask(self) -> np.ndarray | None:
        """uint8 [M] (chat): 1 on the tokens to learn; None for text (all are)."""
        if self.mode != "chat":
            return None
        return self._array("mask.bin", np.uint8, self.num_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.meta["tokens"])

    @property
    def num_documents(self) -> int:
        return int(self.meta["documents"])

    @property
    def mode(self) -> str:
        return str(self.meta["mode"])

    @property
    def seq_len(self) -> int:
        return int(self.meta["seq_len"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def pad_id(self) -> int:
        return int(self.meta["pad_id"])

    @property
    def key(self) -> str:
        return self.path.name


def cache_key(sources: list[str], tokenizer: str, data: LMData) -> str:
    """The entry a corpus is kept under (see the module's docstring)."""
    parts = {"format": FORMAT, "sources": sources, "tokenizer": tokenizer, **asdict(data)}
    parts["column"] = data.column_name
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:40]


def _build(
    out: Path,
    paths: list[Path],
    tokenizer_dir: str,
    data: LMData,
    inputs: dict[str, Any],
    chunk_rows: int,
) -> None:
    tok = load_tokenizer(tokenizer_dir)
    encoder = Encoder(tok, data, tokenizer_dir)
    vocab = len(tok)
    dtype = token_dtype(vocab)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    writers = {"tokens.bin": _Writer(out / "tokens.bin", dtype)}
    writers["offsets.bin"] = _Writer(out / "offsets.bin", np.dtype(np.int64))
    if data.mode == "chat":
        writers["mask.bin"] = _Writer(out / "mask.bin", np.dtype(np.uint8))
    position, documents, files = 0, 0, []
    try:
        writers["offsets.bin"].write(np.zeros(1, np.int64))
        for chunk in read_column(paths, data.column_name, chunk_rows):
            docs = encoder.encode(chunk)
            if not docs:
                continue
            ids = np.concatenate([d.ids for d in docs])
            if ids.min() < 0 or ids.max() > np.iinfo(dtype).max:
                raise DataError(f"{chunk.file}: the tokenizer gave ids outside its vocabulary")
            writers["tokens.bin"].write(ids)
            if data.mode == "chat":
                writers["mask.bin"].write(np.concatenate([d.mask for d in docs]))
            lengths = np.fromiter((len(d.ids) for d in docs), np.int64, len(docs))
            writers["offsets.bin"].write(position + np.cumsum(lengths))
            position += int(lengths.sum())
            documents += len(docs)
    finally:
        for name, w in writers.items():
            files.append((name, w.close()))
    if documents == 0:
        raise DataError(f"{', '.join(map(str, paths))}: no documents (every file is empty)")
    write_meta(
        out,
        {
            **inputs,
            "dtype": dtype.name,
            "vocab": vocab,
            "eos_id": int(tok.eos_token_id),
            "pad_id": int(pad),
            "documents": documents,
            "tokens": position,
            "chat_assistant_mask": (
                None if data.mode != "chat" else ("markers" if encoder.markers else "prefixes")
            ),
            "files": dict(files),
        },
    )


def tokenize_files(
    files: Files,
    tokenizer: PathLike,
    data: LMData,
    *,
    cache_dir: PathLike | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    verify: Verify = "full",
) -> TokenCache:
    """The corpus in `files` (in order; see `reading`) tokenised by the tokenizer in the
    directory `tokenizer`, as `data` says: read from the cache when an entry for the same
    content is there and whole, else tokenised `chunk_rows` rows at a time into a new entry.
    Raises DataError for data that cannot be used (nothing is written then)."""
    paths = as_paths(files)
    sources = [file_digest(p) for p in paths]
    tok_digest = tokenizer_digest(tokenizer)
    key = cache_key(sources, tok_digest, data)
    inputs = {
        "format": FORMAT,
        "mode": data.mode,
        "column": data.column_name,
        "seq_len": data.seq_len,
        "roles": list(data.roles),
        "sources": [{"path": str(p), "digest": d} for p, d in zip(paths, sources, strict=True)],
        "tokenizer": {"path": str(tokenizer), "digest": tok_digest},
    }
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    path, meta = entry(
        root / "lm-tokens",
        key,
        lambda out: _build(out, paths, str(tokenizer), data, inputs, chunk_rows),
        verify,
    )
    return TokenCache(path, meta)
