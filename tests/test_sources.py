"""Users' data sources (trainer/sources): image folders, tables, text, SQuAD windows and metrics,
and exactly-once reading through a DataLoader driven by the elastic sampler. Every asset is made
here in tmp_path (nothing is downloaded)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from pipetransformer.core.sampler import IGNORE, ElasticSampler
from pipetransformer.trainer.failures import own_failure
from pipetransformer.trainer.sources import DataError
from pipetransformer.trainer.sources import dataset as dataset_module
from pipetransformer.trainer.sources.dataset import (
    ElasticBatches,
    EpochBatches,
    SampleKey,
    SourceDataset,
    elastic_loader,
)
from pipetransformer.trainer.sources.image_folder import (
    Augmentation,
    ImagePreprocessor,
    decode_image,
    open_image_folder,
    preprocess,
)
from pipetransformer.trainer.sources.tabular import Columns, open_split, open_splits
from pipetransformer.trainer.sources.text import (
    TextEncoder,
    check_fast_tokenizer,
    squad_metrics,
    squad_windows,
)

# --- assets ----------------------------------------------------------------------------------

WORDS = (
    "the a an cat dog sat on mat what where who is was did answer paris france capital city "
    "of in river seine flows through big small red blue green house tree"
).split()


def _image(seed: int, size: tuple[int, int] = (23, 17)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    for k, cls in enumerate(["zebra", "ant"]):  # sorted: ant=0, zebra=1
        (root / cls).mkdir(parents=True)
        _image(10 * k).save(root / cls / "one.png")
        _image(10 * k + 1).save(root / cls / "two.jpg", quality=95)
    return root


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A tokenizer (BERT WordPiece from a tiny vocab), a config.json and a ViT image processor."""
    d = tmp_path / "model"
    d.mkdir()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "?", ".", ","]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    from transformers import BertTokenizerFast

    BertTokenizerFast(vocab=str(d / "vocab.txt")).save_pretrained(str(d))
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": len(vocab)}))
    (d / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "ViTImageProcessor",
                "size": {"height": 12, "width": 10},
                "resample": 3,
                "do_resize": True,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.485, 0.456, 0.406],
                "image_std": [0.229, 0.224, 0.225],
            }
        )
    )
    return d


# --- image folder ----------------------------------------------------------------------------


def test_image_folder_labels_decode_and_memory_map(image_folder: Path, tmp_path: Path) -> None:
    ds = open_image_folder(image_folder, cache_dir=tmp_path / "cache")
    assert ds.features["label"].names == ["ant", "zebra"]
    assert ds.cache_files, "the index is memory-mapped arrow"
    rows = ds.cast_column("image", datasets.Image(decode=False))
    names = [(Path(r["image"]["path"]).parent.name, r["label"]) for r in rows]
    assert sorted(names) == [("ant", 0), ("ant", 0), ("zebra", 1), ("zebra", 1)]
    suffixes = set()
    for r in rows:
        im = decode_image(r["image"])
        assert im.mode == "RGB" and im.size == (23, 17)
        suffixes.add(Path(r["image"]["path"]).suffix)
    assert suffixes == {".png", ".jpg"}
    png = next(r for r in rows if r["image"]["path"].endswith("ant/one.png"))
    assert np.array_equal(np.asarray(decode_image(png["image"])), np.asarray(_image(10)))
    # the same listing reuses the index
    assert (
        open_image_folder(image_folder, cache_dir=tmp_path / "cache").cache_files == ds.cache_files
    )


def test_preprocess_matches_transformers_image_processor(model_dir: Path) -> None:
    """Tolerance: 1e-5 absolute on normalised values (both resize with Pillow; the arithmetic
    differs only in float rounding)."""
    images = [_image(3), _image(4, (40, 31))]
    ours = preprocess(images, model_dir, backend="native")
    theirs = preprocess(images, model_dir, backend="transformers")
    assert ours.shape == (2, 3, 12, 10) and ours.dtype == torch.float32
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)
    single = preprocess(images[0], json.loads((model_dir / "preprocessor_config.json").read_text()))
    assert single.shape == (3, 12, 10) and torch.allclose(single, ours[0], atol=1e-6)
    assert ImagePreprocessor(model_dir, backend="auto").processor is not None


