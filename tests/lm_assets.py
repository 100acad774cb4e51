"""Tiny decoder-only language models and corpora for the job tests, made here: a byte-level BPE
tokenizer trained on a few sentences (with a chat template that marks the assistant's turns), a
random Llama- or GPT-2-shaped checkpoint of its vocabulary saved beside it, and JSON-lines text
and chat files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
if EXAMPLES not in sys.path:  # examples/assets.py, shared with the CPU examples
    sys.path.insert(0, EXAMPLES)
from assets import make_code_tokenizer  # noqa: E402

WORDS = "the cat sat on a mat while dogs ran far away from home and birds sang".split()


def sentence(i: int) -> str:
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(WORDS, int(rng.integers(3, 12)))) + "."


def make_tokenizer(directory: Path, vocab_size: int = 300) -> int:
    """A byte-level BPE tokenizer with a chat template saved in `directory` (the examples' own
    maker, `examples/assets.make_code_tokenizer`, on a few sentences); its length."""
    from transformers import AutoTokenizer

    texts = [sentence(i) for i in range(300)] + ["user assistant"]
    make_code_tokenizer(directory, texts, vocab_size)
    return len(AutoTokenizer.from_pretrained(directory))


def make_lm(directory: Path, family: str = "llama", depth: int = 4, tied: bool = False) -> Path:
    """A random `family` causal-lm checkpoint (width 32) with its tokenizer, in `directory`."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(directory)
    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(
            n_embd=32, n_layer=depth, n_head=4, vocab_size=vocab, n_positions=128,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, tie_word_embeddings=tied,
            bos_token_id=0, eos_token_id=0, pad_token_id=1,
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
    else:
        config = LlamaConfig(
            hidden_size=32, num_hidden_layers=depth, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=vocab,
            max_position_embeddings=128, tie_word_embeddings=tied,
            bos_token_id=0, eos_token_id=0, pad_token_id=1,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return directory


def write_text(path: Path, first: int, rows: int) -> Path:
    """JSON lines of documents (a `text` column), a few sentences each."""
    with path.open("w") as f:
        for i in range(first, first + rows):
            text = " ".join(sentence(i * 7 + k) for k in range(1 + i % 3))
            f.write(json.dumps({"text": text}) + "\n")
    return path


def write_chat(path: Path, first: int, rows: int) -> Path:
    """JSON lines of conversations (a `messages` column): a user turn, an assistant turn."""
    with path.open("w") as f:
        for i in range(first, first + rows):
            messages = [
                {"role": "user", "content": sentence(i)},
                {"role": "assistant", "content": sentence(i + 1000)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path
