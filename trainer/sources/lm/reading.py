"""Reading a corpus' rows a chunk at a time, and the digests its token cache is keyed by.

Files are JSON lines (`.jsonl`, `.json`), parquet, arrow (`.arrow`: the IPC file or stream
format) or CSV, streamed through `datasets` (`load_dataset(..., streaming=True)`: read block by
block, nothing converted or held whole), or a `save_to_disk` directory (`load_from_disk`: a
memory-mapped Dataset; a DatasetDict's split is its subdirectory, `dir/train`). One column is
read, `chunk_rows` rows at a time, with each row's number in its file (0-based). (A `.json` file
holding one JSON array, not lines, is parsed whole by `datasets`: use JSON lines for a large
corpus.)

Digests: a data file's is its content's SHA-256 up to `FULL_HASH_BYTES`; a larger file's is its
size, modification time and the SHA-256 of `SAMPLED_BLOCKS` blocks spread over it (so a check
costs milliseconds, not a read of the corpus; a change keeping the size, the modification time
and the sampled blocks would go unseen). A directory's is its files' (relative name, digest).
A tokenizer's is the content of every file in its directory except weights."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetransformer.trainer.sources import DataError

PathLike = str | os.PathLike[str]
Files = PathLike | Sequence[PathLike]
BUILDERS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}
FULL_HASH_BYTES = 256 << 20
SAMPLED_BLOCKS = 64
BLOCK = 1 << 20
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


@dataclass(frozen=True)
class Chunk:
    """Consecutive rows of one file: `values[k]` is row `first_row + k` of `file`."""

    file: str
    first_row: int
    values: list[Any]

    def where(self, k: int) -> str:
        """How an error names the k-th value's row."""
        return f"{self.file}: row {self.first_row + k}"


def as_paths(files: Files) -> list[Path]:
    """One path or several, as a list (in the order given: documents keep it)."""
    if isinstance(files, str | os.PathLike):
        return [Path(files)]
    paths = [Path(f) for f in files]
    if not paths:
        raise DataError("no data files given")
    return paths


def _hash_file(path: Path, h: Any) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        if size <= FULL_HASH_BYTES:
            while block := f.read(BLOCK):
                h.update(block)
            return
        st = path.stat()
        h.update(f"sampled {st.st_size} {st.st_mtime_ns}".encode())
        for k in range(SAMPLED_BLOCKS):
            f.seek((size - BLOCK) * k // (SAMPLED_BLOCKS - 1))
            h.update(f.read(BLOCK))


def file_digest(path: PathLike) -> str:
    """The digest of a data file or a directory's files (see the module's docstring)."""
    p = Path(path)
    h = hashlib.sha256()
    try:
        if p.is_dir():
            for f in sorted(q for q in p.rglob("*") if q.is_file()):
                h.update(f"{f.relative_to(p).as_posix()}\0".encode())
                _hash_file(f, h)
        elif p.is_file():
            _hash_file(p, h)
        else:
            raise DataError(f"data file {p} does not exist")
    except OSError as exc:
        raise DataError(f"cannot read data file {p}: {exc}") from exc
    return h.hexdigest()


def tokenizer_digest(directory: PathLike) -> str:
    """The digest of a tokenizer's files: every file of the directory but weights."""
    d = Path(directory)
    if not d.is_dir():
        raise DataError(f"the tokenizer {d} is not a directory (save_pretrained's)")
    h = hashlib.sha256()
    for f in sorted(q for q in d.iterdir() if q.is_file()):
        if f.suffix.lower() in WEIGHTS or f.stat().st_size > FULL_HASH_BYTES:
            continue
        h.update(f"{f.name}\0".encode())
        _hash_file(f, h)
    return h.hexdigest()


def _open(path: Path) -> Any:
    """A file as a streamed IterableDataset, or a save_to_disk directory as a Dataset."""
    import datasets

    if path.is_dir():
        if (path / "dataset_dict.json").exists():
            raise DataError(
                f"{path} is a DatasetDict; name one of its splits' directories (e.g. {path}/train)"
            )
        if not (path / "state.json").exists():
            raise DataError(f"{path} is a directory but not a Dataset written by save_to_disk")
        return datasets.load_from_disk(str(path))
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    builder = BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(
            f"data file {path}: unknown format {path.suffix or '(no suffix)'}; use .jsonl, "
            ".json, .parquet, .arrow, .csv or a save_to_disk directory"
        )
    if path.stat().st_size == 0:
        raise DataError(f"data file {path} is empty")
    return datasets.load_dataset(
        builder, data_files={"data": str(path)}, split="data", streaming=True
    )


def read_column(files: Files, column: str, chunk_rows: int) -> Iterator[Chunk]:
    """The values of `column`, file after file, at most `chunk_rows` rows at a time. A file
    without the column, or one that cannot be read, raises DataError naming it."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be positive (got {chunk_rows})")
    for path in as_paths(files):
        try:
            ds = _open(path)
            names = ds.column_names
            if names is not None and column not in names:
                raise DataError(
                    f"{path} has no column {column!r}; its columns are {', '.join(names)}"
                )
            if names is not None:
                ds = ds.select_columns([column])
            batches = ds.iter(batch_size=chunk_rows)
        except DataError:
            raise
        except Exception as exc:
            raise DataError(f"cannot read data file {path}: {exc}") from exc
        row = 0
        while True:
            try:
                batch = next(batches, None)
            except Exception as exc:
                raise DataError(f"cannot read data file {path} from row {row} on: {exc}") from exc
            if batch is None:
                break
            if column not in batch:  # a stream whose columns were unknown until read
                raise DataError(
                    f"{path} has no column {column!r}; its columns are {', '.join(batch)}"
                )
            values = batch[column]
            yield Chunk(str(path), row, values)
            row += len(values)
