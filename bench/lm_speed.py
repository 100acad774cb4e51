"""A decoder-only language model's training speed and memory as a job (issue 47), against a plain
`transformers` loop: a Llama-shaped checkpoint made here (random weights, a byte-level BPE
tokenizer trained here) continued-pretrained on the Python standard library's own source files
(JSON lines, a `text` column; nothing is downloaded).

1. tokens/s of `pipetransformer run` at 1x1 (1 stage, 1 replica) against a single-process loop
   over `LlamaForCausalLM` on the same packed sequences, in the same global batches, with the
   same optimizer (the job's AdamW: matrices decay, the rest not; the job's lr, warm-up,
   weight decay and gradient clipping) and the same loss (the sum of the batch's token
   cross-entropies over its counted tokens). Goal: the job within 10 % of the loop.
2. tokens/s at 2x1 (2 stages, `--microbatches` micro-batches, gpipe) and 1x2 (2 replicas) with
   freezing off, each as a ratio to 1x1. On a 2-core machine two workers take both cores.
3. Memory per rank at 2x1 against 1x1 (goal: at most 0.6; a stage holds half the weights and
   optimizer state). A job on the CPU reports no memory of its own, so each worker process is
   sampled from /proc (`--sample-s`): `model` memory is the growth of its anonymous resident
   memory (RssAnon: the heap and anonymous maps torch's CPU allocator uses, not shared
   libraries) from the moment its data was read and its model not yet built (the last sample
   before rank 0's `data_opened` event) to its peak while training (up to the last step's
   metrics row, so the final checkpoint is left out): weights, gradients, AdamW state,
   activations, allocator slack; not the ~300 MiB of torch and transformers every process
   holds. The goal is read on that figure, for the largest rank; the raw peak resident set
   (VmRSS) and the model state the layout implies (16 bytes per float32 parameter, from the
   checkpoint's parameter counts) are reported beside it, and the loop's process is measured
   the same way.
4. The time from the `pipetransformer run` process's start to the end of the first training step
   (rank 0's `first_step` report, on its clock), with the job's milestones on the way (job
   created, generation started, data opened, workers started: the store's events), at each
   layout.

Per-step speed leaves out the first `--warmup` steps of each run and is the median over the next
`--steps` steps of the interval between consecutive steps' metrics rows (the job's own clock
when each step ended: everything between two steps, reports and control reads included); the
loop's is the median of its per-step wall times, timed the same way. The job's own per-step
`samples_per_s` (the step's own span) is reported beside it. Runs are repeated `--repeats` times,
the order rotated each time; medians over repeats. Threads: one per process everywhere (the
loop's process and each worker), the job's default.

Other work shares these cores, so wall times move with it. Beside them, CPU seconds per step:
the loop's process, and every process of the job (each worker and its threads, the loader,
controller, etcd, agent, fork server) from /proc sampled over the measured steps, with the
machine's busy core-seconds and what neither used of them (`outside`): whether a slower step
did more work or waited for a core. The job's stage clock (`runtime.stage_timing`, on by
default) gives each rank's phases per step beside the loop's forward / backward / clip /
optimizer.

    .venv/bin/python bench/lm_speed.py                # ~7 minutes on 2 cores
    .venv/bin/python bench/lm_speed.py --repeats 3 --steps 30 --layouts 1x1,2x1
    .venv/bin/python bench/lm_speed.py --quick        # a tiny model, a few steps: the mechanics

One JSON line (also bench/out/lm_speed.json, and bench/out/lm_speed.png: tokens/s per
configuration and memory per rank; neither with --no-files).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from _common import (
    MIB,
    ROOT,
    _kb_fields,
    emit,
    environment,
    median,
    out_dir,
    pin_threads,
    progress,
    rotated,
)
from trainer_memory import role_of

LAYOUTS = {"1x1": (1, 1), "2x1": (2, 1), "1x2": (1, 2)}
LOOP = "loop"
BYTES_PER_PARAM = 16  # float32 weight + gradient + AdamW's exp_avg and exp_avg_sq

DEFAULT = {  # 30.9M parameters: 472 MiB of float32 weights, gradients and AdamW moments
    "hidden": 512,
    "layers": 8,
    "heads": 8,
    "kv_heads": 2,
    "intermediate": 1408,
    "vocab": 8192,
    "seq_len": 128,
    "batch": 4,
    "microbatches": 4,
    "steps": 20,
    "warmup": 3,
    "repeats": 2,
    "corpus_kib": 1536,
}
QUICK = {
    "hidden": 64,
    "layers": 4,
    "heads": 2,
    "kv_heads": 1,
    "intermediate": 128,
    "vocab": 512,
    "seq_len": 32,
    "batch": 8,
    "microbatches": 2,
    "steps": 4,
    "warmup": 2,
    "repeats": 1,
    "corpus_kib": 192,
}
TRAINING = {"lr": 1e-3, "weight_decay": 0.05, "warmup_steps": 5, "grad_clip": 1.0}


# -- the model and the corpus ---------------------------------------------------------------


def stdlib_documents(kib: int) -> list[str]:
    """The standard library's top-level .py files, in name order, until `kib` KiB of text."""
    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            out.append(text)
            total += len(text.encode())
        if total >= kib * 1024:
            break
    return out


