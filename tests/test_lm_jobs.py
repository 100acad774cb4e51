"""Language-model jobs through the CLI (issue 47): a decoder-only checkpoint made here
(tests/lm_assets.py) continued-pretrained on JSON-lines text, and fine-tuned on chat rows, as a
user runs them: 2 pipeline stages, frozen by the schedule and re-laid out, the frozen prefix
served from AutoCache; the held-out loss per token and its perplexity stored and printed; the
export loads as `AutoModelForCausalLM` and continues a prompt as the job's units do."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from pipetransformer.store import Store, sqlite_url
from tests.fixtures_run import REPO, cli, finish, run_job, running_after_checkpoint, start_cli
from tests.lm_assets import make_lm, write_chat, write_text

pytestmark = pytest.mark.slow

TRAIN = {
    "training": {"epochs": 3, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 2},
    "parallel": {"stages": 2, "microbatches": 2},
    "freeze": {"policy": "schedule", "alpha": 0.5, "keep_trainable": 1, "cache": "on"},
    "checkpoint": {"every_epochs": 1, "keep": 2},
}


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
    store, printed = run_job(tmp_path, "text", spec)
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
    store, printed = run_job(tmp_path, "chat", spec)
    job = store.get_job("chat")
    assert job.state == "completed", job.message
    losses = [m.loss for m in store.metrics("chat")]
    assert losses[-1] < losses[0], losses
    evaluations = store.evaluations("chat")
    assert len(evaluations) == 1  # the target was reached at the first evaluation
    assert job.step < 3 * len(losses) and f"ppl {math.exp(evaluations[0].loss):.2f}" in printed
    assert "columns messages" in " ".join(printed.split())
    store.close()


def test_a_tied_decoder_killed_mid_job_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Two nodes train a tied GPT-2 as 2 stages (the embedding's copy on rank 0, the head's on
    rank 1); rank 1 is killed after a checkpoint. The job resumes from the checkpoint, which
    holds the tied pair (weights and optimizer state) once, both ranks loading their copy from
    it, and finishes with every step recorded once; the export's tied pair is the one tensor."""
    model = make_lm(tmp_path / "gpt2", family="gpt2", depth=2, tied=True)
    train = write_text(tmp_path / "train.jsonl", 0, 120)
    test = write_text(tmp_path / "test.jsonl", 500, 12)
    spec = {
        "name": "kill",
        "model": {"pretrained": str(model), "task": "causal-lm", "seq_len": 32},
        "data": {"dataset": "table", "train": str(train), "test": str(test), "loader_workers": 0},
        "training": {"epochs": 3, "global_batch_size": 8, "lr": 3e-3, "warmup_steps": 2},
        "parallel": {"stages": 2, "microbatches": 2},
        "freeze": {"policy": "off"},
        "checkpoint": {"every_epochs": 1, "keep": 3},
        "runtime": {"nodes": 2, "min_nodes": 2, "lease_ttl_s": 3},
    }
    path = tmp_path / "kill.yaml"
    path.write_text(yaml.safe_dump(spec))
    workdir, log = tmp_path / "runs", tmp_path / "run.log"
    proc = start_cli("run", str(path), "--workdir", str(workdir), "--job-id", "kill", log=log)
    try:
        _, workers = running_after_checkpoint(workdir, "kill", log)
        os.kill(workers[1]["pid"], signal.SIGKILL)
    finally:
        finish(proc, log)
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    job = store.get_job("kill")
    assert job.state == "completed", job.message
    assert [m.step for m in store.metrics("kill")] == list(range(1, job.step + 1))
    assert len(store.generations("kill")) >= 2
    resumed = [
        e.data["start"]["step"]
        for e in store.events("kill", limit=1000)
        if e.kind == "generation_started"
    ]
    assert min(resumed) == 0 < max(resumed)  # the second generation resumed from a checkpoint

    checkpoint = store.latest_checkpoint("kill")
    stored = dcp.FileSystemReader(checkpoint.path).read_metadata().state_dict_metadata
    tied = [k for k in stored if "+" in k]
    assert sorted(tied) == [
        "model.embed+transformer.wte.weight",
        "optim.embed+transformer.wte.weight",
    ]
    assert not any("lm_head" in k for k in stored)

    out = tmp_path / "export"
    res = cli("export", "kill", "--workdir", str(workdir), "--to", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.lm_head.weight.data_ptr() == exported.transformer.wte.weight.data_ptr()
    store.close()


def test_the_chat_example_runs_on_what_the_assets_script_makes(tmp_path: Path) -> None:
    """`examples/llama-docstring-chat.yaml` as written, on examples/assets.py's corpus, chats and
    Llama (pretrained for a few steps only), for two of its epochs: it trains on the assistant's
    tokens, freezes a block at a decision point and re-lays itself out."""
    import assets  # examples/assets.py: tests.lm_assets put examples/ on the path

    made = assets.make_language_models(tmp_path / "assets", steps=5)
    chats = made["docstring-chat"]
    assert (chats / "train.jsonl").stat().st_size > 0 and (made["code"] / "test.jsonl").exists()
    spec = yaml.safe_load((REPO / "examples" / "llama-docstring-chat.yaml").read_text())
    spec["model"]["pretrained"] = str(made["llama-code"])
    spec["data"].update(train=str(chats / "train.jsonl"), test=str(chats / "test.jsonl"))
    spec["training"]["epochs"] = 2
    store, printed = run_job(tmp_path, "example", spec)
    job = store.get_job("example")
    assert job.state == "completed", job.message
    assert max(v.layout.freeze_boundary for v in store.layouts("example")) >= 1
    assert "packed sequences" in " ".join(printed.split())
    store.close()


def test_the_output_rule_probes_a_decoder(tmp_path: Path) -> None:
    """Policy 'output' on a language model: the probe (the first held-out batch of packed
    sequences, each block's output sketched at 16 of its positions) runs through both stages,
    every decision point records a known rate per block, and the rule freezes a prefix once its
    outputs slow down (a ratio close to 1: the test is the mechanism on a decoder)."""
    model = make_lm(tmp_path / "llama", family="llama", depth=4)
    train = write_text(tmp_path / "train.jsonl", 0, 120)
    test = write_text(tmp_path / "test.jsonl", 500, 20)
    spec = {
        "model": {"pretrained": str(model), "task": "causal-lm", "seq_len": 32},
        "data": {"dataset": "table", "train": str(train), "test": str(test), "loader_workers": 0},
        **TRAIN,
        "freeze": {"policy": "output", "output_ratio": 0.99, "every": 3, "keep_trainable": 1},
    }
    store, _ = run_job(tmp_path, "probe", spec)
    assert store.get_job("probe").state == "completed"
    signals = store.freeze_signals("probe")
    assert len(signals) >= 3 and {s.statistic for s in signals} == {"output_rate"}
    assert all(v is not None and v > 0 for v in signals[0].signal)
    assert max(s.boundary for s in signals) >= 1
    assert max(v.layout.freeze_boundary for v in store.layouts("probe")) >= 1
    store.close()
