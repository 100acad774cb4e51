"""What every section of the spec shares: the strict model base, the error a refused spec raises,
bounded number types and the bounds themselves (a value past one of these is a typo or a unit
mistake, not a plan)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
)

MAX_LOADER_WORKERS = 64


class SpecError(ValueError):
    """A job spec failed validation. `problems` holds one (field, message) pair per problem."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"invalid job spec{where}:"] + [f"  {field}: {msg}" for field, msg in problems]
        super().__init__("\n".join(lines))


class _Strict(BaseModel):
    # allow_inf_nan=False: YAML's .inf/.nan (and 1e400, which overflows to inf) are never meant
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _not_bool(value: Any) -> Any:
    # pydantic's lax mode reads YAML `true` as 1: a flag where a number belongs is a mistake
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean (true/false)")
    return value


_NOT_BOOL = BeforeValidator(_not_bool)
PositiveInt = Annotated[int, _NOT_BOOL, Field(gt=0)]
NonNegativeInt = Annotated[int, _NOT_BOOL, Field(ge=0)]
Number = Annotated[float, _NOT_BOOL]

# Upper bounds. A value past one of these is a typo or a unit mistake, not a plan: each is
# generous for what this system trains, and orchestrator/admission.py refuses the combinations
# that fit no machine. Pydantic's message names the bound ("less than or equal to N").
MAX_DIM = 65_536  # model.dim: the widest published transformers are ~25k
MAX_DEPTH = 1_024  # model.depth: DeepNet trained 1000 blocks; the planner is O(depth^2 x stages)
MAX_HEADS = 1_024
MAX_MLP_RATIO = 64.0
MAX_IMAGE_SIZE = 4_096  # pixels per side
MAX_CHANNELS = 1_024  # hyperspectral images have a few hundred bands
MAX_VOCAB = 1 << 20  # the largest tokenizers have ~256k ids
MAX_SEQ_LEN = 65_536
MAX_CLASSES = 1 << 20  # extreme classification; ImageNet-21k has 21,843
# every worker generates the whole synthetic set at start-up (bert: ~6 us a sample, so 10M is
# a minute) and holds it in memory
MAX_SYNTHETIC_SAMPLES = 10_000_000
MAX_SEED = 2**32 - 1  # numpy's legacy seeding takes 0 .. 2**32-1; default_rng refuses negatives
MAX_EPOCHS = 100_000
MAX_STEPS = 100_000_000  # optimizer steps: a year at 3 steps/s
MAX_BATCH = 1 << 20  # samples per optimizer step
MAX_LR = 1.0  # AdamW moves every weight by about lr a step; initial weights are ~0.02
MAX_WEIGHT_DECAY = 10.0  # decoupled: each step scales weights by 1 - lr x weight_decay
MAX_GRAD_CLIP = 1e6  # a clip norm above this clips nothing; 0 switches clipping off
MAX_STAGES = 128  # pipeline stages in a replica: the planner's DP recurses once per stage
MAX_VIRTUAL_STAGES = 16
MAX_REPLICAS = 1_024
MAX_MICROBATCHES = 4_096
MAX_CHECKPOINT_SECONDS = 7 * 24 * 3600.0  # a week
MAX_KEEP = 1_000  # each committed checkpoint is a full copy of weights and optimizer state
MAX_THREADS = 256
MAX_CONTROL_EVERY = 10_000  # a stop request waits up to this many steps
MAX_LEASE_TTL_S = 3_600  # a hung worker is noticed only after this long
MAX_NODES = 1_024
MAX_RESTARTS = 1_000
MAX_WARMUP_DECISIONS = 100_000
MAX_NAME = 64  # free-text choices (dataset, schedule): the real ones are short
MAX_PATH = 4_096


Seed = Annotated[NonNegativeInt, Field(le=MAX_SEED)]