def test_augmentation_reproducible_per_seed_epoch_id(
    image_folder: Path, tmp_path: Path, model_dir: Path
) -> None:
    ds = open_image_folder(image_folder, cache_dir=tmp_path / "cache")
    plain = SourceDataset(ds, Columns(image="image"), image=ImagePreprocessor(model_dir))
    aug = SourceDataset(
        ds, Columns(image="image"), image=ImagePreprocessor(model_dir), augmentation=Augmentation(7)
    )
    assert plain.deterministic and not aug.deterministic
    a = aug[SampleKey(1, epoch=0)].inputs
    assert torch.equal(a, aug[SampleKey(1, epoch=0)].inputs)
    assert a.shape == (3, 12, 10)
    other = SourceDataset(
        ds, Columns(image="image"), image=ImagePreprocessor(model_dir), augmentation=Augmentation(7)
    )
    assert torch.equal(a, other[SampleKey(1, epoch=0)].inputs)
    assert not torch.equal(a, aug[SampleKey(1, epoch=1)].inputs)
    assert torch.equal(plain[SampleKey(1, 0)].inputs, plain[SampleKey(1, 1)].inputs)


def test_unreadable_image_names_the_file(
    image_folder: Path, tmp_path: Path, model_dir: Path
) -> None:
    bad = image_folder / "ant" / "broken.jpg"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(DataError, match="broken.jpg"):
        open_image_folder(image_folder, cache_dir=tmp_path / "c1", verify=True)
    ds = open_image_folder(image_folder, cache_dir=tmp_path / "c2")  # lazy: fails on read
    src = SourceDataset(ds, Columns(image="image"), image=ImagePreprocessor(model_dir))
    i = [Path(p["path"]).name for p in src.table["image"]].index("broken.jpg")
    with pytest.raises(DataError, match=rf"broken\.jpg.* \(row {i}\)"):
        src[i]
    # read by a DataLoader's loader process, it comes back as torch re-raises it (the loader's
    # traceback as its message); the worker still reports it in one line, as one a restart repeats
    loader = torch.utils.data.DataLoader(src, batch_size=None, sampler=[i], num_workers=1)
    with pytest.raises(DataError) as raised:
        next(iter(loader))
    assert "DataLoader worker process 0" in str(raised.value)
    error, repeats = own_failure(raised.value)
    assert repeats and error.startswith("DataError: cannot read image ") and "\n" not in error
    assert "broken.jpg" in error and error.endswith(f"(row {i})")
    assert own_failure(RuntimeError("CUDA error\nmore")) == ("RuntimeError: CUDA error", False)


# --- tables ----------------------------------------------------------------------------------


def _rows(n: int, offset: int = 0) -> dict[str, list]:
    return {
        "sentence": [f"the cat sat on mat {i}" for i in range(offset, offset + n)],
        "other": [f"what is {i}" for i in range(offset, offset + n)],
        "y": [i % 3 for i in range(offset, offset + n)],
    }


def _write(tmp_path: Path, fmt: str, name: str, rows: dict[str, list]) -> Path:
    ds = datasets.Dataset.from_dict(rows)
    path = tmp_path / f"{name}.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.table(rows), path)
    elif fmt == "jsonl":
        ds.to_json(str(path), lines=True)
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    return path


COLS = Columns(text="sentence", text_pair="other", label="y")


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_files_read_with_named_columns_and_splits(tmp_path: Path, fmt: str) -> None:
    files = {
        "fit": [_write(tmp_path, fmt, "a", _rows(5)), _write(tmp_path, fmt, "b", _rows(4, 5))],
        "holdout": _write(tmp_path, fmt, "c", _rows(3, 100)),
    }
    out = open_splits(
        files, COLS, splits=("fit", "holdout"), num_labels=3, cache_dir=tmp_path / "hf"
    )
    assert [len(out["fit"]), len(out["holdout"])] == [9, 3]
    assert out["fit"][6]["sentence"] == "the cat sat on mat 6"
    for ds in out.values():
        assert ds.cache_files, f"{fmt}: memory-mapped arrow, not an in-memory table"


def test_save_to_disk_and_arrow(tmp_path: Path) -> None:
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(_rows(6)),
            "test": datasets.Dataset.from_dict(_rows(2)),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    out = open_splits(tmp_path / "dd", COLS, num_labels=3)
    assert len(out["train"]) == 6 and out["train"].cache_files
    one = open_split(tmp_path / "dd" / "train", "train", COLS, 3)  # a Dataset directory
    assert len(one) == 6 and one.cache_files
    arrow = Path(out["test"].cache_files[0]["filename"])
    assert len(open_split(arrow, "test", COLS, 3).cache_files) == 1
    with pytest.raises(DataError, match="no split 'validation'"):
        open_splits(tmp_path / "dd", COLS, splits=("train", "validation"))


