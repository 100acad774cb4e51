"""Where a job's model and data came from (issue 23): what `core.provenance` says for a spec and
the workers' row counts, the `DataOpened` report that carries it to the controller, and how
`pipetransformer status` and the end-of-run summary show it, on a store filled by hand (the real
jobs' output is checked in tests/test_hf_jobs.py and tests/test_e2e.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from pipetransformer.core.protocol import DataOpened, DataOrigin, SplitOrigin, parse_event
from pipetransformer.core.provenance import (
    DATA_OPENED,
    data_text,
    describe_data,
    model_text,
    origin_of,
    provenance,
)
from pipetransformer.core.spec import DataSpec, JobSpec, parse_spec
from pipetransformer.core.tasks import task_of
from pipetransformer.orchestrator.cli import main
from pipetransformer.orchestrator.report import print_summary
from pipetransformer.store import Store, sqlite_url

COMMIT = "0123456789abcdef0123456789abcdef01234567"
FINGERPRINT = "fedcba9876543210fedcba9876543210"
# what resolve_submission leaves in a stored spec: the checkpoint's architecture, absolute paths
RESOLVED_VIT = {"family": "vit", "dim": 32, "depth": 3, "heads": 2, "image_size": 16,
                "patch_size": 4, "channels": 3, "num_classes": 10}  # fmt: skip


def _pretrained_spec(pretrained: dict, data: dict) -> JobSpec:
    return parse_spec(
        {
            "name": "hf",
            "model": {**RESOLVED_VIT, "pretrained": pretrained},
            "data": data,
            "parallel": {"stages": 1},
        }
    )


def hub_spec() -> JobSpec:
    return _pretrained_spec(
        {
            "source": "acme/vit-tiny",
            "revision": "v2",
            "path": f"/hub/models--acme--vit-tiny/snapshots/{COMMIT}",
            "fingerprint": FINGERPRINT,
            "commit": COMMIT,
        },
        {
            "dataset": "table",
            "train": ["/data/a.parquet", "/data/b.parquet", "/data/c.parquet", "/data/d.parquet"],
            "test": "/data/test.parquet",
            "columns": {"image": "img", "label": "label"},
        },
    )


# -- what it says ------------------------------------------------------------------------------


def test_describe_each_kind_of_data() -> None:
    folder = describe_data(
        DataSpec(dataset="image-folder", train="/im/train", test="/im/test"), 120, 40
    )
    assert folder == DataOrigin(
        dataset="image-folder",
        builtin=False,
        train=SplitOrigin(rows=120, paths=["/im/train"]),
        test=SplitOrigin(rows=40, paths=["/im/test"]),
        columns={"image": "image", "label": "label"},
    )
    pairs = DataSpec(
        dataset="table",
        train=["/t/1.parquet", "/t/2.parquet"],
        test="/t/test.parquet",
        columns={"text": "sentence1", "text_pair": "sentence2"},
    )
    table = describe_data(pairs, 96, 32)
    assert table.train.paths == ["/t/1.parquet", "/t/2.parquet"] and table.train.split is None
    assert table.columns == {"text": "sentence1", "text_pair": "sentence2", "label": "label"}
    assert data_text(table) == (
        "table: train 96 rows from /t/1.parquet, /t/2.parquet; held-out 32 rows from "
        "/t/test.parquet; columns sentence1 (text), sentence2 (text_pair), label"
    )
    dd = describe_data(
        DataSpec(dataset="table", path="/dd", test_split="validation", columns={"text": "s"}),
        7,
        3,
    )
    assert (dd.train.paths, dd.train.split, dd.test.split) == (["/dd"], "train", "validation")
    assert data_text(dd) == (
        "table: train 7 rows from /dd, split 'train'; held-out 3 rows from /dd, split "
        "'validation'; columns s (text), label"
    )
    digits = describe_data(DataSpec(), 1437, 360)
    assert digits.builtin and digits.dataset == "digits" and not digits.columns
    assert (digits.train.rows, digits.train.paths) == (1437, [])
    assert data_text(digits) == "built-in digits: train 1,437 rows; held-out 360 rows"
    unopened = describe_data(pairs)  # from the spec alone: no rows yet
    assert unopened.train.rows is None and unopened.test.rows is None
    corpus = DataSpec(dataset="table", train="/c/train.jsonl", test="/c/test.jsonl")
    lm = describe_data(corpus, 53, 7, task=task_of("causal-lm"), sequences=(2456, 280))
    assert (lm.train.sequences, lm.test.sequences, lm.train.windows) == (2456, 280, None)
    assert data_text(lm) == (
        "table: train 53 rows (2,456 packed sequences) from /c/train.jsonl; held-out 7 rows "
        "(280 packed sequences) from /c/test.jsonl; columns text"
    )


def test_the_model_reads_as_its_source() -> None:
    hub = hub_spec().model
    assert model_text(hub) == (
        "acme/vit-tiny (hub), revision v2, snapshot 0123456789ab (vit, 3 blocks of dim 32, 10 "
        "classes; fingerprint fedcba987654)"
    )
    local = _pretrained_spec(
        {"source": "./vit", "path": "/models/vit", "fingerprint": FINGERPRINT},
        {"dataset": "image-folder", "train": "/im/train", "test": "/im/test"},
    ).model
    assert model_text(local) == (
        "/models/vit (vit, 3 blocks of dim 32, 10 classes; fingerprint fedcba987654)"
    )
    default_branch = hub.model_copy(
        update={"pretrained": hub.pretrained.model_copy(update={"revision": None})}
    )
    assert "acme/vit-tiny (hub), revision main, snapshot 0123456789ab" in model_text(default_branch)
    assert model_text(JobSpec(name="x").model) == "seeded vit, 6 blocks of dim 64, 10 classes"


def test_provenance_rows() -> None:
    spec = hub_spec()
    opened = describe_data(spec.data, 1000, 250)
    rows = dict(provenance(spec, opened))
    assert list(rows) == ["model", "data", "train", "held-out"]
    assert rows["model"].startswith("acme/vit-tiny (hub), revision v2")
    assert rows["data"] == "table; columns img (image), label"
    assert rows["train"] == (
        "1,000 rows from /data/a.parquet, /data/b.parquet, /data/c.parquet and 1 more"
    )
    assert rows["held-out"] == "250 rows from /data/test.parquet"
    # before the workers opened the data: the spec's paths, no rows
    before = dict(provenance(spec))
    assert before["held-out"] == "/data/test.parquet (rows not reported yet)"
    # a seeded model on a built-in data set: one line
    builtin = JobSpec(name="x", data={"dataset": "digits", "classes": [3, 5]},
                      model={"num_classes": 2, "image_size": 8, "channels": 1})  # fmt: skip
    assert provenance(builtin, describe_data(builtin.data, 280, 70)) == [
        (
            "model, data",
            "seeded vit, 6 blocks of dim 64, 2 classes on built-in digits (classes 3, 5), "
            "280 train / 70 held-out rows",
        )
    ]
    synthetic = JobSpec(name="x", data={"dataset": "synthetic", "synthetic_samples": 512})
    assert provenance(synthetic)[0][1].endswith(
        "on built-in synthetic (512 samples, seed 0), rows not reported yet"
    )


def test_a_data_report_round_trips_through_the_protocol() -> None:
    origin = describe_data(hub_spec().data, 1000, 250)
    event = DataOpened(rank=0, generation=3, origin=origin)
    parsed = parse_event(event.model_dump_json())
    assert isinstance(parsed, DataOpened) and parsed.origin == origin
    stored = parsed.payload()  # what the controller records as the event's data
    assert origin_of(stored) == origin
    assert origin_of(None) is None and origin_of({"origin": {"dataset": "x"}}) is None
    with pytest.raises(ValueError, match="rows"):
        SplitOrigin(rows=-1)


# -- status and the summary, on a store filled by hand -----------------------------------------


def _store(tmp_path: Path) -> str:
    url = sqlite_url(tmp_path / "store.db")
    with Store.open(url) as store:
        store.create_job("hub", hub_spec(), str(tmp_path))
        store.create_job("seeded", JobSpec(name="seeded"), str(tmp_path))
        for generation, rows in ((1, 999), (2, 1000)):  # the newest report is the one shown
            event = DataOpened(
                rank=0,
                generation=generation,
                time=100.0 + generation,
                origin=describe_data(hub_spec().data, rows, 250),
            )
            store.add_event("hub", DATA_OPENED, "", rank=0, data=event.payload(), time=event.time)
    return url


def _flat(text: str) -> str:
    """Without whitespace: a table may fold a long path across lines."""
    return "".join(text.split())


def test_status_and_summary_show_where_model_and_data_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _store(tmp_path)
    assert main(["status", "hub", "--db", url]) == 0
    out = _flat(capsys.readouterr().out)
    for text in (
        "acme/vit-tiny (hub), revision v2, snapshot 0123456789ab",
        "fingerprint fedcba987654",
        "1,000 rows from /data/a.parquet",
        "250 rows from /data/test.parquet",
        "img (image), label",
    ):
        assert _flat(text) in out
    # the JSON has what the text shows: the model's source, the data with its rows, typed
    assert main(["status", "hub", "--db", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["model"]["pretrained"]["source"] == "acme/vit-tiny"
    assert shown["model"]["pretrained"]["commit"].startswith("0123456789ab")
    assert DataOrigin.model_validate(shown["data"]).train.rows == 1000
    assert shown["data"]["test"]["paths"] == ["/data/test.parquet"]
    assert shown["provenance"]["train"].startswith("1,000 rows from /data/a.parquet")
    assert "fingerprint fedcba987654" in shown["provenance"]["model"]
    assert main(["status", "seeded", "--db", url]) == 0
    out = _flat(capsys.readouterr().out)
    assert _flat("seeded vit, 6 blocks of dim 64, 10 classes on built-in digits") in out

    console = Console(file=io.StringIO(), width=100)
    with Store.open(url, migrate=False) as store:
        print_summary(
            console,
            store,
            "hub",
            wall_s=1.0,
            store_url=url,
            checkpoints=tmp_path,
            where=f"--db {url}",
        )
    summary = _flat(console.file.getvalue())
    assert _flat("1,000 rows from /data/a.parquet") in summary
    assert _flat("revision v2, snapshot 0123456789ab") in summary
