"""The decoder workload of bench/paper.py (`--workload lm`): a Llama-shaped language model
pretrained on one text domain, fine-tuned on another, in two regimes.

    source      the standard library's packages' source (asyncio, email, xml, ...; no tests, no
                top-level modules, no documentation data): about 6 MB of Python every Python
                installation has offline
    tokenizer   byte-level BPE of 2,048 tokens trained on the source and the target's training
                text, as a hub model's tokenizer covers code and prose alike
    upstream    8 Llama blocks of width 128 (4 heads over 2 KV heads, SwiGLU, untied head: the
                LM head is about 1/8 of the compute, as in Llama-3-8B), pretrained from a random
                initialisation on the source by a plain `transformers` loop; kept as a
                `save_pretrained` directory with its tokenizer (`--body`,
                bench/results/issue50-decoder)
    targets     `continued`: continued pre-training on documentation prose, the Python
                Language Reference's topics that pydoc shows (`pydoc_data.topics`, every sixth
                topic held out): the same language's semantics, told in English;
                `chat`: supervised fine-tuning on chat rows asking what a top-level standard
                module's function does, answered with its docstring (loss on the assistant's
                tokens only; no top-level module is in the source)

Quality is held-out perplexity on the target (the evaluation's token loss, exponentiated)."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path
from typing import Any

from _common import ROOT, progress

sys.path.insert(0, str(ROOT / "examples"))
from assets import (  # noqa: E402
    _write_jsonl,
    make_code_tokenizer,
    make_decoder,
    make_docstring_chats,
    pretrain_decoder,
)

REGIMES = ("continued", "chat")
LAYERS, HIDDEN, VOCAB = 8, 128, 2048
# stdlib folders that are not code a model should learn from: tests, codec tables, pydoc's
# documentation (the target domain), build configuration, demo data
_NOT_SOURCE = {"test", "tests", "encodings", "pydoc_data", "site-packages", "__phello__"}


def source_modules() -> list[Path]:
    """The source domain's files: each module of the standard library's packages of 1-60 kB, by
    path (top-level modules are the chat target's, so they are left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        path
        for path in sorted(root.glob("*/**/*.py"))
        if not set(path.relative_to(root).parts) & _NOT_SOURCE
        and not path.relative_to(root).parts[0].startswith("config-")
        and 1_000 <= path.stat().st_size <= 60_000
    ]


def source_documents() -> list[str]:
    """The source domain's text: `source_modules()` that read as UTF-8."""
    texts = []
    for path in source_modules():
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def prose_documents() -> list[dict[str, str]]:
    """The continued pre-training target: pydoc's topics of the language reference, by name."""
    from pydoc_data.topics import topics

    return [{"topic": name, "text": topics[name].strip()} for name in sorted(topics)]


def make_targets(root: Path, test_every: int = 6) -> dict[str, Path]:
    """`root/continued/{train,test}.jsonl` (`text`: a topic each, every `test_every`-th held
    out) and `root/chat/{train,test}.jsonl` (`messages`); regime -> its folder."""
    docs = prose_documents()
    _write_jsonl(
        root / "continued" / "train.jsonl", [d for i, d in enumerate(docs) if i % test_every]
    )
    _write_jsonl(root / "continued" / "test.jsonl", docs[0::test_every])
    make_docstring_chats(root / "chat")
    return {"continued": root / "continued", "chat": root / "chat"}


def make_body(
    directory: Path, texts: list[str], hidden: int = HIDDEN, layers: int = LAYERS
) -> Path:
    """The tokenizer trained on `texts` and a random decoder of its vocabulary, in `directory`."""
    from transformers import AutoTokenizer

    make_code_tokenizer(directory, texts, vocab_size=VOCAB)
    return make_decoder(
        directory, len(AutoTokenizer.from_pretrained(directory)), hidden=hidden, layers=layers
    )


def upstream(directory: Path, targets: dict[str, Path], steps: int, batch: int = 16) -> Path:
    """The tokenizer (source and target training text), a random decoder, and `steps` AdamW
    steps of pretraining on the source: the kept body, as `save_pretrained` writes it."""
    source = source_documents()
    prose = [
        json.loads(line)["text"]
        for line in (targets["continued"] / "train.jsonl").open(encoding="utf-8")
    ]
    progress(f"upstream: {len(source)} source modules, tokenizer of {VOCAB} tokens")
    make_body(directory, source + prose)
    return pretrain_decoder(directory, source, steps, batch=batch)


def job(
    name: str,
    pretrained: Path,
    regime: str,
    data: Path,
    seed: int,
    epochs: int,
    batch: int,
) -> dict[str, Any]:
    """The fine-tuning job's spec for `regime` (2 stages x 1 replica, a freeze decision point
    every quarter epoch-ish; the caller adds the freeze section)."""
    spec: dict[str, Any] = {
        "name": name,
        "model": {"pretrained": str(pretrained), "task": "causal-lm", "seq_len": 128},
        "data": {
            "dataset": "table",
            "train": str(data / "train.jsonl"),
            "test": str(data / "test.jsonl"),
            "loader_workers": 1,
        },
        "training": {
            "epochs": epochs,
            "global_batch_size": batch,
            "lr": 0.001,
            "warmup_steps": 10,
            "seed": seed,
        },
        "parallel": {"stages": 2, "replicas": 1, "microbatches": 4},
        "checkpoint": {"every_epochs": epochs, "keep": 1},
    }
    if regime == "chat":
        spec["data"]["columns"] = {"messages": "messages"}
    return spec


def zero_shot_perplexity(body: Path, data: Path, seq_len: int = 128) -> float:
    """The body's held-out perplexity on a target before any fine-tuning (the decoder's
    counterpart of the encoder's linear probe): text rows as EOS-joined windows, chat rows
    scored on the assistant's tokens only."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(body)
    model = AutoModelForCausalLM.from_pretrained(body).eval()
    ids: list[int] = []
    labels: list[int] = []
    for line in (data / "test.jsonl").open(encoding="utf-8"):
        row = json.loads(line)
        if "messages" in row:
            enc = tok.apply_chat_template(
                row["messages"], return_dict=True, return_assistant_tokens_mask=True
            )
            ids += enc["input_ids"]
            labels += [
                i if m else -100
                for i, m in zip(enc["input_ids"], enc["assistant_masks"], strict=True)
            ]
        else:
            doc = [*tok(row["text"])["input_ids"], tok.eos_token_id]
            ids += doc
            labels += doc
    windows = [
        (ids[i : i + seq_len], labels[i : i + seq_len])
        for i in range(0, len(ids) - seq_len + 1, seq_len)  # whole windows: one batch shape
    ]
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(windows), 32):
            x = torch.tensor([w[0] for w in windows[b : b + 32]])
            y = torch.tensor([w[1] for w in windows[b : b + 32]])[:, 1:]
            logits = model(input_ids=x).logits[:, :-1]
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            ).item()  # -100 (not an assistant's token) is ignored
            count += int((y != -100).sum())
    return math.exp(total / count)