def test_table_errors_name_file_column_row(tmp_path: Path) -> None:
    a = _write(tmp_path, "parquet", "a", _rows(4))
    bad_rows = _rows(5)
    bad_rows["y"][3] = 7
    b = _write(tmp_path, "parquet", "b", bad_rows)
    with pytest.raises(
        DataError, match=r"b\.parquet: column 'y' row 3 holds label 7, outside \[0, 3\)"
    ):
        open_split([a, b], "train", COLS, num_labels=3)
    neg = _rows(3)
    neg["y"][0] = -1
    with pytest.raises(DataError, match=r"n\.jsonl: column 'y' row 0 holds label -1"):
        open_split(_write(tmp_path, "jsonl", "n", neg), "train", COLS, num_labels=3)
    with pytest.raises(DataError, match=r"a\.parquet.*no column 'label'"):
        open_split(a, "train", Columns(text="sentence", label="label"), 3)
    empty = tmp_path / "e.parquet"
    pq.write_table(
        pa.table({"sentence": pa.array([], pa.string()), "y": pa.array([], pa.int64())}), empty
    )
    with pytest.raises(DataError, match=r"split 'test' \(.*e\.parquet\) is empty"):
        open_split(empty, "test", Columns(text="sentence", label="y"), 3)
    with pytest.raises(DataError, match="missing.csv does not exist"):
        open_split(tmp_path / "missing.csv", "train", COLS, 3)


# --- text ------------------------------------------------------------------------------------


def test_single_and_pair_tokenisation(model_dir: Path) -> None:
    enc = TextEncoder(model_dir, max_length=12)
    one = enc.encode("the cat sat")
    assert one.shape == (3, 12) and one.dtype == torch.int64
    cls, sep = enc.tokenizer.cls_token_id, enc.tokenizer.sep_token_id
    assert one[0, 0] == cls and one[0, 4] == sep and one[0, 5:].eq(0).all()  # padded
    assert one[2].tolist() == [1] * 5 + [0] * 7 and one[1].eq(0).all()
    pair = enc.encode("what is the capital", "paris is")
    assert pair.shape == (3, 12)
    assert pair[1].tolist() == [0] * 6 + [1] * 3 + [0] * 3  # second segment typed 1
    assert pair[2].sum() == 9
    long = enc.encode(" ".join(["cat"] * 40), " ".join(["dog"] * 40))
    assert long[2].all() and long[0, -1] == sep  # truncated to max_length


def test_tokenizer_vocab_mismatch(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "vocab_size": 30522}))
    with pytest.raises(DataError, match=r"has \d+ tokens but .*config.json has vocab_size 30522"):
        TextEncoder(model_dir, max_length=8)
    TextEncoder(model_dir, max_length=8, allow_larger_embedding=True)


def test_text_source_dataset(tmp_path: Path, model_dir: Path) -> None:
    ds = open_split(_write(tmp_path, "parquet", "t", _rows(4)), "train", COLS, 3)
    src = SourceDataset(ds, COLS, text=TextEncoder(model_dir, max_length=16))
    s = src[2]
    assert s.inputs.shape == (3, 16) and s.label == 2 and s.id == 2


# --- SQuAD -----------------------------------------------------------------------------------


def test_squad_windows_point_at_the_answer(model_dir: Path) -> None:
    enc = TextEncoder(model_dir, max_length=24)
    filler = " ".join(["the big red house"] * 6)
    context = f"{filler} paris is the capital of france . {filler}"
    start = context.index("paris")
    ex = {
        "id": "q1",
        "question": "what is the capital of france ?",
        "context": context,
        "answers": {"text": ["paris"], "answer_start": [start]},
    }
    tok = enc.tokenizer
    check_fast_tokenizer(tok)
    feats = squad_windows(
        tok, ex["id"], ex["question"], context, ex["answers"], enc.max_length, stride=6
    )
    assert len(feats) > 2
    hits = 0
    for f in feats:
        assert len(f["input_ids"]) == len(f["token_type_ids"]) == len(f["attention_mask"]) == 24
        ctx = [o for o in f["offsets"] if o is not None]
        if ctx[0][0] <= start and ctx[-1][1] >= start + len("paris"):
            hits += 1
            span = f["input_ids"][f["start"] : f["end"] + 1]
            assert tok.decode(span) == "paris"
            assert context[f["offsets"][f["start"]][0] : f["offsets"][f["end"]][1]] == "paris"
        else:
            assert f["start"] == f["end"] == 0 and f["input_ids"][0] == tok.cls_token_id
    assert hits >= 1
    # consecutive windows overlap by the stride
    first, second = feats[0]["offsets"], feats[1]["offsets"]
    a = [o for o in first if o is not None]
    b = [o for o in second if o is not None]
    assert a[-6:] == b[:6]