def write_corpus(root: Path, kib: int) -> tuple[Path, Path, list[str]]:
    """train.jsonl (all but every 16th document) and test.jsonl (a few short documents)."""
    docs = stdlib_documents(kib)
    test = [d for i, d in enumerate(docs) if i % 16 == 7][:4] or docs[-1:]
    train = [d for d in docs if d not in test]
    test = [d[:4000] for d in test]  # the held-out split is read only at the end of an epoch
    paths = []
    for name, rows in (("train", train), ("test", test)):
        path = root / f"{name}.jsonl"
        with path.open("w") as f:
            for text in rows:
                f.write(json.dumps({"text": text}) + "\n")
        paths.append(path)
    return paths[0], paths[1], train


def make_model(directory: Path, texts: list[str], cfg: dict[str, int]) -> int:
    """A byte-level BPE tokenizer trained on `texts` and a random Llama of its vocabulary,
    saved with save_pretrained in `directory`; the parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "examples"))
    import assets  # examples/assets.py: the examples' tokenizer maker, shared

    assets.make_code_tokenizer(directory, texts, cfg["vocab"])
    tok = AutoTokenizer.from_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        intermediate_size=cfg["intermediate"],
        vocab_size=len(tok),
        max_position_embeddings=cfg["seq_len"],
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def job_spec(
    name: str, layout: str, model: Path, train: Path, test: Path, args: argparse.Namespace
) -> dict[str, Any]:
    stages, replicas = LAYOUTS[layout]
    return {
        "name": name,
        "model": {"pretrained": str(model), "task": "causal-lm", "seq_len": args.seq_len},
        "data": {
            "dataset": "table",
            "train": str(train),
            "test": str(test),
            "loader_workers": args.loader_workers,
            # one causal text per packed sequence, as the loop's plain causal forward computes
            # (the documents are longer than a sequence: few rows would hold two)
            "cross_document_attention": True,
        },
        "training": {
            "epochs": 1,
            "global_batch_size": args.batch,
            "max_steps": args.warmup + args.steps,
            **TRAINING,
        },
        "parallel": {
            "stages": stages,
            "replicas": replicas,
            "microbatches": args.microbatches if stages > 1 else 1,
        },
        "freeze": {"policy": "off"},
        "runtime": {"device": "cpu", "threads_per_worker": 1},
        "checkpoint": {"every_epochs": 1000, "keep": 1},
    }


# -- the plain loop, in a process of its own ---------------------------------------------------


def packed_split(spec: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """The job's own packed training split: inputs [N, 2, T] (ids, document starts), labels
    [N, T], counted tokens [N], and the resolved spec (the token cache built or found)."""
    import numpy as np

    from pipetransformer.core.spec import parse_spec
    from pipetransformer.orchestrator.sources import resolve_submission
    from pipetransformer.trainer.data import load_dataset

    job = resolve_submission(parse_spec(spec))
    train = load_dataset(job.data, job.model).train
    everything = np.arange(len(train))
    return train.read(everything), train.labels[everything], train.tokens.copy(), job


class SelfSampler(threading.Thread):
    """This process's peak RssAnon and VmRSS (bytes), every `every_s`."""

    def __init__(self, every_s: float) -> None:
        super().__init__(daemon=True)
        self.every_s, self.peak_anon, self.peak_rss = every_s, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            status = _kb_fields("/proc/self/status")
            self.peak_anon = max(self.peak_anon, status.get("RssAnon", 0))
            self.peak_rss = max(self.peak_rss, status.get("VmRSS", 0))
            self.done.wait(self.every_s)


