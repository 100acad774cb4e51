"""Language-model jobs through the CLI (issue 47): a decoder-only checkpoint made here
(tests/lm_assets.py) continued-pretrained on JSON-lines text, and fine-tuned on chat rows, as a
user runs them: 2 pipeline stages, frozen by the schedule and re-laid out, the frozen prefix
served from AutoCache; the held-out loss per token and its perplexity stored and printed; the
export loads as `AutoModelForCausalLM` and continues a prompt as the job's units do."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from pipetransformer.store import Store, sqlite_url
from tests.fixtures_run import cli
from tests.lm_assets import make_lm, write_chat, write_text

pytestmark = pytest.mark.slow

TRAIN = {
    "training": {"epochs": 3, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 2},
    "parallel": {"stages": 2, "microbatches": 2},
    "freeze": {"policy": "schedule", "alpha": 0.5, "keep_trainable": 1, "cache": "on"},
    "checkpoint": {"every_epochs": 1, "keep": 2},
}


def _run(tmp_path: Path, name: str, spec: dict) -> tuple[Store, str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**spec, "name": name}))
    res = cli("run", str(path), "--workdir", str(tmp_path / name), "--job-id", name, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return Store.open(sqlite_url(tmp_path / name / "store.db"), migrate=False), res.stdout


def test_a_text_job_on_a_tied_decoder_freezes_caches_and_exports(tmp_path: Path) -> None:
    """GPT-2 (tied embeddings) on packed text: the loss falls, the perplexity is stored and
    printed, the pipeline re-lays out at the freeze; the tied pair froze with the embedding and
    is one tensor in the export, whose greedy continuation is the units'."""
    model = make_lm(tmp_path / "gpt2", family="gpt2", depth=4, tied=True)
    train = write_text(tmp_path / "train.jsonl", 0, 120)
    test = write_text(tmp_path / "test.jsonl", 500, 20)
    spec = {
        "model": {"pretrained": str(model), "task": "causal-lm", "seq_len": 32},
        "data": {"dataset": "table", "train": str(train), "test": str(test), "loader_workers": 1},
        **TRAIN,
    }
    store, printed = _run(tmp_path, "text", spec)
    job = store.get_job("text")
    assert job.state == "completed", job.message
    losses = [m.loss for m in store.metrics("text")]
    assert losses[-1] < losses[0] - 0.5, losses  # a random model learns the corpus' words
    evaluations = store.evaluations("text")
    assert len(evaluations) == 3
    last = evaluations[-1]
    assert 0 < last.accuracy < 1 and last.loss < evaluations[0].loss
    assert f"ppl {math.exp(last.loss):.2f}" in printed
    layouts = store.layouts("text")
    assert max(v.layout.freeze_boundary for v in layouts) >= 1 and len(layouts) >= 2
    assert "causal LM over" in " ".join(printed.split())

    status = cli("status", "text", "--json", "--workdir", str(tmp_path / "text"))
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert shown["accuracy"] == pytest.approx(last.accuracy)
    assert shown["held_out_loss"] == pytest.approx(last.loss)
    assert shown["perplexity"] == pytest.approx(math.exp(last.loss))
    text = cli("status", "text", "--workdir", str(tmp_path / "text")).stdout
    assert f"{math.exp(last.loss):.2f}" in text and "perplexity" in text

    out = tmp_path / "export"
    res = cli("export", "text", "--workdir", str(tmp_path / "text"), "--to", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # the tied pair, written once
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("the cat sat on", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        greedy = exported.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=1)
        ids = prompt
        for _ in range(5):  # greedy decoding by the full forward, token by token
            nxt = exported(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    assert torch.equal(greedy, ids)
    store.close()


def test_a_chat_job_learns_the_assistants_turns(tmp_path: Path) -> None:
    """A Llama-shaped model fine-tuned on conversations (the loss on the assistant's tokens
    only), across two stages, ended by `training.target_perplexity` at its first evaluation."""
    model = make_lm(tmp_path / "llama", family="llama", depth=4)
    train = write_chat(tmp_path / "train.jsonl", 0, 80)
    test = write_chat(tmp_path / "test.jsonl", 300, 16)
    spec = {
        "model": {"pretrained": str(model), "task": "causal-lm", "seq_len": 64},
        "data": {
            "dataset": "table",
            "train": str(train),
            "test": str(test),
            "columns": {"messages": "messages"},
            "loader_workers": 0,
        },
        **TRAIN,
    }
    spec["training"] = {**TRAIN["training"], "target_perplexity": 1e6}
    store, printed = _run(tmp_path, "chat", spec)
    job = store.get_job("chat")
    assert job.state == "completed", job.message
    losses = [m.loss for m in store.metrics("chat")]
    assert losses[-1] < losses[0], losses
    evaluations = store.evaluations("chat")
    assert len(evaluations) == 1  # the target was reached at the first evaluation
    assert job.step < 3 * len(losses) and f"ppl {math.exp(evaluations[0].loss):.2f}" in printed
    assert "columns messages" in " ".join(printed.split())
    store.close()
