"""The job spec: what a user submits.

Everything a job needs is in one validated `JobSpec`; anything unknown or out of range is rejected
before a process starts, with an error that names the field and what it allows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DATASETS = ("digits", "synthetic")
SCHEDULES = ("gpipe",)  # more schedules arrive with the pipeline-engine issue
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


class SpecError(ValueError):
    """A job spec failed validation. `problems` holds one (field, message) pair per problem."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"invalid job spec{where}:"] + [f"  {field}: {msg}" for field, msg in problems]
        super().__init__("\n".join(lines))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PositiveInt = Annotated[int, Field(gt=0)]


class ModelSpec(_Strict):
    """A ViT over small images. Its transformer blocks (`blocks.<i>`) are the partition units."""

    family: Literal["vit"] = "vit"
    image_size: PositiveInt = 8
    patch_size: PositiveInt = 2
    channels: PositiveInt = 1
    dim: PositiveInt = 64
    depth: PositiveInt = Field(6, description="number of transformer blocks")
    heads: PositiveInt = 4
    mlp_ratio: Annotated[float, Field(gt=0)] = 2.0
    num_classes: PositiveInt = 10
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0

    @model_validator(mode="after")
    def _shapes(self) -> ModelSpec:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size ({self.patch_size}) must divide image_size ({self.image_size})"
            )
        if self.dim % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide dim ({self.dim})")
        return self


class DataSpec(_Strict):
    """`digits`: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).
    `synthetic`: seeded random images/labels of the model's shape, for benchmarks."""

    dataset: str = "digits"
    test_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2
    synthetic_samples: PositiveInt = 2048
    seed: int = 0

    @model_validator(mode="after")
    def _known(self) -> DataSpec:
        if self.dataset not in DATASETS:
            raise ValueError(
                f"dataset {self.dataset!r} is not available; choose one of {', '.join(DATASETS)}"
            )
        return self


class TrainingSpec(_Strict):
    epochs: PositiveInt = 20
    global_batch_size: PositiveInt = Field(
        64, description="samples per optimizer step, summed over replicas and micro-batches"
    )
    lr: Annotated[float, Field(gt=0)] = 3e-3
    weight_decay: Annotated[float, Field(ge=0)] = 0.05
    warmup_steps: Annotated[int, Field(ge=0)] = 20
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.05
    grad_clip: Annotated[float, Field(ge=0)] = 1.0
    seed: int = 0
    max_steps: PositiveInt | None = Field(
        None, description="stop after this many optimizer steps (for smoke tests)"
    )
    target_accuracy: Annotated[float, Field(gt=0, le=1)] | None = Field(
        None, description="stop once held-out accuracy reaches this fraction"
    )


class ParallelSpec(_Strict):
    stages: PositiveInt = 2
    replicas: PositiveInt = 1
    microbatches: PositiveInt = 4
    schedule: str = "gpipe"

    @model_validator(mode="after")
    def _known(self) -> ParallelSpec:
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule {self.schedule!r} is not supported; choose one of {', '.join(SCHEDULES)}"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas


class CheckpointSpec(_Strict):
    every_epochs: PositiveInt = 1
    keep: PositiveInt = Field(3, description="committed checkpoints kept on disk")


class RuntimeSpec(_Strict):
    threads_per_worker: PositiveInt = 1
    control_every_steps: PositiveInt = Field(
        10, description="steps between reads of the etcd control key (abort/stop)"
    )
    lease_ttl_s: PositiveInt = 5


class JobSpec(_Strict):
    name: str = Field(..., description="lowercase letters, digits and '-', at most 40 characters")
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    training: TrainingSpec = TrainingSpec()
    parallel: ParallelSpec = ParallelSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    runtime: RuntimeSpec = RuntimeSpec()

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if not _NAME_RE.match(self.name):
            raise ValueError(
                f"name {self.name!r} must be 1-40 lowercase letters, digits or '-', "
                "starting and ending with a letter or digit"
            )
        p, t = self.parallel, self.training
        if p.stages > self.model.depth:
            raise ValueError(
                f"parallel.stages ({p.stages}) exceeds model.depth ({self.model.depth}): "
                "each stage needs at least one block; lower stages or raise depth"
            )
        per_step = p.replicas * p.microbatches
        if t.global_batch_size % per_step:
            raise ValueError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"parallel.replicas x parallel.microbatches ({p.replicas} x {p.microbatches} = {per_step})"
            )
        return self

    def to_json(self) -> str:
        return self.model_dump_json()


def _problems(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<spec>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        out.append((field, msg))
    return out


def parse_spec(data: Any, source: str | None = None) -> JobSpec:
    """Validate a mapping into a JobSpec, raising SpecError with every problem found."""
    if not isinstance(data, dict):
        raise SpecError([("<spec>", "must be a mapping of fields to values")], source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(_problems(err), source) from None


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML (or JSON) job spec file."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([("<file>", f"no such file: {path}")], str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError([("<file>", f"not valid YAML: {exc}")], str(path)) from None
    return parse_spec(data, str(path))
