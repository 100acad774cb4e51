"""`JobSpec`: the whole spec, its cross-section checks, and reading it from YAML."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

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

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _NAME_RE.match(name):
            raise ValueError(
                "must be 1-40 lowercase letters, digits or '-', starting and ending with a "
                "letter or digit"
            )
        return name

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if problems := consistency_problems(self):
            # one error carrying every problem; parse_spec splits it back into fields
            raise ValueError(_JOINED + "\n".join(f"{f}\t{m}" for f, m in problems))
        return self

    def to_json(self) -> str:
        return self.model_dump_json()


_JOINED = "problems:\n"  # how _consistent hands several (field, message) pairs to _problems


def consistency_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """What the sections of a spec that are each valid contradict in one another: (the field
    to change, why), every one of them."""
    out: list[tuple[str, str]] = []
    model, p, t, fz, rt = spec.model, spec.parallel, spec.training, spec.freeze, spec.runtime
    if problem := spec.data.model_problem(model):
        out.append(("data", problem))
    if t.target_perplexity is not None and not task_of(model).targets_per_token:
        out.append((
            "training.target_perplexity",
            f"training.target_perplexity is for model.task 'causal-lm' (got {model.task!r}); "
            "use training.target_accuracy",
        ))  # fmt: skip
    # the depth checks wait until a pending checkpoint has filled in the model
    if not model.pending and p.num_stages > model.depth:
        out.append((
            "parallel.stages",
            f"parallel.stages x parallel.virtual_stages ({p.stages} x {p.virtual_stages}) "
            f"exceeds model.depth ({model.depth}): each stage needs at least one block; lower "
            "stages or raise depth",
        ))  # fmt: skip
    if not model.pending and fz.policy != "off" and fz.keep_trainable >= model.depth:
        out.append((
            "freeze.keep_trainable",
            f"freeze.keep_trainable ({fz.keep_trainable}) must be less than model.depth "
            f"({model.depth}) when freeze.policy is {fz.policy!r}: at least one block must be "
            "freezable; lower freeze.keep_trainable or raise model.depth",
        ))  # fmt: skip
    if fz.relayout == "repartition" and fz.keep_trainable < p.num_stages:
        # checked whatever the policy: manual overrides freeze up to keep_trainable too
        out.append((
            "freeze.keep_trainable",
            f"freeze.keep_trainable ({fz.keep_trainable}) must be at least parallel.stages x "
            f"parallel.virtual_stages ({p.stages} x {p.virtual_stages} = {p.num_stages}) with "
            "freeze.relayout 'repartition': it keeps every stage, and each needs a trainable "
            "block after freezing; raise freeze.keep_trainable, lower parallel.stages or use "
            "freeze.relayout 'elastic'",
        ))  # fmt: skip
    beyond = [
        u
        for u in spec.init.skip
        if u.startswith("blocks.") and not model.pending and int(u[7:]) >= model.depth
    ]
    if beyond:
        out.append((
            "init.skip",
            f"init.skip names {', '.join(beyond)}, beyond the model's blocks (blocks.0 .. "
            f"blocks.{model.depth - 1})",
        ))  # fmt: skip
    if rt.min_nodes is not None and rt.min_nodes > rt.nodes:
        out.append((
            "runtime.min_nodes",
            f"runtime.min_nodes ({rt.min_nodes}) exceeds runtime.nodes ({rt.nodes}); lower "
            "min_nodes or raise nodes",
        ))  # fmt: skip
    if p.world_size % rt.nodes:
        out.append((
            "runtime.nodes",
            f"runtime.nodes ({rt.nodes}) must divide the workers of the layout (parallel.stages "
            f"x parallel.replicas = {p.world_size}): every node runs the same number of "
            "processes",
        ))  # fmt: skip
    per_step = p.replicas * (1 if p.microbatches == "auto" else p.microbatches)
    if t.global_batch_size % per_step:
        out.append((
            "training.global_batch_size",
            f"training.global_batch_size ({t.global_batch_size}) must be a multiple of "
            f"parallel.replicas x parallel.microbatches ({per_step})",
        ))  # fmt: skip
    return out


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
        if msg.startswith(_JOINED):  # JobSpec._consistent's problems, each with its field
            out += [tuple(line.split("\t", 1)) for line in msg.removeprefix(_JOINED).splitlines()]
            continue
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
        problems = _problems(err)
        failed = [".".join(str(p) for p in e["loc"]) for e in err.errors() if e["loc"]]
    # the sections' contradictions too, at once: checked again with each field in error left at
    # its default, keeping those that do not name such a field (a default may contradict)
    try:
        JobSpec.model_validate(_without(data, failed))
    except ValidationError as again:
        problems += [
            (f, m)
            for f, m in _problems(again)
            if (f, m) not in problems and not any(bad in m or bad == f for bad in failed)
        ]
    raise SpecError(problems, source) from None


def _without(data: dict, fields: list[str]) -> dict:
    """`data` (a spec mapping) without the values at the dotted `fields`; a required `name` is
    kept as a placeholder, so that the rest can be checked."""
    out = copy.deepcopy(data)
    for field in fields:
        *path, leaf = field.split(".")
        node: Any = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    if not isinstance(out.get("name"), str) or "name" in fields:
        out["name"] = "placeholder"
    return out


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
