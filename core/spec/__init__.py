"""The job spec: what a user submits.

Everything a job needs is in one validated `JobSpec`; anything unknown or out of range is rejected
before a process starts, with an error that names the field and what it allows. Every number is
bounded (finite floats, integers below what makes sense, seeds in the generators' range), the
file is read as bounded UTF-8 text and parsed by a YAML loader that refuses duplicate keys and
alias bombs (`load_spec`). What a valid spec needs of a machine is `orchestrator/admission.py`.

One module per section: `model` (and its `adapters`), `data`, `parallel` (training, parallel,
checkpoint), `runtime`, `freeze` (freeze, init), `job` (the whole spec and reading it), over
`base` (bounds, the strict model base, `SpecError`). Everything is imported from here."""

from pipetransformer.core.spec.adapters import AdaptersSpec
from pipetransformer.core.spec.base import MAX_CONTROL_EVERY, SpecError
from pipetransformer.core.spec.data import ColumnsSpec, DataSpec
from pipetransformer.core.spec.freeze import FreezeSpec, InitSpec
from pipetransformer.core.spec.job import JobSpec, load_spec, parse_spec, spec_from_text
from pipetransformer.core.spec.model import ModelSpec, PretrainedSpec
from pipetransformer.core.spec.parallel import (
    SCHEDULES,
    CheckpointSpec,
    ParallelSpec,
    ScheduleRule,
    TrainingSpec,
    schedule_problem,
)
from pipetransformer.core.spec.runtime import RuntimeSpec, gpu_shortfall, local_device_type

__all__ = [
    "MAX_CONTROL_EVERY",
    "SCHEDULES",
    "AdaptersSpec",
    "CheckpointSpec",
    "ColumnsSpec",
    "DataSpec",
    "FreezeSpec",
    "InitSpec",
    "JobSpec",
    "ModelSpec",
    "ParallelSpec",
    "PretrainedSpec",
    "RuntimeSpec",
    "ScheduleRule",
    "SpecError",
    "TrainingSpec",
    "gpu_shortfall",
    "load_spec",
    "local_device_type",
    "parse_spec",
    "schedule_problem",
    "spec_from_text",
]
