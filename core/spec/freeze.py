"""`freeze` and `init`: AutoFreeze's policy and bounds, and a fine-tuning checkpoint to start from."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from pipetransformer.core.spec.base import (
    MAX_DEPTH,
    MAX_NAME,
    MAX_PATH,
    MAX_STEPS,
    MAX_WARMUP_DECISIONS,
    NonNegativeInt,
    Number,
    PositiveInt,
    _Strict,
)


class FreezeSpec(_Strict):
    """AutoFreeze: freeze a growing prefix of blocks (0 .. F-1) as they converge (PipeTransformer).

    At each decision point T (1, 2, ...), the automatic boundary may grow to at most the
    alpha-bound ceil(L * (1 - (1 - alpha)^T')) (L = model.depth, T' = T - warmup_decisions, the
    decision points after warm-up) and never past
    L - keep_trainable; it never decreases. The classifier head is never frozen. A manual override
    (`pipetransformer freeze`) is applied at the next decision point, may only move forward and
    is bounded by the model and keep_trainable, not by alpha. Implemented in core/freeze.py.

    How the job re-lays itself out when F moves (`relayout`; planned in core/planner.py):
    'elastic' (the default: AutoPipe + AutoDP) takes the frozen blocks out of the pipeline (the
    first stage's rank runs them forward-only, AutoCache may serve them), re-partitions the
    active blocks and turns freed ranks into replicas; 'repartition' (AutoPipe without AutoDP)
    does the same but keeps the current number of replicas, hence the pipeline depth, so every
    stage needs an active block: keep_trainable must be at least parallel.stages x
    parallel.virtual_stages; 'off' keeps every stage, replica and the micro-batch count as they
    are and freezes blocks in place (no gradient, no optimizer, no gradient sync; they still run
    forward in their stages, without AutoCache)."""

    policy: Literal["auto", "output", "gradient", "schedule", "off"] = Field(
        "off",
        description="'output': freeze the longest prefix of blocks whose output on a fixed probe "
        "batch has stopped moving (see `output_ratio`), bounded by the alpha-schedule; "
        "'gradient': freeze the longest prefix of blocks whose gradients have settled (see "
        "`criterion`), bounded by the alpha-schedule; "
        "'schedule': freeze exactly the alpha-bound at every decision point; 'off': never freeze "
        "automatically (manual overrides still apply); 'auto': the rule that held accuracy "
        "best in the policy comparison (docs/benchmarks.md), now 'output'",
    )
    alpha: Annotated[Number, Field(gt=0, lt=1)] = Field(
        0.25,
        description="PipeTransformer's alpha in (0, 1): T' decision points after warm-up at "
        "most ceil(model.depth * (1 - (1 - alpha)^T')) blocks are frozen; larger freezes faster",
    )
    every: Literal["epoch"] | PositiveInt = Field(
        "epoch",
        description="decision points: at the end of every epoch, or every K optimizer steps",
    )
    keep_trainable: Annotated[PositiveInt, Field(le=MAX_DEPTH)] = Field(
        1,
        description="at least this many of the last blocks stay trainable (the head always "
        "does); must be less than model.depth unless policy is 'off'",
    )
    threshold: Annotated[Number, Field(gt=0, le=1)] = Field(
        0.2,
        description="criterion 'decay': a block has converged when its mean per-step gradient "
        "norm over the last interval has decayed to at most this fraction of its peak (the "
        "largest such mean so far): n_T <= threshold * max(n_1 .. n_T)",
    )
    criterion: Literal["auto", "decay", "noise"] = Field(
        "auto",
        description="gradient policy: when a block has settled. 'decay': its mean gradient norm "
        "has decayed to `threshold` times its peak (training from scratch); 'noise': its "
        "gradient over the interval is mostly noise, the norm of the summed gradient at most "
        "`noise_ratio` times the root of the summed squared step norms (fine-tuning, where the "
        "norms rise while a new head grows); 'auto': 'noise' when the job starts from trained "
        "weights (model.pretrained or init.checkpoint), else 'decay'",
    )
    noise_ratio: Annotated[Number, Field(gt=0, le=100)] = Field(
        1.5,
        description="criterion 'noise': a block has settled when ||sum of its step gradients|| "
        "<= noise_ratio x sqrt(sum of their squared norms) over the interval (about 1 for pure "
        "noise, up to sqrt(steps) for a steady direction)",
    )
    output_ratio: Annotated[Number, Field(gt=0, lt=1)] = Field(
        0.3,
        description="policy 'output': a block has settled when its output on the probe batch "
        "(the first global batch of the held-out rows) moved, per unit of learning rate, at "
        "most this fraction as fast over the last interval as over its fastest interval so far; "
        "per unit of learning rate, so that a decaying schedule does not read as convergence",
    )
    warmup_decisions: Annotated[NonNegativeInt, Field(le=MAX_WARMUP_DECISIONS)] = Field(
        0,
        description="no automatic freezing at the first this-many decision points (they still "
        "record gradient norms); the alpha-bound counts decision points from the end of warm-up",
    )
    cache: Literal["off", "auto", "on"] = Field(
        "auto",
        description="AutoCache: serve the frozen prefix's output per sample from a cache (RAM, "
        "spilling to disk) instead of recomputing it. 'auto' uses it where measurement says it "
        "is cheaper. Cached outputs are only valid for deterministic inputs: a data pipeline "
        "with random augmentation must use 'off'",
    )
    relayout: Literal["elastic", "repartition", "off"] = Field(
        "elastic",
        description="what happens to the layout when the freeze boundary moves: 'elastic' "
        "(AutoPipe + AutoDP) moves the frozen blocks out of the pipeline, re-partitions the "
        "active blocks and makes freed ranks replicas; 'repartition' (AutoPipe only) moves the "
        "frozen blocks out and re-partitions the active blocks over the same number of stages, "
        "keeping the replicas (needs keep_trainable >= parallel.stages x "
        "parallel.virtual_stages); 'off' keeps the stages, replicas and micro-batches and "
        "freezes blocks in place (they still run forward in their stages; no AutoCache)",
    )
    handover: Literal["memory", "checkpoint"] = Field(
        "memory",
        description="how a re-layout moves weights and optimizer state to their new owners: "
        "'memory' sends them between the running ranks directly (each rank keeps what it keeps, "
        "receives what it gains from a rank that held it; nothing is written or read back, and "
        "durability stays with the checkpoint section's schedule); 'checkpoint' commits a "
        "checkpoint under the old layout and every rank reads its blocks back from it (a "
        "committed checkpoint at every re-layout, at the price of a storage round trip)",
    )

    @field_validator("every", mode="before")
    @classmethod
    def _every(cls, value: Any) -> Any:
        if value == "epoch":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_STEPS:
            return value
        raise ValueError(
            f"must be 'epoch' or a positive whole number of optimizer steps (at most {MAX_STEPS})"
        )


_UNIT_RE = re.compile(r"^(embed|head|blocks\.(0|[1-9][0-9]*))$")


class InitSpec(_Strict):
    """Fine-tuning: start from the model weights of a checkpoint another job committed, instead
    of a seeded random initialisation. Only weights are taken: the optimizer, LR schedule,
    sampler and freeze state start afresh (a resume of this job, by contrast, continues from its
    own checkpoints and never reads this one again).

    The architecture must match the checkpoint's (model.family, dim, depth, heads, mlp_ratio and
    the family's input fields); units listed in `skip` keep their fresh initialisation, so a
    new classifier head (`skip: [head]`) may have a different model.num_classes."""

    checkpoint: Annotated[str, Field(max_length=MAX_PATH)] | None = Field(
        None,
        description="a committed checkpoint directory (`.../checkpoints/step-NNNNNNNN`), or a "
        "checkpoints directory to take its newest complete checkpoint from; a path as the "
        "controller and workers see it (a relative one is resolved at submission)",
    )
    skip: list[Annotated[str, Field(max_length=MAX_NAME)]] = Field(
        [],
        max_length=MAX_DEPTH + 2,
        description="units left freshly initialised: 'embed', 'head' or 'blocks.<i>'",
    )
    checksum: Annotated[str, Field(max_length=MAX_NAME * 2)] | None = Field(
        None,
        description="the checkpoint's manifest checksum; filled in at submission, so the "
        "workers load exactly the checkpoint that was checked (give it to pin one)",
    )

    @field_validator("skip")
    @classmethod
    def _units(cls, value: list[str]) -> list[str]:
        bad = [u for u in value if not _UNIT_RE.match(u)]
        if bad:
            raise ValueError(
                f"unknown unit(s) {', '.join(map(repr, bad))}: use 'embed', 'head' or "
                "'blocks.<i>' (i from 0 to model.depth - 1)"
            )
        return value

    @model_validator(mode="after")
    def _needs_checkpoint(self) -> InitSpec:
        if self.checkpoint is None and (self.skip or self.checksum):
            raise ValueError(
                "init.skip and init.checksum need init.checkpoint; set it or remove them"
            )
        return self
