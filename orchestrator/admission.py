"""Admission: whether a valid job spec can run where it is sent, decided before anything starts.

`estimate(spec)` predicts the memory each worker needs for the layout the job starts with;
`admit(spec, capacity_bytes)` compares it with a capacity and returns (field, message) problems
in `SpecError`'s format, naming the fields to change, what the job needs and what there is. Both
are pure and deterministic (no torch); `host_memory_bytes()` is the one function that looks at
the machine. `pipetransformer run` passes this machine's memory shared by all workers; a
device's memory per worker can be passed instead (`per_worker=True`).

The seeded models (models/seeded.py; counts by core/families), float32 throughout
-------------------------------------------------
d = model.dim, H = int(d x mlp_ratio), h = heads, k = num_classes, t = tokens between blocks
(vit: (image_size / patch_size)^2 + 1; bert: seq_len + 1), b = samples in one micro-batch
(global_batch_size / (replicas x microbatches); `auto` counts as 1 micro-batch).

* Parameters. Block: 4d^2 + 2dH + 8d + H (qkv without bias, q/v biases, projection, two
  LayerNorms, the MLP). Embedding: vit c p^2 d + d (patch projection) + d (CLS) + (n+1) d
  (positions); bert V d (tokens) + d (CLS) + (L+1) d (positions) + 2d (LayerNorm). Head:
  2d + dk + k. Exact: tests/test_admission.py counts the real modules.
* Per parameter of a worker's stages: 16 bytes (weight, gradient, AdamW's two moments; 20 under
  `training.precision: bf16-weights`: bf16 weight and gradient, float32 master and its gradient,
  the moments) + 12 (the checkpoint snapshot of weights and moments, kept between checkpoints).
  With LoRA adapters (`model.adapters`) only the adapters (rank x (inputs + outputs) of each
  targeted layer) and a classifier's new head cost that; every other parameter is its weight
  alone (4 bytes; 6 under bf16-weights).
  A worker builds only its own units (meta device, then materialised), initialising one unit
  at a time on the CPU (4 bytes a parameter of the largest unit).
* Activations one micro-batch leaves for backward, per block: 4 b t (8d + 2H + h + 4) (the
  block input, both LayerNorm outputs and statistics, qkv, the attention output and logsumexp,
  the residual sum, the MLP's hidden layer before and after GELU). With dropout > 0 attention
  is unfused and keeps t x t per head: + 4 b h t^2 x 3 + 4 b t x 3d, and b t (H + d) bytes of
  masks. Under `bf16-weights` a block's activations are bf16, 2 bytes where these say 4, except
  LayerNorm's statistics and attention's logsumexp (float32 at any precision) and unfused
  attention's tensors (float32, seen on the CPU); the stage's output, handed to the next stage,
  stays float32. tests/test_admission.py checks this against the tensors autograd saves (within
  10%), in float32 and in bf16.
  Embedding: its inputs (vit 4 b c image_size^2; bert 8 b L + 4 b t (d + 2)); head:
  4 b (2d + k). Each stage also holds its output (4 b t d) per micro-batch in flight, and once
  one block's activations (backward's workspace, or the block being recomputed). With
  `parallel.recompute` a block keeps only its input (4 b t d). Micro-batches in flight on
  stage s of S: m for GPipe, min(m, S - s) for 1F1B, m for the others (an upper bound, as in
  core/partition.py).
* Data: every worker loads the whole data set (train and test): inputs (vit float32 c x
  image_size^2, bert int64 seq_len) and an int64 label per sample, and up to 3 times that while
  generating and splitting it (float64 noise, index copies).
* Processes: 128 MiB a worker (forked from the node's fork server, which holds torch's pages),
  512 MiB a node (torchrun agent and fork server) and 256 MiB for the controller and etcd;
  AutoCache's RAM tier (at most 256 MiB) on the first stage unless freeze.cache is off, or
  freeze.relayout is off (frozen blocks stay in their stages: there is no prefix to cache).

A worker's peak: process + data + max(its state and activations, one unit while initialising,
the data while loading). On a GPU (`runtime.device: cuda`) the state and activations live in
device memory and bf16 autocast keeps float32 weights: these host-memory figures over-state a
GPU worker's host need, which is why `run` checks GPUs by count (`gpu_shortfall`), not size. `pipetransformer run` needs every worker's peak at once
(replicas x the pipeline ranks) plus the processes around them.

Stages get the initial layout's block ranges (`core.planner.initial_ranges`: `parallel.stages x
virtual_stages` contiguous ranges of equal size, earlier stages taking the remainder) and are
placed on ranks as the schedule expects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pipetransformer.core.datasets import DataSize

# the pure planner's initial split (the one trainer import orchestrator allows, as the controller)
from pipetransformer.core.planner import initial_ranges
from pipetransformer.core.spec import SCHEDULES, JobSpec, ModelSpec
from pipetransformer.core.state import pipeline_position
from pipetransformer.core.tasks import task_of

MIB = 1 << 20
GIB = 1 << 30
F32 = 4
STATE_BYTES = 16  # a trainable parameter: weight, gradient, AdamW exp_avg and exp_avg_sq
SNAPSHOT_BYTES = 12  # the checkpoint stager's copy of weight and both moments
WORKER_BYTES = 128 * MIB
NODE_BYTES = 512 * MIB
BASE_BYTES = 256 * MIB
CACHE_RAM_BYTES = 256 * MIB  # AutoCache's RAM tier per first-stage worker (trainer/cache/)
LOAD_FACTOR = 3  # data held while generating and splitting, over data held after


# -- parameters and activations -----------------------------------------------------------------


def hidden(m: ModelSpec) -> int:
    return m.family_info.hidden(m)


def tokens(m: ModelSpec) -> int:
    """Tokens between blocks."""
    return m.tokens


def block_params(m: ModelSpec) -> int:
    return m.family_info.block_params(m)


def embed_params(m: ModelSpec) -> int:
    return m.family_info.embed_params(m)


def head_params(m: ModelSpec) -> int:
    return m.family_info.head_params(m)


def model_params(m: ModelSpec) -> int:
    return embed_params(m) + m.depth * block_params(m) + head_params(m)


def activation_element_bytes(precision: str) -> int:
    """Bytes of an activation element inside a block: 2 where the weights are bf16 (everything
    they compute is bf16), else 4 (float32, and bf16 autocast's mixture is bounded by it)."""
    return 2 if precision == "bf16-weights" else F32


def state_bytes_per_parameter(precision: str) -> int:
    """Training state per trainable parameter: `STATE_BYTES`, and under bf16-weights the bf16
    weight and gradient beside the float32 master and its gradient (2 + 2 + 4 + 4 + 8 = 20)."""
    return STATE_BYTES + 4 if precision == "bf16-weights" else STATE_BYTES


def trained_params(m: ModelSpec, blocks: int, embed: bool, head: bool) -> int:
    """What trains of a stage holding `blocks` blocks (and the embedding, the head): all of it,
    or with LoRA adapters (`model.adapters`) the adapters alone and a classifier's head (a new
    head, counted whole; a language model's head is the checkpoint's, frozen)."""
    if m.adapters is None:
        return blocks * block_params(m) + embed * embed_params(m) + head * head_params(m)
    new_head = head and not task_of(m).vocab_outputs
    return blocks * m.family_info.adapter_params(m) + new_head * head_params(m)


def state_bytes(precision: str, params: int, trained: int) -> int:
    """A worker's training state for `params` parameters of which `trained` train (see the
    module docstring): a frozen one is its weight alone (under bf16-weights a bf16 copy beside
    the float32 master), a trained one its `state_bytes_per_parameter` and the checkpoint
    snapshot's copy."""
    frozen = F32 + (2 if precision == "bf16-weights" else 0)
    return (params - trained) * frozen + trained * (
        state_bytes_per_parameter(precision) + SNAPSHOT_BYTES
    )


def block_activation_bytes(m: ModelSpec, b: int, element: int = F32) -> int:
    """Bytes one block keeps for backward for a micro-batch of `b` samples, `element` bytes an
    activation element (`activation_element_bytes`)."""
    d, h, t = m.dim, hidden(m), tokens(m)
    # LayerNorm statistics and attention's logsumexp stay float32 at any precision
    out = element * b * t * (8 * d + 2 * h) + F32 * b * t * (m.heads + 4)
    if m.dropout > 0:  # unfused attention: q, k, v, scores, probabilities (float32 when unfused:
        # seen on the CPU in bf16); bool dropout masks
        out += F32 * b * m.heads * t * t * 3 + F32 * b * t * 3 * d + b * t * (h + d)
    return out


def embed_activation_bytes(m: ModelSpec, b: int) -> int:
    if m.is_text:
        return 8 * b * (m.seq_len or 0) + F32 * b * tokens(m) * (m.dim + 2)
    return F32 * b * m.channels * m.image_size**2


def head_activation_bytes(m: ModelSpec, b: int) -> int:
    return F32 * b * (2 * m.dim + m.num_classes)


def input_bytes_per_sample(m: ModelSpec) -> int:
    """A sample as the data set holds it: its inputs and an int64 label."""
    if m.is_text:
        return 8 * (m.seq_len or 0) + 8
    return F32 * m.channels * m.image_size**2 + 8


# -- the data set --------------------------------------------------------------------------------


def data_size(spec: JobSpec) -> DataSize:
    """What every worker holds of the data set, as its kind says."""
    return spec.data.kind.size(spec.data, spec.model)


# -- the estimate --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageEstimate:
    index: int
    blocks: tuple[int, int]  # [start, end)
    rank: int  # pipeline position of the rank that runs it
    params: int
    activation_bytes: int  # at the micro-batches it holds in flight, with backward workspace
    in_flight: int
    trained: int  # of its parameters, those that train (with adapters: the adapters alone)


@dataclass(frozen=True)
class WorkerEstimate:
    """One pipeline rank (every replica's rank at this position needs the same)."""

    rank: int
    stages: tuple[int, ...]
    params: int
    state_bytes: int  # weights, gradients, AdamW moments and the checkpoint snapshot
    activation_bytes: int
    build_bytes: int  # one unit's seed-derived initial weights, made on the CPU before copying
    data_bytes: int  # the data set it holds
    load_bytes: int  # extra while generating and splitting the data set
    other_bytes: int  # the process itself and AutoCache's RAM tier

    @property
    def peak_bytes(self) -> int:
        train = self.state_bytes + self.activation_bytes
        return self.other_bytes + self.data_bytes + max(train, self.build_bytes, self.load_bytes)


@dataclass(frozen=True)
class Estimate:
    params: int
    microbatch: int
    microbatches: int
    tokens: int
    data: DataSize
    stages: tuple[StageEstimate, ...]
    ranks: tuple[WorkerEstimate, ...]  # one replica's pipeline ranks
    replicas: int
    nodes: int

    @property
    def workers(self) -> int:
        return len(self.ranks) * self.replicas

    @property
    def worker_peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.ranks)

    @property
    def job_bytes(self) -> int:
        """Every worker, agent and the controller on one machine (`pipetransformer run`)."""
        workers = self.replicas * sum(r.peak_bytes for r in self.ranks)
        return BASE_BYTES + self.nodes * NODE_BYTES + workers


