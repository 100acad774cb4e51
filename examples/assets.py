"""Small Hugging Face checkpoints and data sets made here (nothing is downloaded), for the CPU
examples and the tests: what `save_pretrained` writes for a ViT and a BERT, with the image
processor and tokenizer they come with, an image folder and a sentence-pair parquet table.

    .venv/bin/python examples/assets.py [DIR]      # default: examples/assets (git-ignored)

writes DIR/vit-tiny, DIR/digits-images/{train,test}, DIR/bert-tiny, DIR/pairs/{train,test}.parquet
and DIR/squad/{train,test}.parquet; `examples/hf-vit-images.yaml`, `examples/hf-bert-pairs.yaml`
and `examples/hf-bert-squad.yaml` train on them. The SQuAD-format questions ask the colour of one
thing a few sentences describe. The images are scikit-learn's 8x8 digits drawn as 32x32 RGB PNGs; the sentence
pairs ask whether the second sentence names the first sentence's colour (a task a small encoder
learns in a few epochs). The checkpoints are pretrained here for a few seconds on a source task
(the ViT on digits 0-4, the BERT on naming a sentence's colour), standing in for a real
pretrained model: fine-tuning gets a new head, and its bottom blocks already carry features."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

VOCAB_WORDS = (
    "the a is of and in on with big small old new red blue green yellow black white house tree "
    "car boat bird cat dog fish box ball hat cup door road river hill"
).split()
COLOURS = ["red", "blue", "green", "yellow", "black", "white"]
THINGS = ["house", "tree", "car", "boat", "bird", "cat", "dog", "fish", "box", "ball", "hat", "cup"]


def make_vit(
    directory: Path,
    *,
    image_size: int = 32,
    patch_size: int = 8,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    num_labels: int = 10,
    seed: int = 0,
) -> Path:
    """A ViT image classifier and its image processor, as `save_pretrained` writes them."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification
    from transformers import ViTImageProcessorPil as ViTImageProcessor

    torch.manual_seed(seed)
    config = ViTConfig(
        image_size=image_size,
        patch_size=patch_size,
        num_channels=3,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 4,
        num_labels=num_labels,
    )
    ViTForImageClassification(config).save_pretrained(directory)
    ViTImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(directory)
    return directory


def make_bert(
    directory: Path,
    *,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    num_labels: int = 2,
    max_positions: int = 64,
    seed: int = 0,
) -> Path:
    """A BERT sequence classifier and its WordPiece tokenizer, as `save_pretrained` writes them."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *VOCAB_WORDS, ".", "?"]
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab=str(directory / "vocab.txt")).save_pretrained(directory)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden * 4,
        max_position_embeddings=max_positions,
        num_labels=num_labels,
    )
    BertForSequenceClassification(config).save_pretrained(directory)
    return directory


def make_digit_images(
    root: Path,
    per_class: int | None = None,
    size: int = 32,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> Path:
    """scikit-learn's digits as `root/{train,test}/<digit>/<n>.png` RGB images of `size` pixels."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(seed)
    for label in range(10):
        idx = np.flatnonzero(digits.target == label)
        rng.shuffle(idx)
        if per_class is not None:
            idx = idx[:per_class]
        n_test = max(1, round(len(idx) * test_fraction))
        for split, chosen in (("test", idx[:n_test]), ("train", idx[n_test:])):
            folder = root / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                grey = (digits.images[i] * (255 / 16)).astype(np.uint8)
                tint = np.array([1.0, 0.8 + 0.2 * (i % 2), 0.9], dtype=np.float32)
                rgb = (grey[..., None] * tint).astype(np.uint8)
                Image.fromarray(rgb).resize((size, size), Image.BILINEAR).save(folder / f"{i}.png")
    return root


