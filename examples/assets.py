"""Small Hugging Face checkpoints and data sets made here (nothing is downloaded), for the CPU
examples and the tests: what `save_pretrained` writes for a ViT, a BERT and a Llama-shaped
language model, with the image processor and tokenizers they come with, an image folder, parquet
tables, a text corpus and chat rows.

    .venv/bin/python examples/assets.py [DIR]      # default: examples/assets (git-ignored)

writes DIR/vit-tiny, DIR/digits-images/{train,test}, DIR/bert-tiny, DIR/pairs/{train,test}.parquet
and DIR/squad/{train,test}.parquet; `examples/hf-vit-images.yaml`, `examples/hf-bert-pairs.yaml`
and `examples/hf-bert-squad.yaml` train on them. The SQuAD-format questions ask the colour of one
thing a few sentences describe. The images are scikit-learn's 8x8 digits drawn as 32x32 RGB PNGs;
the sentence pairs ask whether the second sentence names the first sentence's colour (a task a
small encoder learns in a few epochs). The checkpoints are pretrained here for a few seconds on a
source task (the ViT on digits 0-4, the BERT on naming a sentence's colour), standing in for a
real pretrained model: fine-tuning gets a new head, and its bottom blocks already carry features.

For the language-model examples (`examples/llama-code.yaml`, `examples/llama-docstring-chat.yaml`)
it writes DIR/code/{pretrain,train,test}.jsonl (the Python standard library's own modules, one
document each: text every machine has offline), DIR/docstring-chat/{train,test}.jsonl
(conversations asking what a standard-library function does, answered with its docstring) and
DIR/llama-code: a byte-level BPE tokenizer trained on the pretraining modules, with a ChatML chat
template, and a 4-block Llama-shaped model pretrained on them for 600 steps (all of it about a minute on 2 idle cores)."""

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


# -- language models: the Python standard library as the corpus ---------------------------------

CHAT_TEMPLATE = (  # ChatML, as Qwen's; {% generation %} marks the assistant's tokens (the loss's)
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{%- if m['role'] == 'assistant' -%}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else -%}{{ m['content'] + '<|im_end|>' }}{%- endif -%}{{ '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
LM_SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def stdlib_modules() -> list[Path]:
    """The standard library's top-level modules of 2-40 kB, by name: source text every Python
    installation has offline (about 120 files, 2 MB on Python 3.11)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if 2_000 <= p.stat().st_size <= 40_000)


def _source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def make_code_corpus(root: Path) -> dict[str, Path]:
    """The modules as JSON-lines documents (`text`: one module's source each), in three parts:
    every other module is the pretraining corpus (`pretrain.jsonl`), the rest the continued
    pretraining's `train.jsonl`, every eighth of those held out as `test.jsonl`."""
    docs = [(p.stem, text) for p in stdlib_modules() if (text := _source(p))]
    pretrain = [{"module": m, "text": t} for m, t in docs[0::2]]
    rest = [{"module": m, "text": t} for m, t in docs[1::2]]
    return {
        "pretrain": _write_jsonl(root / "pretrain.jsonl", pretrain),
        "train": _write_jsonl(root / "train.jsonl", [r for i, r in enumerate(rest) if i % 8]),
        "test": _write_jsonl(root / "test.jsonl", rest[0::8]),
    }


def docstring_pairs() -> list[tuple[str, str]]:
    """(qualified name, its docstring's first paragraph on one line) for the public functions
    and methods of `stdlib_modules()` that have one of 20-200 characters."""
    import ast

    pairs = []
    for path in stdlib_modules():
        text = _source(path)
        if text is None:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        nodes = [(f"{path.stem}.", n) for n in tree.body]
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                nodes += [(f"{path.stem}.{node.name}.", n) for n in node.body]
        for prefix, node in nodes:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            first = " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""
            if 20 <= len(first) <= 200:
                pairs.append((prefix + node.name, first))
    return pairs


def make_docstring_chats(root: Path, test_every: int = 10) -> dict[str, Path]:
    """Conversations (`messages`) asking what a standard-library function does, answered with
    the first paragraph of its docstring: `root/train.jsonl`, every `test_every`-th held out in
    `root/test.jsonl`."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What does `{name}` do?"},
                {"role": "assistant", "content": answer},
            ]
        }
        for name, answer in docstring_pairs()
    ]
    return {
        "train": _write_jsonl(
            root / "train.jsonl", [r for i, r in enumerate(rows) if i % test_every]
        ),
        "test": _write_jsonl(root / "test.jsonl", rows[0::test_every]),
    }


def make_code_tokenizer(directory: Path, texts: list[str], vocab_size: int = 2048) -> Path:
    """A byte-level BPE tokenizer trained on `texts`, with a ChatML chat template whose
    assistant turns are marked for the loss, saved as `AutoTokenizer` loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=LM_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(directory))
    return directory


def make_decoder(
    directory: Path, vocab_size: int, *, hidden: int = 128, layers: int = 4, seed: int = 0
) -> Path:
    """A random Llama-shaped causal LM (RoPE, RMSNorm, SwiGLU; grouped-query attention, 4 heads
    over 2 KV heads), saved beside its tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=hidden * 8 // 3 // 8 * 8,  # SwiGLU's usual 8/3
        vocab_size=vocab_size,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def pretrain_decoder(
    directory: Path, texts: list[str], steps: int, seq_len: int = 128, batch: int = 8
) -> Path:
    """Pretrain the causal LM in `directory` for `steps` AdamW steps on `texts` (tokenised by
    its tokenizer, EOS between documents, cut into rows of `seq_len`): the stand-in for a real
    pretrained checkpoint, so continued pretraining and fine-tuning start from weights that
    already know the corpus' tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    stream = [i for text in texts for i in (*tok(text)["input_ids"], tok.eos_token_id)]
    rows = torch.tensor(stream[: len(stream) // seq_len * seq_len]).view(-1, seq_len)
    model = AutoModelForCausalLM.from_pretrained(directory)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        ids = rows[torch.randint(0, len(rows), (batch,), generator=gen)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"  {directory.name}: step {step + 1}/{steps} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(directory)
    return directory


def make_language_models(out: Path, steps: int = 600) -> dict[str, Path]:
    """The code corpus, the docstring chats, and `llama-code`: a Llama-shaped decoder with a
    tokenizer trained on the corpus, pretrained on its pretraining part."""
    corpus = make_code_corpus(out / "code")
    chats = make_docstring_chats(out / "docstring-chat")
    texts = [json.loads(line)["text"] for line in corpus["pretrain"].open(encoding="utf-8")]
    directory = make_code_tokenizer(out / "llama-code", texts)
    from transformers import AutoTokenizer

    make_decoder(directory, len(AutoTokenizer.from_pretrained(directory)))
    return {
        "code": corpus["train"].parent,
        "docstring-chat": chats["train"].parent,
        "llama-code": pretrain_decoder(directory, texts, steps),
    }


def make_all(out: Path) -> dict[str, Path]:
    images = make_digit_images(out / "digits-images")
    made = {
        "vit": pretrain_vit(make_vit(out / "vit-tiny"), images),
        "images": images,
        "bert": pretrain_bert(make_bert(out / "bert-tiny")),
        "pairs": make_pairs(out / "pairs"),
        "squad": make_squad(out / "squad"),
        **make_language_models(out),
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