def loop_child(path: Path) -> None:
    """The plain loop (`--loop-child SETTINGS.json`): `LlamaForCausalLM` trained over the job's
    global batches, the job's optimizer and loss, one thread; one JSON line: per-step seconds,
    losses, and memory as a worker's is measured (anonymous growth from the data read, before
    the model is built, to the peak while training)."""
    pin_threads(1)
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from pipetransformer.core.sampler import IGNORE, ElasticSampler
    from pipetransformer.trainer.optim import build_optimizer, lr_at, set_lr

    settings = json.loads(path.read_text())
    x, y, tokens, job = packed_split(settings["spec"])
    warmup, steps = settings["warmup"], settings["steps"]
    base = _kb_fields("/proc/self/status")
    sampler = SelfSampler(settings["sample_s"])
    sampler.start()
    tspec = job.training
    model = LlamaForCausalLM.from_pretrained(settings["model"], attn_implementation="sdpa")
    model.train()
    params = list(model.parameters())
    opt = build_optimizer(model, tspec)
    batches = ElasticSampler(len(tokens), tspec.global_batch_size, tspec.seed, weights=tokens)
    total = warmup + steps
    cursor, seconds, cpu, losses = 0, [], [], []
    phases: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "clip", "optimizer")}
    for step in range(total):
        if step == warmup:
            busy0, wall0, cpu0 = machine_busy(), time.perf_counter(), time.process_time()
        t0, c0 = time.perf_counter(), time.process_time()
        b = batches.batch(0, cursor, 1, 0)
        real = b.indices[b.valid]
        set_lr(opt, lr_at(step, total, tspec))
        logits = model(input_ids=x[real][:, 0], use_cache=False).logits
        loss = F.cross_entropy(
            logits.flatten(0, 1), y[real].flatten(), ignore_index=IGNORE, reduction="sum"
        ) / int(tokens[real].sum())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, tspec.grad_clip)
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        cursor = b.next_cursor
        t4 = time.perf_counter()
        seconds.append(t4 - t0)
        cpu.append(time.process_time() - c0)
        for key, span in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            phases[key].append(span)
    wall, own = time.perf_counter() - wall0, time.process_time() - cpu0
    busy = machine_busy() - busy0
    sampler.done.set()
    sampler.join()
    print(
        json.dumps(
            {
                "step_s": median(seconds[warmup:]),
                "step_s_all": [round(s, 4) for s in seconds],
                "cpu_s_per_step": {
                    "process": median(cpu[warmup:]),  # this process's CPU, median step
                    "wall": wall / steps,  # over the measured steps: wall, machine's, others'
                    "machine": busy / steps,
                    "outside": (busy - own) / steps,
                },
                "phases_s_per_step": {k: round(median(v[warmup:]), 4) for k, v in phases.items()},
                "loss_first_last": [losses[0], losses[-1]],
                "memory": {
                    "0": {
                        "data_opened_anon": round(base["RssAnon"] / MIB, 1),
                        "peak_rss": round(sampler.peak_rss / MIB, 1),
                        "peak_anon": round(sampler.peak_anon / MIB, 1),
                        "model": round((sampler.peak_anon - base["RssAnon"]) / MIB, 1),
                    }
                },
                "threads": torch.get_num_threads(),
            }
        ),
        flush=True,
    )


def run_loop(
    root: Path, model_dir: Path, spec: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    settings = root / "loop.json"
    settings.write_text(
        json.dumps(
            {
                "spec": spec,
                "model": str(model_dir),
                "warmup": args.warmup,
                "steps": args.steps,
                "sample_s": args.sample_s,
            }
        )
    )
    started = time.time()
    res = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--loop-child", str(settings)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        return {"job": LOOP, "error": (res.stdout + res.stderr)[-3000:]}
    row = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])
    return {"wall_s": round(time.time() - started, 1), **row}


# -- a job, its workers sampled ---------------------------------------------------------------


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_path(path: str) -> tuple[int, float] | None:
    """A live process's (or thread's) parent pid and CPU seconds so far (user + system), from
    its /proc stat file, or None."""
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


def _stat(pid: int) -> tuple[int, float] | None:
    return _stat_path(f"/proc/{pid}/stat")