def estimate(spec: JobSpec) -> Estimate:
    """The memory the job's initial layout needs, per pipeline rank (see the module docstring)."""
    m, p, t = spec.model, spec.parallel, spec.training
    micro = 1 if p.microbatches == "auto" else p.microbatches
    b = max(1, t.global_batch_size // (p.replicas * micro))
    S, P = p.num_stages, p.stages
    rule = SCHEDULES[p.schedule]
    element = activation_element_bytes(t.precision)
    block_act, block_in = block_activation_bytes(m, b, element), element * b * tokens(m) * m.dim
    stages = []
    for s, (a, c) in enumerate(initial_ranges(spec)):
        params = (c - a) * block_params(m) + (c - a) * m.family_info.adapter_params(m)
        trained = trained_params(m, c - a, a == 0, c == m.depth)
        kept = block_in if p.recompute_for(s) else block_act  # per block, per micro-batch
        act = (c - a) * kept + F32 * b * tokens(m) * m.dim  # + the stage's (float32) output
        if a == 0:
            params += embed_params(m)
            act += embed_activation_bytes(m, b)
        if c == m.depth:
            params += head_params(m)
            act += head_activation_bytes(m, b)
        in_flight = min(micro, S - s) if p.schedule == "1f1b" else micro
        stages.append(
            StageEstimate(
                index=s,
                blocks=(a, c),
                rank=pipeline_position(s, P, S, rule.placement),
                params=params,
                activation_bytes=act * in_flight + block_act,  # + backward workspace
                in_flight=in_flight,
                trained=trained,
            )
        )
    data = data_size(spec)
    held = data.samples * input_bytes_per_sample(m)
    total = model_params(m)
    cache = 0
    if spec.freeze.cache != "off" and spec.freeze.relayout != "off":
        cache = min(CACHE_RAM_BYTES, data.train * tokens(m) * m.dim * F32)
    ranks = []
    for r in range(P):
        mine = [s for s in stages if s.rank == r]
        params = sum(s.params for s in mine)
        ranks.append(
            WorkerEstimate(
                rank=r,
                stages=tuple(s.index for s in mine),
                params=params,
                state_bytes=state_bytes(t.precision, params, sum(s.trained for s in mine)),
                activation_bytes=sum(s.activation_bytes for s in mine),
                build_bytes=max(block_params(m), embed_params(m), head_params(m)) * F32,
                data_bytes=held,
                load_bytes=(LOAD_FACTOR - 1) * held,
                other_bytes=WORKER_BYTES + (cache if any(s.index == 0 for s in mine) else 0),
            )
        )
    return Estimate(
        params=total,
        microbatch=b,
        microbatches=micro,
        tokens=tokens(m),
        data=data,
        stages=tuple(stages),
        ranks=tuple(ranks),
        replicas=p.replicas,
        nodes=spec.runtime.nodes,
    )


# -- admission -----------------------------------------------------------------------------------


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / MIB:.0f} MiB"


