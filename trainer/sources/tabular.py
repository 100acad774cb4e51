"""Users' tables as memory-mapped `datasets.Dataset`s: a `save_to_disk` directory (a DatasetDict
with the named splits, or one Dataset per split), or parquet, arrow, JSON lines or CSV files.
Text formats are converted once to arrow under the cache directory (`datasets`' own cache) and
memory-mapped from there; nothing is loaded whole into memory.

Which columns hold the image, the text, the text pair and the label (`Columns`), and which splits
are the training and the held-out one, are parameters. `open_splits` checks every split up front,
in time bounded by arrow's vectorised compute rather than a Python loop over rows: a missing
column, an empty split, a null or a label outside [0, num_labels) raises DataError naming the
file, the column and the (0-based data) row."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipetransformer.trainer.sources import DataError

PathLike = str | os.PathLike[str]
SplitFiles = PathLike | Sequence[PathLike]
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


@dataclass(frozen=True)
class Columns:
    """Column names; None for a column the task does not use."""

    image: str | None = None
    text: str | None = None
    text_pair: str | None = None
    label: str | None = "label"
    others: tuple[str, ...] = ()  # further columns a task reads (question answering's)

    def required(self) -> list[str]:
        used = (self.image, self.text, self.text_pair, self.label, *self.others)
        return [c for c in used if c is not None]


@dataclass(frozen=True)
class Piece:
    """One file (or save_to_disk directory) of a split and the rows it holds."""

    path: str
    rows: int


def _load_file(path: Path, cache_dir: PathLike | None) -> datasets.Dataset:
    """One file or save_to_disk directory as a memory-mapped Dataset."""
    try:
        if path.is_dir():
            if not (path / "state.json").exists():
                raise DataError(
                    f"{path} is a directory but not a Dataset written by save_to_disk "
                    "(no state.json); name its files instead"
                )
            return datasets.load_from_disk(str(path))
        if not path.exists():
            raise DataError(f"data file {path} does not exist")
        suffix = path.suffix.lower()
        if suffix == ".parquet" and pq.ParquetFile(path).metadata.num_rows == 0:
            # datasets' parquet builder fails on a file without rows; an empty split is the
            # clearer error (check_split)
            return datasets.Dataset(pq.read_schema(path).empty_table())
        if suffix in (".jsonl", ".json", ".csv") and path.stat().st_size == 0:
            raise DataError(f"data file {path} is empty")
        if suffix == ".arrow":
            return datasets.Dataset.from_file(str(path))  # memory-mapped in place
        builder = BUILDERS.get(suffix)
        if builder is None:
            raise DataError(
                f"data file {path}: unknown format {suffix or '(no suffix)'}; use .parquet, "
                ".arrow, .jsonl, .json, .csv or a save_to_disk directory"
            )
        return datasets.load_dataset(
            builder,
            data_files={"data": str(path)},
            split="data",
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"cannot read data file {path}: {exc}") from exc


def _locate(pieces: Sequence[Piece], row: int) -> tuple[str, int]:
    """(file, row within that file) of a row of the concatenated split."""
    for piece in pieces:
        if row < piece.rows:
            return piece.path, row
        row -= piece.rows
    raise IndexError(row)


def _first(mask: pa.ChunkedArray | pa.Array) -> int | None:
    """The first index where a boolean array is true, or None; vectorised."""
    if not pc.any(mask).as_py():
        return None
    return int(pc.index(mask, True).as_py())


def check_split(
    ds: datasets.Dataset,
    split: str,
    pieces: Sequence[Piece],
    columns: Columns,
    num_labels: int | None,
) -> None:
    """Raise DataError for a missing column, an empty split, a null in a used column, a text column
    that is not text, or a label that is not an integer in [0, num_labels)."""
    where = ", ".join(p.path for p in pieces)
    if len(ds) == 0:
        raise DataError(f"split {split!r} ({where}) is empty")
    for col in columns.required():
        if col not in ds.column_names:
            raise DataError(
                f"split {split!r} ({where}) has no column {col!r}; "
                f"its columns are {', '.join(ds.column_names)}"
            )
    table = ds.with_format("arrow")
    for col in columns.required():
        values = table[col]
        row = _first(pc.is_null(values))
        if row is not None:
            file, r = _locate(pieces, row)
            raise DataError(f"{file}: column {col!r} row {r} is empty (null)")
        if col in (columns.text, columns.text_pair) and not (
            pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
        ):
            raise DataError(f"{where}: text column {col!r} holds {values.type}, not strings")
    if columns.label is None:
        return
    labels = table[columns.label]
    if not pa.types.is_integer(labels.type):
        raise DataError(
            f"{where}: label column {columns.label!r} holds {labels.type}, not integers "
            "(class indices 0 .. num_labels-1)"
        )
    bad = pc.less(labels, 0)
    if num_labels is not None:
        bad = pc.or_(bad, pc.greater_equal(labels, num_labels))
    row = _first(bad)
    if row is not None:
        file, r = _locate(pieces, row)
        limit = f"[0, {num_labels})" if num_labels is not None else "[0, ...)"
        raise DataError(
            f"{file}: column {columns.label!r} row {r} holds label {labels[row].as_py()}, "
            f"outside {limit}"
        )


def _as_paths(files: SplitFiles) -> list[Path]:
    if isinstance(files, str | os.PathLike):
        return [Path(files)]
    paths = [Path(f) for f in files]
    if not paths:
        raise DataError("a split names no files")
    return paths


def open_split(
    files: SplitFiles,
    split: str,
    columns: Columns,
    num_labels: int | None = None,
    cache_dir: PathLike | None = None,
) -> datasets.Dataset:
    """One split from its files (concatenated in the order given), checked (`check_split`)."""
    parts = [(str(p), _load_file(p, cache_dir)) for p in _as_paths(files)]
    pieces = [Piece(path, len(ds)) for path, ds in parts]
    if len(parts) == 1:
        ds = parts[0][1]
    else:
        try:
            ds = datasets.concatenate_datasets([ds for _, ds in parts])
        except Exception as exc:
            raise DataError(
                f"split {split!r}: files {', '.join(p.path for p in pieces)} do not share "
                f"one schema: {exc}"
            ) from exc
    check_split(ds, split, pieces, columns, num_labels)
    return ds


def open_splits(
    source: PathLike | Mapping[str, SplitFiles],
    columns: Columns,
    splits: Sequence[str] = ("train", "test"),
    num_labels: int | None = None,
    cache_dir: PathLike | None = None,
) -> dict[str, datasets.Dataset]:
    """The named splits (e.g. training and held-out), each checked before any training.

    `source` is a `save_to_disk` directory of a DatasetDict holding those splits, or a mapping
    from split name to its file(s): parquet, arrow, JSON lines, CSV or save_to_disk directories."""
    if isinstance(source, Mapping):
        missing = [s for s in splits if s not in source]
        if missing:
            raise DataError(
                f"no files for split(s) {', '.join(missing)}; given: {', '.join(source)}"
            )
        return {s: open_split(source[s], s, columns, num_labels, cache_dir) for s in splits}
    root = Path(source)
    if not (root / "dataset_dict.json").exists():
        raise DataError(
            f"{root} is not a DatasetDict written by save_to_disk (no dataset_dict.json); "
            "map each split to its files instead"
        )
    try:
        dd = datasets.load_from_disk(str(root))
    except Exception as exc:
        raise DataError(f"cannot read {root}: {exc}") from exc
    out = {}
    for s in splits:
        if s not in dd:
            raise DataError(f"{root} has no split {s!r}; its splits are {', '.join(dd)}")
        check_split(dd[s], s, [Piece(str(root / s), len(dd[s]))], columns, num_labels)
        out[s] = dd[s]
    return out