def pair_rows(n: int, seed: int) -> dict[str, list]:
    """Sentence pairs: label 1 when the second sentence names the first sentence's colour."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"sentence1": [], "sentence2": [], "label": []}
    for _ in range(n):
        colour, thing = rng.choice(COLOURS), rng.choice(THINGS)
        same = bool(rng.integers(0, 2))
        other = colour if same else rng.choice([c for c in COLOURS if c != colour])
        rows["sentence1"].append(f"the {thing} is {colour} .")
        rows["sentence2"].append(f"a {other} {rng.choice(THINGS)} is on the {rng.choice(THINGS)} .")
        rows["label"].append(int(same))
    return rows


def _parquet_splits(root: Path, rows, train: int, test: int, seed: int) -> Path:  # noqa: ANN001
    """`root/train.parquet` and `root/test.parquet` of `rows(n, seed)`, each its own seed."""
    import datasets

    root.mkdir(parents=True, exist_ok=True)
    for split, n, s in (("train", train, seed), ("test", test, seed + 1)):
        datasets.Dataset.from_dict(rows(n, s)).to_parquet(str(root / f"{split}.parquet"))
    return root


def make_pairs(root: Path, train: int = 1200, test: int = 300, seed: int = 0) -> Path:
    """`root/train.parquet` and `root/test.parquet` of sentence pairs (`pair_rows`)."""
    return _parquet_splits(root, pair_rows, train, test, seed)


PLACES = ["on", "in", "with"]


SIZES = ["big", "small", "old", "new"]


def squad_rows(n: int, seed: int, facts: int = 5) -> dict[str, list]:
    """SQuAD-format questions: a context of `facts` sentences about different things, one of
    them coloured ("the red car is on the hill .", the others sized: "the big boat is in the
    cup ."), a question naming the coloured thing ("the car is ?") and its colour the answer
    (text and character start, as SQuAD's `answers` has them). Long enough to need several
    windows at a short seq_len; simple enough for a small encoder to learn in a minute."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"id": [], "question": [], "context": [], "answers": []}
    for q in range(n):
        things = rng.choice(THINGS, size=facts + 1, replace=False)
        k = int(rng.integers(0, facts))
        colour = str(rng.choice(COLOURS))
        sentences, at, start = [], 0, 0
        for i, (thing, where) in enumerate(zip(things[:facts], things[1:], strict=True)):
            word = colour if i == k else rng.choice(SIZES)
            sentence = f"the {word} {thing} is {rng.choice(PLACES)} the {where} ."
            if i == k:
                start = at + len("the ")
            sentences.append(sentence)
            at += len(sentence) + 1
        rows["id"].append(f"q{seed}-{q}")
        rows["question"].append(f"the {things[k]} is ?")
        rows["context"].append(" ".join(sentences))
        rows["answers"].append({"text": [colour], "answer_start": [start]})
    return rows


def make_squad(root: Path, train: int = 1200, test: int = 300, seed: int = 0) -> Path:
    """`root/train.parquet` and `root/test.parquet` of SQuAD-format questions (`squad_rows`)."""
    return _parquet_splits(root, squad_rows, train, test, seed)


def _pretrain(model, batches, epochs: int, lr: float, seed: int = 0) -> None:  # noqa: ANN001
    """A few epochs of AdamW on (inputs, labels) batches: the stand-in for real pretraining."""
    import torch

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for kwargs, labels in batches():
            loss = model(**kwargs, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()


def pretrain_vit(directory: Path, images: Path, classes: int = 5, epochs: int = 6) -> Path:
    """Pretrain the ViT in `directory` on digits 0 .. classes-1 of the image folder's training
    split (a source task), keeping its head of `classes` labels: fine-tuning on all ten digits
    then gets a new head, and the bottom blocks carry features, as with a real checkpoint."""
    import torch
    from PIL import Image
    from transformers import ViTForImageClassification
    from transformers import ViTImageProcessorPil as ViTImageProcessor

    processor = ViTImageProcessor.from_pretrained(directory)
    files = [(p, int(p.parent.name)) for p in sorted((images / "train").glob("*/*.png"))]
    files = [(p, y) for p, y in files if y < classes]
    pixels = processor(images=[Image.open(p).convert("RGB") for p, _ in files], return_tensors="pt")
    x, y = pixels["pixel_values"], torch.tensor([lab for _, lab in files])
    model = ViTForImageClassification.from_pretrained(
        directory, num_labels=classes, ignore_mismatched_sizes=True
    )
    gen = torch.Generator().manual_seed(0)

    def batches():  # noqa: ANN202
        order = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), 32):
            idx = order[i : i + 32]
            yield {"pixel_values": x[idx]}, y[idx]

    _pretrain(model, batches, epochs, lr=2e-3)
    model.save_pretrained(directory)
    return directory


def pretrain_bert(directory: Path, n: int = 2000, epochs: int = 4) -> Path:
    """Pretrain the BERT in `directory` on naming a sentence's colour (6 labels, a source task);
    the sentence-pair task then gets a new head of 2 labels."""
    import torch
    from transformers import BertForSequenceClassification, BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(directory)
    rows = pair_rows(n, seed=99)
    colours = [COLOURS.index(s.split()[3]) for s in rows["sentence1"]]
    enc = tok(rows["sentence1"], padding="max_length", max_length=16, return_tensors="pt")
    y = torch.tensor(colours)
    model = BertForSequenceClassification.from_pretrained(
        directory, num_labels=len(COLOURS), ignore_mismatched_sizes=True
    )
    gen = torch.Generator().manual_seed(0)

    def batches():  # noqa: ANN202
        order = torch.randperm(len(y), generator=gen)
        for i in range(0, len(y), 32):
            idx = order[i : i + 32]
            yield {k: v[idx] for k, v in enc.items()}, y[idx]

    _pretrain(model, batches, epochs, lr=1e-3)
    model.save_pretrained(directory)
    return directory


def make_all(out: Path) -> dict[str, Path]:
    images = make_digit_images(out / "digits-images")
    made = {
        "vit": pretrain_vit(make_vit(out / "vit-tiny"), images),
        "images": images,
        "bert": pretrain_bert(make_bert(out / "bert-tiny")),
        "pairs": make_pairs(out / "pairs"),
        "squad": make_squad(out / "squad"),
    }
    (out / "README.txt").write_text("made by examples/assets.py; safe to delete\n")
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).parent / "assets"))
    args = parser.parse_args(argv)
    made = make_all(Path(args.out))
    print(json.dumps({k: str(v) for k, v in made.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
