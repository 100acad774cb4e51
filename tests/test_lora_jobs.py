"""A LoRA job through the CLI (`model.adapters`), as a user runs one: a Llama-shaped checkpoint
made here (tests/lm_assets.py) continued-pretrained with adapters across 2 stages in bf16 weights
(float32 masters of the adapters alone), frozen by the
schedule and re-laid out in memory (the frozen blocks' adapters merged, their outputs served from
AutoCache), a worker killed on the way and the job resumed from its last checkpoint; its checkpoints hold the adapters and their optimizer state, not the base; the export
is PEFT's format that `PeftModel.from_pretrained` loads, and `--merge` a plain model with the
same logits."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from pipetransformer.store import Store, sqlite_url
from tests.fixtures_run import cli, finish, probe, running_after_checkpoint, start_cli
from tests.lm_assets import make_lm, write_text

pytestmark = pytest.mark.slow


def test_a_lora_job_freezes_relays_out_checkpoints_adapters_and_exports(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = make_lm(tmp_path / "llama", family="llama", depth=4)
    train = write_text(tmp_path / "train.jsonl", 0, 120)
    test = write_text(tmp_path / "test.jsonl", 500, 20)
    spec = {
        "model": {
            "pretrained": str(model),
            "task": "causal-lm",
            "seq_len": 32,
            "adapters": {"rank": 4, "alpha": 8},
        },
        "data": {"dataset": "table", "train": str(train), "test": str(test), "loader_workers": 1},
        # bf16 weights: the base in bf16, float32 masters of the adapters alone
        "training": {
            "epochs": 3,
            "global_batch_size": 8,
            "lr": 1e-2,
            "warmup_steps": 2,
            "precision": "bf16-weights",
        },
        "parallel": {"stages": 2, "microbatches": 2},
        "freeze": {"policy": "schedule", "alpha": 0.5, "keep_trainable": 1, "cache": "on"},
        "checkpoint": {"every_epochs": 1, "keep": 2},
    }
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump({**spec, "name": "lora"}))
    workdir, log = tmp_path / "lora", tmp_path / "run.log"
    proc = start_cli("run", str(path), "--workdir", str(workdir), "--job-id", "lora", log=log)
    try:
        # a worker killed once a checkpoint is committed: its generation resumes from it,
        # the base read again from the pretrained checkpoint, the adapters from the checkpoint
        number, workers = running_after_checkpoint(workdir, "lora", log)
        committed = probe(workdir, "lora", lambda s, j: s.latest_checkpoint(j).step)()
        os.kill(workers[1]["pid"], signal.SIGKILL)
    finally:
        finish(proc, log)
    printed = log.read_text(errors="replace")
    store = Store.open(sqlite_url(workdir / "store.db"), migrate=False)
    job = store.get_job("lora")
    assert job.state == "completed", job.message
    metrics = store.metrics("lora")
    assert [m.step for m in metrics] == list(range(1, job.step + 1)), "each step once"
    (aborted, *_) = [g for g in store.generations("lora") if g.number == number]
    assert aborted.state == "aborted" and "killed by signal 9" in aborted.reason
    resumed = [
        e.data["start"]["step"]
        for e in reversed(store.events("lora", limit=1000))
        if e.kind == "generation_started"
    ]
    assert committed <= resumed[-1] < job.step, (committed, resumed)
    losses = [m.loss for m in metrics]
    assert losses[-1] < losses[0], losses  # the adapters alone learn something of the corpus
    layouts = store.layouts("lora")
    frozen = max(v.layout.freeze_boundary for v in layouts)
    assert frozen >= 1 and len(layouts) >= 2
    (ckpt, *_) = store.checkpoints("lora")
    store.close()

    # the checkpoint: the adapters and their two AdamW moments, no base weight
    stored = dcp.FileSystemReader(ckpt.path).read_metadata().state_dict_metadata
    held = sum(v.size.numel() for k, v in stored.items() if k.startswith("model."))
    base = AutoModelForCausalLM.from_pretrained(model)
    # rank 4 x (in + out) of q, k, v, o (32 wide, k and v 16 out), gate, up (64 out) and down
    sides = (32 + 32) + 2 * (32 + 16) + (32 + 32) + 3 * (32 + 64)
    adapters = 4 * 4 * sides  # 4 blocks
    assert held == adapters, (held, adapters)
    assert 5 * held < sum(p.numel() for p in base.parameters())
    # AdamW's two moments and step count for each adapter still training (frozen blocks'
    # adapters left the optimizer when they froze)
    moments = sum(v.size.numel() for k, v in stored.items() if k.startswith("optim."))
    training = 4 - frozen
    assert moments == training * (2 * adapters // 4 + 14), (moments, frozen)

    out = tmp_path / "adapter"
    res = cli("export", "lora", "--workdir", str(workdir), "--to", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    merged_dir = tmp_path / "merged"
    res = cli("export", "lora", "--workdir", str(workdir), "--to", str(merged_dir), "--merge")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    peft_model = PeftModel.from_pretrained(base, out).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        # float32, the same weights summed in another order (merged: W + BA at once)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        # and the adapters moved the model: not the base's logits
        assert not torch.allclose(
            AutoModelForCausalLM.from_pretrained(model)(input_ids=ids).logits, want, atol=1e-3
        )
    assert "LoRA r=4 alpha=8 on every projection, the base frozen" in " ".join(printed.split())
