"""Where a job's model and data came from (issue 23), as `pipetransformer status`, the end-of-run
summary and the dashboard header all say it. Pure.

The model's facts are in the stored spec (`model.pretrained` is resolved at submission: the
directory, or the hub id with its revision and snapshot commit, and a fingerprint). The data's
rows are known only once a worker has opened it: rank 0 reports a `DataOpened` event per
generation (`describe_data` builds its `DataOrigin`), which the controller records as a
`data_opened` store event; readers take the newest one back through `origin_of`. Before that,
the spec alone gives the data set and its paths, without rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from pipetransformer.core.protocol import DataOrigin, SplitOrigin
from pipetransformer.core.spec import DataSpec, JobSpec, ModelSpec
from pipetransformer.core.tasks import CLASSIFICATION, Task, task_of

__all__ = [
    "DATA_OPENED",
    "columns_text",
    "data_text",
    "describe_data",
    "model_text",
    "origin_of",
    "provenance",
    "split_text",
]

DATA_OPENED = "data_opened"  # the store event a DataOpened report becomes
_SHOWN_PATHS = 3  # a split read from many files names the first few
_SHORT = 12  # hex digits of a fingerprint or commit


def describe_data(
    data: DataSpec,
    train_rows: int | None = None,
    test_rows: int | None = None,
    *,
    task: Task = CLASSIFICATION,
    windows: tuple[int, int] | None = None,
    sequences: tuple[int, int] | None = None,
) -> DataOrigin:
    """What to say about a job's data: each split's rows (None where not opened yet), the files
    or folder it comes from and the columns its kind reads for the job's `task`, or a built-in
    data set by its name. Question answering's rows become `windows` (train, held-out)
    samples, a causal LM's documents packed `sequences`."""
    if not data.is_source:
        return DataOrigin(
            dataset=data.dataset,
            builtin=True,
            train=SplitOrigin(rows=train_rows),
            test=SplitOrigin(rows=test_rows),
        )
    columns = data.kind.columns(data, task) or {}
    if data.path is not None:
        train = SplitOrigin(rows=train_rows, paths=[data.path], split=data.train_split)
        test = SplitOrigin(rows=test_rows, paths=[data.path], split=data.test_split)
    else:
        train = SplitOrigin(rows=train_rows, paths=list(data.train or []))
        test = SplitOrigin(rows=test_rows, paths=list(data.test or []))
    if windows is not None:
        train = train.model_copy(update={"windows": windows[0]})
        test = test.model_copy(update={"windows": windows[1]})
    if sequences is not None:
        train = train.model_copy(update={"sequences": sequences[0]})
        test = test.model_copy(update={"sequences": sequences[1]})
    return DataOrigin(dataset=data.dataset, builtin=False, train=train, test=test, columns=columns)


def origin_of(data: Mapping[str, Any] | None) -> DataOrigin | None:
    """The `DataOrigin` of a stored `data_opened` event (its data: `DataOpened.payload()`), or
    None where there is none or it does not parse."""
    if not data or "origin" not in data:
        return None
    try:
        return DataOrigin.model_validate(data["origin"])
    except ValidationError:
        return None


# -- how it reads ------------------------------------------------------------------------------


def _short(digest: str | None) -> str | None:
    return None if digest is None else digest[:_SHORT]


def _architecture(model: ModelSpec) -> str:
    blocks = f"{model.depth} block{'s' if model.depth != 1 else ''}"
    task = task_of(model)
    if task.vocab_outputs:
        head = f"causal LM over {model.num_classes:,} tokens, sequences of {model.seq_len}"
    elif task.fixed_outputs is not None:
        head = model.task.replace("-", " ")
    else:
        head = f"{model.num_classes} classes"
    return f"{model.family}, {blocks} of dim {model.dim}, {head}"


def model_text(model: ModelSpec) -> str:
    """A pretrained model's source (a directory, or a hub id with its revision and snapshot
    commit), architecture and short fingerprint; a seeded model's architecture."""
    pre = model.pretrained
    if pre is None:
        return f"seeded {_architecture(model)}"
    if pre.commit is not None or pre.revision is not None:  # a hub id in the local cache
        where = f"{pre.source} (hub), revision {pre.revision or 'main'}"
        if pre.commit is not None:
            where += f", snapshot {_short(pre.commit)}"
    else:
        where = pre.path or pre.source
    if pre.resolved:
        where += f" ({_architecture(model)}"
        if pre.fingerprint is not None:
            where += f"; fingerprint {_short(pre.fingerprint)}"
        where += ")"
    else:
        where += " (not resolved yet)"
    if (lora := model.adapters) is not None:
        targets = ", ".join(lora.targets) if lora.targets else "every projection"
        where += f"; LoRA r={lora.rank} alpha={lora.alpha:g} on {targets}, the base frozen"
    return where


def _rows(split: SplitOrigin) -> str:
    if split.rows is None:
        return "rows not reported yet"
    text = f"{split.rows:,} rows"
    if split.windows is not None:
        return f"{text} ({split.windows:,} windows)"
    if split.sequences is not None:
        return f"{text} ({split.sequences:,} packed sequences)"
    return text


def _paths(paths: Sequence[str]) -> str:
    shown = ", ".join(paths[:_SHOWN_PATHS])
    more = len(paths) - _SHOWN_PATHS
    return f"{shown} and {more} more" if more > 0 else shown


def split_text(split: SplitOrigin) -> str:
    """`96 rows from /data/train.parquet`, `40 rows from /data/dd, split 'test'`."""
    if not split.paths:
        return _rows(split)
    where = _paths(split.paths) + (f", split {split.split!r}" if split.split else "")
    if split.rows is None:
        return f"{where} ({_rows(split)})"
    return f"{_rows(split)} from {where}"


def columns_text(columns: Mapping[str, str]) -> str:
    """`sentence1 (text), sentence2 (text_pair), label`: each column, with its role where the
    name does not say it."""
    return ", ".join(name if name == role else f"{name} ({role})" for role, name in columns.items())


def _builtin_text(data: DataSpec, origin: DataOrigin) -> str:
    name = f"built-in {origin.dataset}"
    if details := data.kind.details(data):
        name += f" ({details})"
    t, h = origin.train.rows, origin.test.rows
    if t is None or h is None:
        return f"{name}, {_rows(SplitOrigin())}"
    return f"{name}, {t:,} train / {h:,} held-out rows"


def data_text(origin: DataOrigin) -> str:
    """The data on one line (the controller's `data_opened` event message)."""
    text = (
        f"{'built-in ' if origin.builtin else ''}{origin.dataset}: train "
        f"{split_text(origin.train)}; held-out {split_text(origin.test)}"
    )
    return f"{text}; columns {columns_text(origin.columns)}" if origin.columns else text


def provenance(spec: JobSpec, origin: DataOrigin | None = None) -> list[tuple[str, str]]:
    """(label, text) rows: where the model and the data came from. `origin`: the newest
    `DataOpened` report's (rows per split); without one, the spec's data set and paths. A job of
    a seeded model on a built-in data set is one row."""
    origin = origin or describe_data(spec.data)
    if spec.model.pretrained is None and origin.builtin:
        return [("model, data", f"{model_text(spec.model)} on {_builtin_text(spec.data, origin)}")]
    rows = [("model", model_text(spec.model))]
    if origin.builtin:
        rows.append(("data", _builtin_text(spec.data, origin)))
        return rows
    rows.append(("data", f"{origin.dataset}; columns {columns_text(origin.columns)}"))
    rows.append(("train", split_text(origin.train)))
    rows.append(("held-out", split_text(origin.test)))
    return rows