def machine_busy() -> float:
    """Core-seconds the whole machine has been busy (all but idle and iowait in /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLK_TCK


class JobSampler(threading.Thread):
    """Every `every_s`: the CPU seconds of every process of the job under `root` and of this
    one (role `bench`), by pid ({pid: [(unix time, cpu s)]}, each pid's role in `roles`:
    trainer_memory's roles, a worker's own children called `loader`); each worker's threads'
    ({pid: {tid: [(unix time, cpu s)]}}, names in `names`) and resident memory ({pid: [(unix
    time, VmRSS, RssAnon, VmHWM)]}, bytes); the machine's busy core-seconds (`machine`). The
    process tree is read again every `rescan_s`."""

    def __init__(self, root: int, every_s: float, rescan_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.every_s, self.rescan_s = root, every_s, rescan_s
        self.roles: dict[int, str] = {os.getpid(): "bench"}
        self.cpu: dict[int, list[tuple[float, float]]] = {}
        self.threads: dict[int, dict[int, list[tuple[float, float]]]] = {}
        self.names: dict[int, str] = {}
        self.memory: dict[int, list[tuple[float, int, int, int]]] = {}
        self.machine: list[tuple[float, float]] = []
        self.done = threading.Event()

    def _scan(self) -> None:
        procs: dict[int, tuple[list[str], int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or (stat := _stat(int(entry))) is None:
                continue
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            procs[int(entry)] = ([c.decode(errors="replace") for c in cmd if c], stat[0])
        children: dict[int, list[int]] = {}
        for pid, (_, ppid) in procs.items():
            children.setdefault(ppid, []).append(pid)
        stack: list[tuple[int, str | None]] = [(self.root, None)]
        while stack:
            pid, parent_role = stack.pop()
            if pid not in procs:
                continue
            role = role_of(procs[pid][0], parent_role)
            if pid not in self.roles:  # a pid keeps the role it was first seen in
                self.roles[pid] = "loader" if role == parent_role == "worker" else role
            stack.extend((c, role) for c in children.get(pid, []))

    def _sample_threads(self, pid: int, now: float) -> None:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return
        for tid in tids:
            path = f"/proc/{pid}/task/{tid}"
            if (stat := _stat_path(f"{path}/stat")) is None:
                continue
            if tid not in self.names:
                try:
                    self.names[tid] = Path(f"{path}/comm").read_text().strip()
                except OSError:
                    self.names[tid] = "?"
            self.threads.setdefault(pid, {}).setdefault(tid, []).append((now, stat[1]))

    def run(self) -> None:
        scanned = 0.0
        while not self.done.is_set():
            now = time.time()
            if now - scanned >= self.rescan_s:
                self._scan()
                scanned = now
            self.machine.append((now, machine_busy()))
            for pid, role in list(self.roles.items()):
                if (stat := _stat(pid)) is not None:
                    self.cpu.setdefault(pid, []).append((now, stat[1]))
                if role == "worker" and (status := _kb_fields(f"/proc/{pid}/status")):
                    self.memory.setdefault(pid, []).append(
                        (now, status.get("VmRSS", 0), status.get("RssAnon", 0), status["VmHWM"])
                    )
                    self._sample_threads(pid, now)
            self.done.wait(self.every_s)


def cpu_between(samples: list[tuple[float, float]], t0: float, t1: float) -> float:
    """CPU seconds a process used between unix times t0 and t1, interpolated between samples
    (0 before its first sample, its last reading after its last)."""
    import numpy as np

    times, cpu = np.array([t for t, _ in samples]), np.array([c for _, c in samples])
    at = np.interp([t0, t1], times, cpu, left=0.0, right=cpu[-1])
    return float(at[1] - at[0])


JOB_ROLES = ("loader", "controller", "etcd", "agent", "forkserver", "worker_stub")


def cpu_per_step(
    sampler: JobSampler, workers: list, t0: float, t1: float, steps: int
) -> dict[str, Any]:
    """CPU seconds per measured step between the metrics rows at t0 and t1: each worker (`rank
    N`; its main thread and the CPU of its other threads by name under `rank N threads`), the
    job's other processes by role (loader, controller, etcd, agent, fork server), `all` the
    job's processes together, `bench` this process (the sampling), `machine` the machine's busy
    core-seconds and `outside` what neither the job nor this process used of them (other work
    on the machine); `wall` the interval's seconds per step."""
    rank_of = {w.pid: w.rank for w in workers if w.pid is not None}
    out: dict[str, Any] = {"wall": (t1 - t0) / steps}
    for pid, rows in sampler.cpu.items():
        role = sampler.roles[pid]
        key = f"rank {rank_of[pid]}" if role == "worker" and pid in rank_of else role
        out[key] = out.get(key, 0.0) + cpu_between(rows, t0, t1) / steps
        if pid in sampler.threads and pid in rank_of:
            threads: dict[str, float] = {}
            for tid, trows in sampler.threads[pid].items():
                name = "main" if tid == pid else sampler.names.get(tid, "?")
                threads[name] = threads.get(name, 0.0) + cpu_between(trows, t0, t1) / steps
            out[f"{key} threads"] = {
                k: round(v, 4) for k, v in sorted(threads.items(), key=lambda kv: -kv[1])
                if v >= 0.0005
            }  # fmt: skip
    job = [v for k, v in out.items() if k.startswith("rank ") and "threads" not in k]
    out["all"] = sum(job) + sum(out.get(r, 0.0) for r in JOB_ROLES)
    if sampler.machine:
        out["machine"] = cpu_between(sampler.machine, t0, t1) / steps
        out["outside"] = out["machine"] - out["all"] - out.get("bench", 0.0)
    return {k: v if isinstance(v, dict) else round(v, 4) for k, v in sorted(out.items())}


@dataclass
class SampledRun:
    """A `pipetransformer run` that ran to its end with its processes sampled."""

    started: float  # unix time
    wall_s: float
    returncode: int
    output: str  # stdout and stderr
    sampler: JobSampler
    own_cpu_s: float  # this process's CPU over the run: what the sampling cost


def run_sampled(
    workdir: Path, spec: dict[str, Any], sample_s: float, env: dict[str, str] | None = None
) -> SampledRun:
    """`pipetransformer run` of `spec` (its name the job id) in `workdir/<name>`, every process
    of it sampled every `sample_s` (`JobSampler`); `env` added to this one's environment."""
    name = spec["name"]
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipetransformer.orchestrator.cli", "run", str(path)]
        + ["--workdir", str(workdir / name), "--job-id", name],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sampler = JobSampler(proc.pid, sample_s)
    own_cpu = time.process_time()
    sampler.start()
    out, _ = proc.communicate()
    wall = time.time() - started
    sampler.done.set()
    sampler.join()
    own = time.process_time() - own_cpu
    return SampledRun(started, wall, proc.returncode, out, sampler, own)