def _count(n: int) -> str:
    for unit, size in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _what_to_change(spec: JobSpec, est: Estimate, worker: WorkerEstimate) -> tuple[str, str]:
    """The field to name and how to bring the need down, for the largest part of `worker`."""
    m, p = spec.model, spec.parallel
    parts = {
        "params": max(worker.state_bytes, worker.build_bytes),
        "activations": worker.activation_bytes,
        "data": worker.data_bytes + worker.load_bytes,
        "workers": worker.other_bytes if est.workers > 1 else 0,
    }
    largest = max(parts, key=lambda k: parts[k])
    if largest == "params":
        fields = [f"model.depth ({m.depth})", f"model.dim ({m.dim})"]
        if embed_params(m) > est.params / 4:
            fields.append(
                f"model.vocab_size ({m.vocab_size})"
                if m.is_text
                else f"model.image_size/patch_size ({m.image_size}/{m.patch_size})"
            )
        if head_params(m) > est.params / 4:
            fields.append(f"model.num_classes ({m.num_classes})")
        how = f"mostly parameters (the model has {_count(est.params)} parameters"
        if worker.build_bytes >= worker.state_bytes:
            how += ", and a worker initialises its largest unit whole on the CPU"
        else:
            how += f", {_count(worker.params)} on one worker at 28 bytes each with AdamW"
        more = " or raise parallel.stages" if worker.state_bytes > worker.build_bytes else ""
        return "model", f"{how}); lower {' or '.join(fields)}{more}"
    if largest == "activations":
        what = (
            f"model.seq_len ({m.seq_len})"
            if m.is_text
            else f"model.image_size/patch_size ({m.image_size}/{m.patch_size})"
        )
        return "training.global_batch_size", (
            f"mostly activations (micro-batches of {est.microbatch} samples x {est.tokens} "
            f"tokens); lower training.global_batch_size ({spec.training.global_batch_size}), "
            f"raise parallel.microbatches ({p.microbatches}), set parallel.recompute: true, "
            f"or lower {what}"
        )
    if largest == "data":
        return "data.synthetic_samples", (
            f"mostly the data set ({_count(est.data.samples)} samples, "
            f"{gib(worker.data_bytes)} held by every worker); lower data.synthetic_samples"
        )
    return "parallel", (
        f"mostly the {est.workers} worker processes (parallel.stages x parallel.replicas = "
        f"{p.stages} x {p.replicas}) and runtime.nodes ({spec.runtime.nodes}); use fewer"
    )


