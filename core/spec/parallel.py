"""`training`, `parallel` and `checkpoint`: how a job optimises, how its pipeline is laid out
(the schedules and what each needs) and when it checkpoints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from pipetransformer.core.spec.base import (
    MAX_BATCH,
    MAX_CHECKPOINT_SECONDS,
    MAX_EPOCHS,
    MAX_GRAD_CLIP,
    MAX_KEEP,
    MAX_LR,
    MAX_MICROBATCHES,
    MAX_NAME,
    MAX_REPLICAS,
    MAX_STAGES,
    MAX_STEPS,
    MAX_VIRTUAL_STAGES,
    MAX_WEIGHT_DECAY,
    NonNegativeInt,
    Number,
    PositiveInt,
    Seed,
    _Strict,
)


class TrainingSpec(_Strict):
    epochs: Annotated[PositiveInt, Field(le=MAX_EPOCHS)] = 20
    global_batch_size: Annotated[PositiveInt, Field(le=MAX_BATCH)] = Field(
        64, description="samples per optimizer step, summed over replicas and micro-batches"
    )
    lr: Annotated[Number, Field(gt=0, le=MAX_LR)] = 3e-3
    weight_decay: Annotated[Number, Field(ge=0, le=MAX_WEIGHT_DECAY)] = 0.05
    warmup_steps: Annotated[NonNegativeInt, Field(le=MAX_STEPS)] = 20
    min_lr_ratio: Annotated[Number, Field(ge=0, le=1)] = 0.05
    grad_clip: Annotated[Number, Field(ge=0, le=MAX_GRAD_CLIP)] = 1.0
    seed: Seed = 0
    max_steps: Annotated[PositiveInt, Field(le=MAX_STEPS)] | None = Field(
        None, description="stop after this many optimizer steps (for smoke tests)"
    )
    target_accuracy: Annotated[Number, Field(gt=0, le=1)] | None = Field(
        None, description="stop once held-out accuracy reaches this fraction"
    )
    target_perplexity: Annotated[Number, Field(gt=1, le=1e9)] | None = Field(
        None,
        description="causal-lm: stop once held-out perplexity (exp of the loss per token) falls "
        "to this",
    )
    precision: Literal["fp32", "bf16", "bf16-weights"] = Field(
        "fp32",
        description="'bf16': blocks compute under bfloat16 autocast while weights, gradients, "
        "optimizer state, checkpoints and the activations between stages stay float32 (no "
        "master-weight copies, no loss scaling); 'bf16-weights': the model's weights, "
        "activations and gradients are bfloat16 (no autocast, fewer bytes moved: the faster "
        "one on a GPU) and AdamW updates float32 master copies, which are what checkpoints "
        "hold; 'fp32': float32 throughout. A checkpoint resumes under any of them",
    )

    @model_validator(mode="after")
    def _decay_below_one(self) -> TrainingSpec:
        # AdamW multiplies every weight by (1 - lr x weight_decay) each step: at 1 or more
        # that zeroes or flips the weights
        if self.lr * self.weight_decay >= 1:
            raise ValueError(
                f"lr x weight_decay ({self.lr} x {self.weight_decay}) must be below 1: AdamW "
                "scales every weight by 1 - lr x weight_decay each step; lower either"
            )
        return self


@dataclass(frozen=True)
class ScheduleRule:
    """What a pipeline schedule needs of a layout (mirrors torch.distributed.pipelining)."""

    placement: Literal["loop", "v"]  # stage i on pipeline rank i % P, or V-shaped (0..P-1, P-1..0)
    min_virtual: int = 1  # stages per rank
    max_virtual: int | None = None
    microbatches: Literal["any", "at_least_stages", "multiple_of_rounds"] = "any"
    about: str = ""


SCHEDULES: dict[str, ScheduleRule] = {
    "gpipe": ScheduleRule("loop", 1, 1, about="all forwards, then all backwards"),
    "1f1b": ScheduleRule(
        "loop", 1, 1, "at_least_stages", "PipeDream-Flush: one forward, one backward"
    ),
    "interleaved-1f1b": ScheduleRule(
        "loop", 2, None, "multiple_of_rounds", "1F1B over several stages per rank"
    ),
    "looped-bfs": ScheduleRule("loop", 2, None, about="breadth-first over several stages per rank"),
    "interleaved-zb": ScheduleRule(
        "loop", 2, None, "multiple_of_rounds", "zero-bubble: weight gradients fill the bubbles"
    ),
    "zbv": ScheduleRule("v", 2, 2, about="zero-bubble with two V-placed stages per rank"),
    "dualpipev": ScheduleRule(
        "v", 2, 2, "at_least_stages", "DualPipe with two V-placed stages per rank"
    ),
}


def schedule_problem(schedule: str, ranks: int, virtual: int, microbatches: int) -> str | None:
    """Why `schedule` cannot run `virtual` stages on each of `ranks` pipeline ranks with
    `microbatches` micro-batches, or None if it can."""
    rule = SCHEDULES[schedule]
    if virtual < rule.min_virtual or (rule.max_virtual and virtual > rule.max_virtual):
        want = (
            f"exactly {rule.min_virtual}"
            if rule.min_virtual == rule.max_virtual
            else f"at least {rule.min_virtual}"
        )
        return (
            f"schedule {schedule!r} ({rule.about}) needs {want} stage(s) per rank; "
            f"set parallel.virtual_stages accordingly (got {virtual})"
        )
    stages = ranks * virtual
    if rule.microbatches == "at_least_stages" and microbatches < stages:
        return (
            f"schedule {schedule!r} needs at least as many micro-batches as stages "
            f"({stages}); got parallel.microbatches={microbatches}"
        )
    if rule.microbatches == "multiple_of_rounds":
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            return (
                f"schedule {schedule!r} needs parallel.microbatches to be a multiple of its "
                f"rounds (microbatches // stages-ranks = {rounds}); got {microbatches}"
            )
    return None


class ParallelSpec(_Strict):
    """`stages` pipeline ranks x `replicas` data-parallel replicas; each rank runs
    `virtual_stages` model chunks (interleaved and zero-bubble schedules need 2 or more)."""

    stages: Annotated[PositiveInt, Field(le=MAX_STAGES)] = 2
    replicas: Annotated[PositiveInt, Field(le=MAX_REPLICAS)] = 1
    microbatches: Annotated[PositiveInt, Field(le=MAX_MICROBATCHES)] | Literal["auto"] = Field(
        4, description="micro-batches per replica step, or 'auto' to choose from measurement"
    )
    schedule: Annotated[str, Field(max_length=MAX_NAME)] = "gpipe"
    virtual_stages: Annotated[PositiveInt, Field(le=MAX_VIRTUAL_STAGES)] = 1
    partition: Literal["uniform", "autopipe"] = Field(
        "uniform",
        description="'uniform' splits blocks evenly; 'autopipe' measures the model on the "
        "device and balances measured compute, transfers and memory",
    )
    recompute: bool | list[bool] = Field(
        False, description="activation recomputation, for all stages or per stage"
    )
    compile: bool = Field(
        False,
        description="torch.compile each transformer block (in place: parameter names, hence "
        "checkpoints, are unchanged); the first steps after a start or re-layout pay for "
        "compilation",
    )

    @model_validator(mode="after")
    def _known(self) -> ParallelSpec:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule {self.schedule!r} is not supported; choose one of {', '.join(SCHEDULES)}"
            )
        if self.num_stages > MAX_STAGES:
            raise ValueError(
                f"stages x virtual_stages ({self.stages} x {self.virtual_stages}) must be at "
                f"most {MAX_STAGES} pipeline stages per replica"
            )
        measured = self.partition == "autopipe" or self.microbatches == "auto"
        if measured and self.virtual_stages > 1:
            raise ValueError(
                "partition 'autopipe' and microbatches 'auto' plan one stage per rank: use "
                "virtual_stages 1 (schedules gpipe or 1f1b), or a fixed partition and count"
            )
        if self.microbatches != "auto":
            problem = schedule_problem(
                self.schedule, self.stages, self.virtual_stages, self.microbatches
            )
            if problem:
                raise ValueError(problem)
        if isinstance(self.recompute, list) and len(self.recompute) != self.num_stages:
            raise ValueError(
                f"recompute lists one flag per stage: {self.num_stages} needed "
                f"(stages x virtual_stages), got {len(self.recompute)}"
            )
        return self

    @property
    def num_stages(self) -> int:
        """Pipeline stages (model chunks) in one replica."""
        return self.stages * self.virtual_stages

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def recompute_for(self, stage: int) -> bool:
        return self.recompute[stage] if isinstance(self.recompute, list) else self.recompute

    @property
    def recomputes_any(self) -> bool:
        """Whether any stage recomputes activations (the planner's memory model is per job)."""
        return any(self.recompute_for(i) for i in range(self.num_stages))


class CheckpointSpec(_Strict):
    """When checkpoints are taken and how they are written (trainer/checkpoint.py).

    A periodic checkpoint is due as soon as ANY configured interval has elapsed since the last
    checkpoint (of whatever reason): the end of every `every_epochs`-th epoch, `every_steps`
    optimizer steps, or `every_seconds` of wall time (rank 0's clock, looked at on the
    control-key cadence, runtime.control_every_steps, and at epoch ends, so that every rank
    takes the same decision). `null` switches an interval off; at least one must be set.
    Checkpoints are also always taken before a re-layout, at stop and at the end; those are
    complete before training proceeds. With `async_save` the state is snapshotted in memory and
    training continues while the shards persist; the checkpoint is reported for commit once every
    shard is durable."""

    every_epochs: Annotated[PositiveInt, Field(le=MAX_EPOCHS)] | None = Field(
        1, description="checkpoint at the end of every this-many epochs (null: not by epoch)"
    )
    every_steps: Annotated[PositiveInt, Field(le=MAX_STEPS)] | None = Field(
        None, description="checkpoint once this many optimizer steps passed since the last one"
    )
    every_seconds: Annotated[Number, Field(gt=0, le=MAX_CHECKPOINT_SECONDS)] | None = Field(
        None, description="checkpoint once this many seconds passed since the last one"
    )
    async_save: bool = Field(
        True,
        description="write shards in the background while training continues (false: training "
        "waits for each checkpoint to be written)",
    )
    keep: Annotated[PositiveInt, Field(le=MAX_KEEP)] = Field(
        3, description="committed checkpoints kept on disk"
    )

    @field_validator("every_epochs", "every_steps", "every_seconds", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        # YAML `true` would otherwise pass as the interval 1
        if isinstance(value, bool):
            raise ValueError("must be a positive number or null, not a boolean")
        return value

    @model_validator(mode="after")
    def _some_interval(self) -> CheckpointSpec:
        if (self.every_epochs, self.every_steps, self.every_seconds) == (None, None, None):
            raise ValueError(
                "set at least one of checkpoint.every_epochs, checkpoint.every_steps or "
                "checkpoint.every_seconds (periodic checkpoints bound the work lost on failure)"
            )
        return self