def test_squad_metrics_official_definitions() -> None:
    refs = {"a": ["The Eiffel Tower"], "b": ["Paris", "paris, France"], "c": ["blue whale"]}
    preds = {"a": "eiffel tower!", "b": "France", "c": "a red whale"}
    m = squad_metrics(preds, refs)
    # a: exact after normalisation; b: best F1 = 2*(1/1*1/2)/(1+1/2) = 2/3; c: F1 = 1/2
    assert m["exact_match"] == pytest.approx(100 / 3)
    assert m["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 / 2) / 3)
    assert squad_metrics({"a": "Eiffel Tower"}, {"a": ["the eiffel tower"]}) == {
        "exact_match": 100.0,
        "f1": 100.0,
    }
    assert squad_metrics({"a": "nothing"}, {"a": ["something"]}) == {"exact_match": 0.0, "f1": 0.0}
    hf = squad_metrics(
        [{"id": "x", "prediction_text": "an apple"}],
        [{"id": "x", "answers": {"text": ["apple"], "answer_start": [0]}}],
    )
    assert hf["exact_match"] == 100.0


# --- exactly once through a DataLoader -------------------------------------------------------


def test_dataloader_exactly_once_across_replica_change(tmp_path: Path, model_dir: Path) -> None:
    n = 37
    ds = open_split(_write(tmp_path, "parquet", "p", _rows(n)), "train", COLS, 3)
    src = SourceDataset(ds, COLS, text=TextEncoder(model_dir, max_length=8))
    sampler = ElasticSampler(n, global_batch=8, seed=5)
    seen: list[int] = []
    cursor = 0
    for replicas, steps in ((2, 2), (4, None)):  # 2 replicas for 2 steps, then 4 to the end
        plans = [ElasticBatches(sampler, 3, cursor, replicas, r, steps) for r in range(replicas)]
        for plan in plans:
            for batch in elastic_loader(src, plan, num_workers=2):
                assert batch.inputs.shape == (8 // replicas, 3, 8)
                real = batch.label != IGNORE
                seen.extend(batch.id[real].tolist())
        assert len({p.end_cursor for p in plans}) == 1
        cursor = plans[0].end_cursor
    assert cursor == n
    assert sorted(seen) == list(range(n))


def test_source_pickles_small_and_reads_the_same(tmp_path: Path, model_dir: Path) -> None:
    """What DataLoader workers get under spawn/forkserver: the memory-mapped file, not the rows."""
    rows = _rows(2000)
    rows["sentence"] = [s + " " + "x" * 200 for s in rows["sentence"]]  # ~0.4 MB of text
    ds = open_split(_write(tmp_path, "parquet", "big", rows), "train", COLS, 3)
    src = SourceDataset(ds, COLS, text=TextEncoder(model_dir, max_length=8))
    blob = pickle.dumps(src)
    assert len(blob) < 200_000, len(blob)
    back = pickle.loads(blob)
    assert torch.equal(back[1234].inputs, src[1234].inputs) and back[1234].id == 1234


def test_image_column_in_parquet(tmp_path: Path, model_dir: Path) -> None:
    """Hugging Face image data sets in parquet keep the encoded image bytes in the column."""
    ds = datasets.Dataset.from_dict(
        {"img": [_image(1), _image(2)], "label": [1, 0]},
        features=datasets.Features(
            {"img": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}
        ),
    )
    ds.to_parquet(str(tmp_path / "im.parquet"))
    table = open_split(tmp_path / "im.parquet", "train", Columns(image="img"), 2)
    src = SourceDataset(table, Columns(image="img"), image=ImagePreprocessor(model_dir))
    s = src[0]
    assert s.label == 1 and torch.allclose(s.inputs, preprocess(_image(1), model_dir), atol=1e-6)


# --- batched reads, readers across epochs ------------------------------------------------------


def _mixed_folder(root: Path) -> Path:
    """Images of several sizes (a batch is resized image by image)."""
    for k, cls in enumerate(["a", "b"]):
        (root / cls).mkdir(parents=True)
        for j, size in enumerate([(23, 17), (40, 31), (9, 14)]):
            _image(10 * k + j, size).save(root / cls / f"{j}.png")
    return root


@pytest.mark.parametrize("backend", ["native", "transformers"])
@pytest.mark.parametrize("chunks", [False, True])
def test_a_batch_reads_as_its_rows_do(
    tmp_path: Path, model_dir: Path, backend: str, chunks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`__getitems__` (one arrow read, one processor call per chunk of rows) gives what reading
    each row alone does: the same inputs, labels (IGNORE for padding) and ids, in the keys'
    order, duplicates included; augmentation still draws per (epoch, id). `chunks`: reads of 3
    rows, the processor called after each image (the decoded-bytes bound)."""
    if chunks:
        monkeypatch.setattr(dataset_module, "ROWS_PER_READ", 3)
        monkeypatch.setattr(dataset_module, "DECODED_BYTES_PER_CALL", 1)
    ds = open_image_folder(_mixed_folder(tmp_path / "mixed"), cache_dir=tmp_path / "cache")
    pre = ImagePreprocessor(model_dir, backend=backend)
    cols = Columns(image="image")
    keys = [SampleKey(4, 0), SampleKey(1, 0), SampleKey(4, 0, valid=False), SampleKey(0, 2)]
    rows = ds.cast_column("image", datasets.Image(decode=False))
    for aug in (None, Augmentation(3)):
        src = SourceDataset(ds, cols, image=pre, augmentation=aug)
        batch = src.__getitems__(keys)
        assert [(s.id, s.label) for s in batch] == [(4, 1), (1, 0), (4, IGNORE), (0, 0)]
        for s, k in zip(batch, keys, strict=True):
            picture = decode_image(rows[k.index]["image"])
            if aug is not None:
                picture = aug(picture, k.epoch, k.index)
            assert torch.equal(s.inputs, pre(picture)), (backend, aug, k)
            assert torch.equal(s.inputs, src[k].inputs)
    stacked = pre.batch([_image(1), _image(2, (40, 31))])
    assert stacked.shape == (2, 3, 12, 10) and stacked.dtype == torch.float32
    assert torch.equal(stacked[1], pre(_image(2, (40, 31))))
    assert pre.batch([]).shape == (0, 3, 12, 10)


def test_a_training_reader_runs_on_across_epochs(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Feed(epochs=E)` starts one reader (one set of loader processes) for all E epochs and
    reads every batch the sampler hands out, each epoch in its own order; without `epochs` a
    reader reads one epoch; a resume mid-epoch starts a reader from the cursor. Batches reach
    the loop as one tensor of inputs with ids and labels inline (numpy)."""
    from pipetransformer.trainer.feed import Feed
    from pipetransformer.trainer.sources.splits import SourceSplit

    ds = open_image_folder(_mixed_folder(tmp_path / "mixed"), cache_dir=tmp_path / "cache")
    src = SourceDataset(ds, Columns(image="image"), image=ImagePreprocessor(model_dir))
    split = SourceSplit(src, torch.tensor(ds["label"]))
    sampler = ElasticSampler(len(split), global_batch=4, seed=1)  # 2 steps, the last padded
    starts: list[tuple] = []
    original = Feed._start

    def counted(self: Feed, *at: int) -> None:
        starts.append(at)
        original(self, *at)

    monkeypatch.setattr(Feed, "_start", counted)

    def read(feed: Feed, epochs: range, cursor: int = 0) -> None:
        for epoch in epochs:
            while cursor < len(split):
                b = sampler.batch(epoch, cursor, 1, 0)
                assert torch.equal(feed.inputs(epoch, cursor, 1, 0, b), split.read(b.indices))
                cursor = b.next_cursor
            cursor = 0
        feed.close()

    read(Feed(split, sampler, workers=1, epochs=3), range(3))
    assert starts == [(0, 0, 1, 0)]
    starts.clear()
    read(Feed(split, sampler, workers=1), range(2))
    assert starts == [(0, 0, 1, 0), (1, 0, 1, 0)]
    starts.clear()
    read(Feed(split, sampler, workers=0, epochs=4), range(2, 4), cursor=4)  # resumed mid-epoch
    assert starts == [(2, 4, 1, 0)]
    batches = EpochBatches(sampler, 2, 4, 1, 0, end_epoch=4)
    assert len(batches) == 3 and [k.epoch for b in batches for k in b] == [2] * 4 + [3] * 8
    batch = next(iter(elastic_loader(src, batches, num_workers=1)))
    assert isinstance(batch.id, np.ndarray) and batch.id.dtype == np.int64
    assert batch.id.tolist() == sampler.batch(2, 4, 1, 0).indices.tolist()
    assert isinstance(batch.label, np.ndarray) and isinstance(batch.inputs, torch.Tensor)
