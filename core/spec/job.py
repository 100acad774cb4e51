"""`JobSpec`: the whole spec, its cross-section checks, and reading it from YAML."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import (
    Field,
    ValidationError,
    model_validator,
)

from pipetransformer.core.spec.base import SpecError, _Strict
from pipetransformer.core.spec.data import DataSpec
from pipetransformer.core.spec.freeze import FreezeSpec, InitSpec
from pipetransformer.core.spec.model import ModelSpec
from pipetransformer.core.spec.parallel import CheckpointSpec, ParallelSpec, TrainingSpec
from pipetransformer.core.spec.runtime import RuntimeSpec
from pipetransformer.core.specfile import MAX_BYTES, SpecFileError, parse_yaml, read_spec_file
from pipetransformer.core.tasks import task_of

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


class JobSpec(_Strict):
    name: str = Field(
        ..., max_length=40, description="lowercase letters, digits and '-', at most 40 characters"
    )
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    training: TrainingSpec = TrainingSpec()
    parallel: ParallelSpec = ParallelSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    runtime: RuntimeSpec = RuntimeSpec()
    freeze: FreezeSpec = FreezeSpec()
    init: InitSpec = InitSpec()

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if not _NAME_RE.match(self.name):
            raise ValueError(
                f"name {self.name!r} must be 1-40 lowercase letters, digits or '-', "
                "starting and ending with a letter or digit"
            )
        if problem := self.data.model_problem(self.model):
            raise ValueError(problem)
        p, t = self.parallel, self.training
        if t.target_perplexity is not None and not task_of(self.model).targets_per_token:
            raise ValueError(
                f"training.target_perplexity is for model.task 'causal-lm' (got "
                f"{self.model.task!r}); use training.target_accuracy"
            )
        if self.model.pending:
            pass  # the depth checks below wait until the checkpoint has filled in the model
        elif p.num_stages > self.model.depth:
            raise ValueError(
                f"parallel.stages x parallel.virtual_stages ({p.stages} x {p.virtual_stages}) "
                f"exceeds model.depth ({self.model.depth}): each stage needs at least one block; "
                "lower stages or raise depth"
            )
        fz = self.freeze
        if self.model.pending:
            pass
        elif fz.policy != "off" and fz.keep_trainable >= self.model.depth:
            raise ValueError(
                f"freeze.keep_trainable ({fz.keep_trainable}) must be less than model.depth "
                f"({self.model.depth}) when freeze.policy is {fz.policy!r}: at least one block "
                "must be freezable; lower freeze.keep_trainable or raise model.depth"
            )
        if fz.relayout == "repartition" and fz.keep_trainable < p.num_stages:
            # checked whatever the policy: manual overrides freeze up to keep_trainable too
            raise ValueError(
                f"freeze.keep_trainable ({fz.keep_trainable}) must be at least parallel.stages "
                f"x parallel.virtual_stages ({p.stages} x {p.virtual_stages} = {p.num_stages}) "
                "with freeze.relayout 'repartition': it keeps every stage, and each needs a "
                "trainable block after freezing; raise freeze.keep_trainable, lower "
                "parallel.stages or use freeze.relayout 'elastic'"
            )
        beyond = [
            u
            for u in self.init.skip
            if u.startswith("blocks.") and int(u[7:]) >= self.model.depth and not self.model.pending
        ]
        if beyond:
            raise ValueError(
                f"init.skip names {', '.join(beyond)}, beyond the model's blocks "
                f"(blocks.0 .. blocks.{self.model.depth - 1})"
            )
        rt = self.runtime
        if rt.min_nodes is not None and rt.min_nodes > rt.nodes:
            raise ValueError(
                f"runtime.min_nodes ({rt.min_nodes}) exceeds runtime.nodes ({rt.nodes}); "
                "lower min_nodes or raise nodes"
            )
        world = p.world_size
        if world % rt.nodes:
            raise ValueError(
                f"runtime.nodes ({rt.nodes}) must divide the workers of the layout "
                f"(parallel.stages x parallel.replicas = {world}): every node runs the same "
                "number of processes"
            )
        per_step = p.replicas * (1 if p.microbatches == "auto" else p.microbatches)
        if t.global_batch_size % per_step:
            raise ValueError(
                f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"parallel.replicas x parallel.microbatches ({per_step})"
            )
        return self

    def to_json(self) -> str:
        return self.model_dump_json()


def _shown(value: Any, limit: int = 80) -> str:
    """`value` as the error message quotes it: its repr, cut to `limit` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr (Python caps int <-> str at 4300 digits)
        text = f"<a {type(value).__name__} too long to show>"
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} chars)"


def _problems(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<spec>"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling"
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
            msg = f"{msg} (got {_shown(e['input'])})"
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


def spec_from_text(text: str, source: str) -> JobSpec:
    """Validate a spec's YAML text that did not come from a file (an environment variable, where
    a container receives it); the same bounds and checks as `load_spec`."""
    if len(text.encode()) > MAX_BYTES:
        raise SpecError([("<file>", f"larger than {MAX_BYTES // 1024} KiB")], source)
    try:
        data = parse_yaml(text, source)
    except SpecFileError as exc:
        raise SpecError([("<file>", str(exc))], source) from None
    return parse_spec(data, source)


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML (or JSON) job spec file. A file that is not a bounded, UTF-8,
    well-formed YAML document without duplicate keys or alias bombs is refused as `<file>`
    (core/specfile.py says what is refused and why)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([("<file>", f"no such file: {path}")], str(path))
    try:
        data = read_spec_file(path)
    except SpecFileError as exc:
        raise SpecError([("<file>", str(exc))], str(path)) from None
    return parse_spec(data, str(path))