def run_job(workdir: Path, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`pipetransformer run` of `spec`, its workers' memory sampled; what its store says."""
    from pipetransformer.store import Store, sqlite_url

    name = spec["name"]
    run = run_sampled(workdir, spec, args.sample_s)
    started, wall, sampler, own_cpu = run.started, run.wall_s, run.sampler, run.own_cpu_s
    if run.returncode != 0:
        return {"job": name, "error": run.output[-3000:]}
    store = Store.open(sqlite_url(workdir / name / "store.db"), migrate=False)
    try:
        metrics = store.metrics(name)
        events = store.events(name)
        workers = store.workers(name)
        stage_rows = store.stage_times(name)
    finally:
        store.close()
    batch = spec["training"]["global_batch_size"]
    by_step = {m.step: m for m in metrics}
    gaps = [
        by_step[s].time - by_step[s - 1].time
        for s in range(args.warmup + 1, args.warmup + args.steps + 1)
        if s in by_step and s - 1 in by_step
    ]
    own = [
        batch / by_step[s].samples_per_s
        for s in range(args.warmup + 1, args.warmup + args.steps + 1)
        if s in by_step and by_step[s].samples_per_s
    ]

    def first(kind: str) -> float | None:
        times = [e.time for e in events if e.kind == kind]
        return min(times) if times else None

    # the end of the first step, on the worker's clock (rank 0's report of it)
    resumed = [e.data["time"] for e in events if e.kind == "generation_resumed" and e.data]
    milestones = {
        "job_created": first("job_created"),
        "generation_started": first("generation_started"),
        "data_opened": first("data_opened"),  # rank 0 read its data; the model is built next
        "workers_started": max((w.started_at or 0.0 for w in workers), default=None),
        "first_step_done": min(resumed) if resumed else None,
    }
    end = metrics[-1].time if metrics else None
    lo, hi = args.warmup, args.warmup + args.steps
    cpu = (
        cpu_per_step(sampler, workers, by_step[lo].time, by_step[hi].time, hi - lo)
        if lo in by_step and hi in by_step
        else None
    )
    return {
        "job": name,
        "wall_s": round(wall, 1),
        "step_s": median(gaps) if gaps else None,
        "own_step_s": median(own) if own else None,
        "steps_measured": len(gaps),
        "loss_first_last": [metrics[0].loss, metrics[-1].loss] if metrics else None,
        "first_metrics_row_s": round(metrics[0].time - started, 2) if metrics else None,
        "first_metrics_step": metrics[0].step if metrics else None,
        "milestones_s": {k: round(t - started, 2) if t else None for k, t in milestones.items()},
        "memory": worker_memory(sampler.memory, workers, milestones["data_opened"], end),
        "cpu_s_per_step": cpu,
        "sampler_cpu_s": round(own_cpu, 2),
        "stage_times": stage_times(stage_rows, args.warmup, args.warmup + args.steps),
    }


def worker_memory(
    samples: dict, workers: list, before: float | None, until: float | None
) -> dict[str, Any]:
    """Per rank (the store's worker rows name each rank's pid), in MiB: the resident memory when
    the worker was first seen, and its anonymous part then and at `before` (the last sample at or
    before rank 0's data_opened event: the data read, the model not yet built); the peaks up to
    `until` (the last step's metrics row), whole (VmRSS) and anonymous (RssAnon); `model` the
    anonymous peak's growth over `before`."""
    rank_of = {w.pid: w.rank for w in workers if w.pid is not None}
    out: dict[str, Any] = {}
    for pid, rows in samples.items():
        if pid not in rank_of:
            continue
        during = [r for r in rows if until is None or r[0] <= until] or rows
        ahead = [r for r in rows if before is not None and r[0] <= before] or rows[:1]
        base_anon = ahead[-1][2]
        peak_rss = max(r[1] for r in during)
        peak_anon = max(r[2] for r in during)
        out[str(rank_of[pid])] = {
            "first_rss": round(rows[0][1] / MIB, 1),
            "first_anon": round(rows[0][2] / MIB, 1),
            "data_opened_anon": round(base_anon / MIB, 1),
            "peak_rss": round(peak_rss / MIB, 1),
            "peak_anon": round(peak_anon / MIB, 1),
            "model": round((peak_anon - base_anon) / MIB, 1),
            "hwm": round(rows[-1][3] / MIB, 1),
            "samples": len(rows),
        }
    return dict(sorted(out.items()))


def stage_times(rows: list, warmup: int, total: int) -> dict[str, Any]:
    """Per rank, seconds per phase summed over the reporting intervals that begin after the
    warm-up and end before the last step (whose interval holds the final checkpoint; all
    intervals where none does), with each phase's share of the wall time."""
    from pipetransformer.core.stage_times import PHASES

    late = [r for r in rows if r.from_step >= warmup and r.to_step < total] or rows
    out: dict[str, Any] = {}
    for r in late:
        agg = out.setdefault(str(r.rank), {"steps": 0, "wall_s": 0.0, **dict.fromkeys(PHASES, 0.0)})
        agg["steps"] += r.to_step - r.from_step
        agg["wall_s"] += r.wall_s
        for p in PHASES:
            agg[p] += getattr(r.seconds, p)
    for agg in out.values():
        agg["share"] = {p: round(agg[p] / agg["wall_s"], 4) for p in PHASES if agg["wall_s"]}
        for p in ("wall_s", *PHASES):
            agg[p] = round(agg[p], 4)
    return dict(sorted(out.items()))


# -- the model state a layout implies ---------------------------------------------------------


def state_per_rank(model_dir: Path, layout_ranges: list[list[tuple[int, int]]]) -> list[float]:
    """Weights + gradients + AdamW moments (MiB) each pipeline rank holds, from the checkpoint's
    parameter counts and the blocks [start, end) each stage runs (the first stage the embedding,
    the last the final norm and output projection)."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            counts[key] = math.prod(f.get_slice(key).get_shape())
    out = []
    for s, ranges in enumerate(layout_ranges):
        n = 0
        for key, c in counts.items():
            if key.startswith("model.layers."):
                block = int(key.split(".")[2])
                n += c * any(a <= block < b for a, b in ranges)
            elif key.startswith("model.embed_tokens."):
                n += c * (s == 0)
            else:  # model.norm, lm_head
                n += c * (s == len(layout_ranges) - 1)
        out.append(n * BYTES_PER_PARAM / MIB)
    return out


# -- the whole benchmark ----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, a few steps, once")
    for key, value in DEFAULT.items():
        name, quick = f"--{key.replace('_', '-')}", QUICK[key]
        ap.add_argument(name, type=int, default=None, help=f"{value}; --quick: {quick}")
    ap.add_argument(
        "--layouts", default=None, help="job layouts, 1x1 among them (1x1,2x1,1x2; quick: 1x1,2x1)"
    )
    ap.add_argument("--loader-workers", type=int, default=1)
    ap.add_argument("--sample-s", type=float, default=0.1, help="memory sampling interval")
    ap.add_argument("--no-files", action="store_true", help="no PNG, no copy in bench/out/")
    ap.add_argument("--keep", type=Path, default=None, help="work here and keep it")
    ap.add_argument("--loop-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULT).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps: at least 1")
    if args.layouts is None:
        args.layouts = "1x1,2x1" if args.quick else "1x1,2x1,1x2"
    args.layouts = [s for s in args.layouts.split(",") if s]
    if "1x1" not in args.layouts or not set(args.layouts) <= set(LAYOUTS):
        ap.error(f"--layouts: 1x1 and any of {', '.join(LAYOUTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.loop_child:
        loop_child(args.loop_child)
        return
    pin_threads(1)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        root = args.keep
    else:
        tmp = tempfile.TemporaryDirectory(prefix="lm-speed-")
        root = Path(tmp.name)
    os.environ["PIPETRANSFORMER_CACHE"] = str(root / "cache")  # the jobs' token cache too
    train, test, texts = write_corpus(root, args.corpus_kib)
    model_dir = root / "llama"
    params = make_model(model_dir, texts, vars(args))
    progress(f"model: {params / 1e6:.2f}M parameters; corpus {args.corpus_kib} KiB")
    base = job_spec("warm", "1x1", model_dir, train, test, args)
    sequences = len(packed_split(base)[2])  # builds the token cache every run then finds
    need = (args.warmup + args.steps) * args.batch
    if sequences < need:
        raise SystemExit(f"{sequences} packed sequences; {need} needed: raise --corpus-kib")
    progress(f"{sequences} packed sequences of {args.seq_len} tokens")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [LOOP, *args.layouts]}
    for rep in range(args.repeats):
        for name in rotated([LOOP, *args.layouts], rep):
            if name == LOOP:
                row = run_loop(root, model_dir, base, args)
            else:
                spec = job_spec(f"lm-{name}-r{rep}", name, model_dir, train, test, args)
                row = run_job(root, spec, args)
            runs[name].append(row)
            progress(f"repeat {rep} {name}: {json.dumps(row)[:600]}")
    errors = {n: r["error"] for n, rows in runs.items() for r in rows if "error" in r}
    if errors:
        emit({"benchmark": "lm_speed", "errors": errors})
        raise SystemExit(1)

    result = summarise(runs, args, params, model_dir)
    if not args.no_files:
        png = out_dir() / "lm_speed.png"
        plot(result, png)
        result["png"] = str(png)
    emit(result, save_as=None if args.no_files else "lm_speed.json")
    if not args.keep:
        tmp.cleanup()


def summarise(
    runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, params: int, model_dir: Path
) -> dict[str, Any]:
    layouts = args.layouts
    tokens_per_step = args.batch * args.seq_len

    def tps(name: str, key: str = "step_s") -> float:
        return tokens_per_step / median(r[key] for r in runs[name])

    speed = {LOOP: tps(LOOP)} | {n: tps(n) for n in layouts}
    own = {n: tps(n, "own_step_s") for n in layouts}
    memory = {n: memory_summary(runs[n]) for n in [LOOP, *layouts]}
    implied = {n: state_per_rank(model_dir, ranges_of(n, args.layers)) for n in layouts}
    milestones = {
        n: {
            k: median(r["milestones_s"][k] for r in runs[n] if r["milestones_s"][k] is not None)
            for k in runs[n][0]["milestones_s"]
        }
        for n in layouts
    }
    cpu: dict[str, Any] = {
        LOOP: medians([r["cpu_s_per_step"] for r in runs[LOOP]]),
        **{n: medians([r["cpu_s_per_step"] for r in runs[n] if r["cpu_s_per_step"]]) for n in
           layouts},
    }  # fmt: skip
    loop_phases = [r["phases_s_per_step"] for r in runs[LOOP]]
    phases: dict[str, Any] = {
        LOOP: {k: round(1000 * median(p[k] for p in loop_phases), 1) for k in loop_phases[0]}
    }
    for n in layouts:
        phases[n] = {
            rank: job_phases([r["stage_times"][rank] for r in runs[n]])
            for rank in runs[n][0]["stage_times"]
        }
    result: dict[str, Any] = {
        "benchmark": "lm_speed",
        "model": {
            "family": "llama",
            "parameters": params,
            **{k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads")},
            "intermediate": args.intermediate,
            "vocab": args.vocab,
            "tied": False,
        },
        "batch": {
            "global_batch": args.batch,
            "seq_len": args.seq_len,
            "tokens_per_step": tokens_per_step,
            "microbatches": {n: 1 if LAYOUTS[n][0] == 1 else args.microbatches for n in layouts},
            "schedule": "gpipe",
            "partition": "uniform",
        },
        "tokens_per_s": speed,
        "job_own_tokens_per_s": own,
        "job_vs_loop": speed["1x1"] / speed[LOOP],
        "job_vs_loop_per_repeat": [
            loop["step_s"] / job["step_s"]
            for loop, job in zip(runs[LOOP], runs["1x1"], strict=True)
        ],
        "job_own_vs_loop": own["1x1"] / speed[LOOP],
        "vs_1x1": {n: speed[n] / speed["1x1"] for n in layouts if n != "1x1"},
        "cpu_s_per_step": cpu,
        "job_vs_loop_cpu": cpu[LOOP]["process"] / cpu["1x1"]["rank 0"],
        "phases_ms_per_step": phases,
        "loss_first_last": {n: runs[n][0]["loss_first_last"] for n in [LOOP, *layouts]},
        "memory_mib": memory,
        "model_state_mib_implied": implied,
        "to_first_step_s": {n: milestones[n]["first_step_done"] for n in layouts},
        "milestones_s": milestones,
        "goals": {},
        "measured": {
            "tokens_per_s": "global batch x seq_len / the median over the measured steps of "
            "the interval between consecutive steps' metrics rows (job: the worker's clock at "
            "each step's end, so between-step work counts) or of the step's wall time (loop, "
            "timed from a step's start to the next's); medians over repeats",
            "job_own_tokens_per_s": "the same from the job's own per-step samples_per_s (the "
            "step's span as the trainer times it: between-step work left out)",
            "memory_mib.model": "per rank (loop: its process), the peak of RssAnon while "
            "training (up to the last step's metrics row) minus RssAnon when the data was read "
            "and the model not yet built (a job: the last sample before rank 0's data_opened "
            "event); model state, activations and allocator slack, not imports: the goal's "
            "figure",
            "memory_mib.peak_rss": "per rank, the peak VmRSS while training (torch, "
            "transformers, shared libraries and pages shared with the fork server included)",
            "model_state_mib_implied": "per pipeline rank, weights + gradients + AdamW's two "
            "moments (16 bytes per float32 parameter) of its units, from the checkpoint's "
            "parameter counts and the uniform partition: not measured",
            "cpu_s_per_step": "CPU seconds (user + system) per measured step: the loop's "
            "process; each job process from /proc/<pid>/stat sampled every sample_s, "
            "interpolated to the metrics rows that bound the measured steps, by rank and role "
            "('all': every process of the job, 'wall': the steps' wall seconds); "
            "job_vs_loop_cpu: the loop's CPU per step over the 1x1 worker's",
            "phases_ms_per_step": "the loop's phases (wall) beside each job rank's stage clock "
            "(core/stage_times.py PHASES), per step, over the reporting intervals inside the "
            "measured steps",
            "loss_first_last": "the first and last step's training loss, first repeat: the "
            "job trains what the loop trains",
            "to_first_step_s": "from the start of the `pipetransformer run` process to the end "
            "of the first training step (rank 0's first_step report, the worker's clock); "
            "milestones_s: the store's events on the way (median over repeats)",
        },
        "runs": runs,
        "config": {
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "loader_workers": args.loader_workers,
            "threads_per_process": 1,
            "cross_document_attention": True,
            "sample_s": args.sample_s,
            "quick": args.quick,
            **TRAINING,
        },
        "environment": environment(),
    }
    result["goals"] = goals(result, layouts)
    return result


def medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Key by key (nested dicts too), the median over `rows` (a missing key counts 0)."""
    keys = sorted({k for r in rows for k in r}, key=lambda k: (isinstance(rows[0].get(k), dict), k))
    return {
        k: medians([r.get(k, {}) for r in rows])
        if any(isinstance(r.get(k), dict) for r in rows)
        else round(median(r.get(k, 0.0) for r in rows), 4)
        for k in keys
    }


def job_phases(intervals: list[dict[str, Any]]) -> dict[str, float]:
    """One rank's stage-clock milliseconds per step by phase (and `wall`), medians over
    repeats."""
    from pipetransformer.core.stage_times import PHASES

    return {
        p: round(1000 * median(t[key] / t["steps"] for t in intervals), 1)
        for p, key in [("wall", "wall_s"), *((p, p) for p in PHASES)]
    }


def ranges_of(layout: str, depth: int) -> list[list[tuple[int, int]]]:
    from pipetransformer.core.partition import uniform_partition

    stages, _ = LAYOUTS[layout]
    return [[r] for r in uniform_partition(depth, stages)]


def memory_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank, medians over repeats of the model memory and the peak resident set; and the
    largest rank's of each."""
    ranks = sorted({k for r in rows for k in r["memory"]}, key=int)
    model = {k: median(r["memory"][k]["model"] for r in rows) for k in ranks}
    rss = {k: median(r["memory"][k]["peak_rss"] for r in rows) for k in ranks}
    return {
        "model": model,
        "peak_rss": rss,
        "max_model": max(model.values()) if model else None,
        "max_peak_rss": max(rss.values()) if rss else None,
    }


def goals(result: dict[str, Any], layouts: list[str]) -> dict[str, Any]:
    """The issue's goals against the figures: the job within 10 % of the loop; the largest rank
    of 2x1 at most 0.6 of 1x1's (on `memory_mib.model`; the raw resident set's and the implied
    state's ratios beside it)."""
    out: dict[str, Any] = {
        "job_within_10pct_of_loop": {
            "ratio": result["job_vs_loop"],
            "met": result["job_vs_loop"] >= 0.9,
        }
    }
    mem = result["memory_mib"]
    out["job_1x1_memory_vs_loop"] = mem["1x1"]["max_model"] / mem[LOOP]["max_model"]
    if "2x1" in layouts:
        ratio = mem["2x1"]["max_model"] / mem["1x1"]["max_model"]
        implied = result["model_state_mib_implied"]
        out["memory_per_rank_2x1_vs_1x1_at_most_0.6"] = {
            "ratio": ratio,
            "met": ratio <= 0.6,
            "per_rank": {k: v / mem["1x1"]["max_model"] for k, v in mem["2x1"]["model"].items()},
            "raw_peak_rss_ratio": mem["2x1"]["max_peak_rss"] / mem["1x1"]["max_peak_rss"],
            "implied_state_ratio": max(implied["2x1"]) / max(implied["1x1"]),
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, c, b) = plt.subplots(1, 3, figsize=(16, 4.6))
    tps = result["tokens_per_s"]
    names = list(tps)
    a.bar(names, [tps[n] for n in names], color=["tab:gray"] + ["tab:blue"] * (len(names) - 1))
    for i, n in enumerate(names):
        a.text(i, tps[n], f"{tps[n]:.0f}", ha="center", va="bottom", fontsize=9)
    a.set_ylabel("training tokens/s")
    a.set_title(
        f"(a) tokens/s, batch {result['batch']['global_batch']} x {result['batch']['seq_len']}: "
        f"job 1x1 / loop {result['job_vs_loop']:.3f}",
        fontsize=9,
    )
    cpu = result["cpu_s_per_step"]
    bottoms = [0.0] * len(names)
    parts = {
        "rank 0": ("tab:blue", "rank 0 (loop: its process)"),
        "rank 1": ("tab:cyan", "rank 1"),
        "job": ("tab:orange", "the job's other processes"),
        "outside": ("lightgray", "other work on the machine"),
    }
    for part, (color, label) in parts.items():
        heights = []
        for n in names:
            one = cpu[n]
            if part == "outside":
                heights.append(max(0.0, one.get("outside", 0.0)))
            elif n == LOOP:
                heights.append(one["process"] if part == "rank 0" else 0.0)
            elif part == "job":
                heights.append(one["all"] - one.get("rank 0", 0.0) - one.get("rank 1", 0.0))
            else:
                heights.append(one.get(part, 0.0))
        c.bar(names, heights, bottom=bottoms, color=color, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    walls = [result["batch"]["tokens_per_step"] / tps[n] for n in names]
    c.plot(names, walls, "k_", markersize=30, mew=2, label="wall seconds per step (a)")
    c.set_ylabel("CPU seconds per step")
    c.set_title(
        f"(b) CPU seconds per step; the machine has {result['environment']['cpus']} cores",
        fontsize=9,
    )
    c.set_ylim(0, max(bottoms) * 1.45)
    c.legend(fontsize=7, ncol=2, loc="upper left", markerscale=0.4)
    mem = result["memory_mib"]
    labels, model, rss = [], [], []
    for layout, m in mem.items():
        for rank in m["model"]:
            labels.append(layout if layout == LOOP else f"{layout}\nrank {rank}")
            model.append(m["model"][rank])
            rss.append(m["peak_rss"][rank])
    xs = range(len(labels))
    b.bar([x - 0.2 for x in xs], rss, width=0.4, label="peak RSS", color="tab:gray")
    b.bar(
        [x + 0.2 for x in xs], model, width=0.4, label="anon. growth from the model's build",
        color="tab:red",
    )  # fmt: skip
    state = result["model_state_mib_implied"]["1x1"][0]
    b.axhline(state, ls="--", color="black", lw=1, label="1x1 weights+grads+AdamW")
    b.axhline(state / 2, ls=":", color="black", lw=1, label="half of it")
    b.set_xticks(list(xs), labels, fontsize=8)
    b.set_ylabel("MiB per process")
    goal = result["goals"].get("memory_per_rank_2x1_vs_1x1_at_most_0.6")
    b.set_title(
        "(c) memory per process" + (f": 2x1 / 1x1 {goal['ratio']:.2f}" if goal else ""),
        fontsize=9,
    )
    b.set_ylim(0, max(rss) * 1.4)
    b.legend(fontsize=7, ncol=2, loc="upper left")
    for ax in (a, b, c):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