def admit(
    spec: JobSpec,
    capacity_bytes: int | None,
    *,
    per_worker: bool = False,
    where: str = "this machine",
) -> list[tuple[str, str]]:
    """Why `spec` cannot run (field, message pairs; empty if it can).

    `capacity_bytes` is the memory of `where`: shared by every worker and process of the job
    (`pipetransformer run`: one machine), or with `per_worker` the memory of each worker's own
    device. None checks only what does not depend on the machine."""
    problems: list[tuple[str, str]] = []
    est = estimate(spec)
    data, gbs = est.data, spec.training.global_batch_size
    if spec.data.is_source:
        pass  # the workers count the files and check them before training
    elif data.train_at_least < 1:
        problems.append(
            (
                "data.synthetic_samples",
                f"{spec.data.synthetic_samples} samples may leave no training sample once "
                f"data.test_fraction ({spec.data.test_fraction}) of each of up to "
                f"{min(spec.data.synthetic_samples, spec.model.num_classes)} classes is held "
                "out; raise data.synthetic_samples",
            )
        )
    elif gbs > data.train:
        problems.append(
            (
                "training.global_batch_size",
                f"{gbs} is larger than the training split ({data.train} samples: {data.about}); "
                "every step would be one padded batch of the whole split; lower "
                f"training.global_batch_size to at most {data.train}",
            )
        )
    if capacity_bytes is None:
        return problems
    worst = max(est.ranks, key=lambda r: r.peak_bytes)
    if per_worker:
        need, what = worst.peak_bytes, f"its largest worker (pipeline rank {worst.rank})"
    else:
        need, what = est.job_bytes, f"{est.workers} worker(s) of up to {gib(worst.peak_bytes)}"
    if need > capacity_bytes:
        field, how = _what_to_change(spec, est, worst)
        problems.append(
            (
                field,
                f"the job needs about {gib(need)} of memory ({what}) but {where} has "
                f"{gib(capacity_bytes)}: {how}",
            )
        )
    return problems


def host_memory_bytes() -> int:
    """This machine's memory for the job: physical RAM, or the cgroup's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total
