"""Models that cross process boundaries (as JSON): the layout, the training state and the events
workers report to the controller."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageLayout(_Model):
    """One pipeline stage: transformer blocks [start, end) plus the embedding (first stage) and
    the head (last stage); `ranks[r]` is the global rank that runs this stage for replica r."""

    index: int
    start: int
    end: int
    ranks: list[int]

    @property
    def num_blocks(self) -> int:
        return self.end - self.start


def pipeline_position(stage: int, ranks: int, num_stages: int, placement: str = "loop") -> int:
    """Which of a replica's `ranks` pipeline ranks runs `stage`: round-robin ("loop", as for
    interleaved schedules) or V-shaped ("v": 0..P-1 then P-1..0, as ZBV and DualPipeV expect)."""
    if placement == "v":
        return stage if stage < ranks else num_stages - 1 - stage
    return stage % ranks


class Layout(_Model):
    """Stages (contiguous block ranges, in pipeline order) and the rank running each stage in
    each replica. A rank may run several stages (`virtual_stages`), as interleaved and
    zero-bubble schedules need; with R replicas of P ranks, rank = replica * P + position."""

    version: int = 1
    num_blocks: int
    freeze_boundary: int = 0
    stages: list[StageLayout]
    replicas: int = 1
    microbatches: int
    schedule: str = "gpipe"
    virtual_stages: int = 1
    planner: Literal["uniform", "autopipe"] = "uniform"  # autopipe: planned from measurement

    @classmethod
    def build(
        cls,
        ranges: list[tuple[int, int]],
        *,
        num_blocks: int,
        replicas: int,
        microbatches: int,
        schedule: str = "gpipe",
        virtual_stages: int = 1,
        placement: str = "loop",
        **extra: Any,
    ) -> Layout:
        """A layout from stage block ranges, placing stages on ranks as `placement` says."""
        if len(ranges) % virtual_stages:
            raise ValueError(f"{len(ranges)} stages do not split into {virtual_stages} per rank")
        p = len(ranges) // virtual_stages
        stages = [
            StageLayout(
                index=i,
                start=a,
                end=b,
                ranks=[
                    r * p + pipeline_position(i, p, len(ranges), placement) for r in range(replicas)
                ],
            )
            for i, (a, b) in enumerate(ranges)
        ]
        return cls(
            num_blocks=num_blocks,
            stages=stages,
            replicas=replicas,
            microbatches=microbatches,
            schedule=schedule,
            virtual_stages=virtual_stages,
            **extra,
        )

    @model_validator(mode="after")
    def _contiguous(self) -> Layout:
        if not self.stages:
            raise ValueError("a layout needs at least one stage")
        # Frozen blocks may leave the pipeline (run forward-only before stage 0), so the first
        # stage starts at block 0 or at the freeze boundary; after that, ranges are contiguous.
        if self.stages[0].start not in (0, self.freeze_boundary):
            raise ValueError(
                f"stage 0 starts at block {self.stages[0].start}; expected 0 or the freeze "
                f"boundary {self.freeze_boundary}"
            )
        pos = self.stages[0].start
        for s in self.stages:
            if s.start != pos or s.end <= s.start:
                raise ValueError(
                    f"stage {s.index} covers [{s.start}, {s.end}); expected start {pos}"
                )
            if len(s.ranks) != self.replicas:
                raise ValueError(
                    f"stage {s.index} has {len(s.ranks)} ranks, expected {self.replicas}"
                )
            pos = s.end
        if pos != self.num_blocks:
            raise ValueError(f"stages end at block {pos}, model has {self.num_blocks}")
        if len(self.stages) % self.virtual_stages:
            raise ValueError(
                f"{len(self.stages)} stages do not split into {self.virtual_stages} per rank"
            )
        per_rank: dict[int, int] = {}
        for s in self.stages:
            for r in s.ranks:
                per_rank[r] = per_rank.get(r, 0) + 1
        if set(per_rank.values()) != {self.virtual_stages}:
            raise ValueError(f"every rank must run exactly {self.virtual_stages} stage(s)")
        if sorted(per_rank) != list(range(len(per_rank))):
            raise ValueError(f"ranks must be 0..N-1, got {sorted(per_rank)}")
        return self

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def pipeline_ranks(self) -> int:
        """Ranks in one replica's pipeline."""
        return self.num_stages // self.virtual_stages

    @property
    def world_size(self) -> int:
        return self.pipeline_ranks * self.replicas

    def placements(self, rank: int) -> list[tuple[StageLayout, int]]:
        """The stages (in pipeline order) and the replica index that `rank` runs."""
        found = [(s, s.ranks.index(rank)) for s in self.stages if rank in s.ranks]
        if not found:
            raise KeyError(f"rank {rank} has no stage in layout v{self.version}")
        return found

    def placement(self, rank: int) -> tuple[StageLayout, int]:
        """The first stage and the replica index that `rank` runs."""
        return self.placements(rank)[0]

    @property
    def short(self) -> str:
        """Compact form for progress lines, e.g. `2x1 [0-2|3-5] F=0 v1`."""
        ranges = "|".join(f"{s.start}-{s.end - 1}" for s in self.stages)
        virtual = f" {self.schedule}/{self.virtual_stages}v" if self.virtual_stages > 1 else ""
        return (
            f"{self.pipeline_ranks}x{self.replicas} [{ranges}]{virtual} "
            f"F={self.freeze_boundary} v{self.version}"
        )

    def describe(self) -> str:
        parts = [
            f"S{s.index}[blocks {s.start}-{s.end - 1}]@ranks{','.join(map(str, s.ranks))}"
            for s in self.stages
        ]
        return (
            f"v{self.version} {self.pipeline_ranks}x{self.replicas} {self.schedule} "
            f"F={self.freeze_boundary} m={self.microbatches} " + " ".join(parts)
        )


class TrainingState(_Model):
    """Where a job is: enough to resume it from its last committed checkpoint."""

    epoch: int = 0
    step: int = 0
    samples_consumed: int = 0  # within `epoch`, relative to the committed model state
    lr: float = 0.0
    freeze_boundary: int = 0
    layout_version: int = 1
    checkpoint: str | None = None  # path of the last committed checkpoint


EventKind = Literal[
    "started",
    "metrics",
    "eval",
    "checkpoint",
    "checkpoint_failed",
    "layout",
    "freeze",
    "cache",
    "done",
    "failed",  # its own exception (data: error, phase "build" or "train")
    "peer_lost",  # a collective failed because a peer went away (data: error)
    "aborted",  # left because the controller aborted the generation
    "left",  # stopped by SIGTERM without finishing the graceful leave in time
    "stopped",
    "leaving",
    "first_step",
]


class WorkerEvent(_Model):
    """A report a worker puts in etcd; the controller (single SQL writer) records it."""

    kind: EventKind
    rank: int
    generation: int = 1
    time: float = Field(default_factory=time.time)
    data: dict[str, Any] = Field(default_factory=dict)


# Exit code of a worker that leaves its generation on purpose (aborted by the controller, a lost
# peer, or re-forming after a graceful SIGTERM): non-zero, so its torchrun agent restarts it into
# the next rendezvous round (EX_TEMPFAIL).
EXIT_REFORM = 75
# exit codes that are a decision, not a death: done, and leaving to re-form
_CLEAN_EXITS = (0, EXIT_REFORM)


def is_abnormal(exit_code: int | None, signum: int | None) -> bool:
    """Whether a worker's exit status is a failure: a signal, or a code other than 0 (done) and
    75 (leaving to re-form)."""
    return signum is not None or exit_code not in _CLEAN_EXITS


class WorkerExit(_Model):
    """How a worker process ended, as the process that reaped it (its node's fork server) saw
    it; put under `keys.exit_report` and drained by the controller, which matches it to a generation's
    rank by host and pid. `exit_code` is None when a signal killed it."""

    pid: int
    host: str
    rank: int | None = None  # RANK from torchrun, if it was set
    exit_code: int | None = None
    signal: int | None = None
    time: float = Field(default_factory=time.time)


class JoinRequest(_Model):
    """A rendezvous round's workers asking for their assignment (rank 0 files it under
    `keys.join`); the controller answers with an Assignment carrying the same `id`, and tells
    joined and departed nodes apart by `nodes`."""

    id: str
    world: int = Field(ge=1)
    # node of each rank, in rank order: "host:agent-pid" (one torchrun agent per node)
    nodes: list[str] = []
    pids: list[int] = []
    time: float = Field(default_factory=time.time)


class Assignment(_Model):
    """What the controller hands a generation of workers (published under `keys.assignment`).

    `request`: the JoinRequest this answers. `layout`: the layout the generation trains under
    (planned for its world size). `waiting`: set when no layout fits the workers that joined:
    they hold on (keeping their leases) until a node joins and the agents re-rendezvous."""

    generation: int
    checkpoint_dir: str
    # the job failed for good (every rank of the last generation failed the same way while
    # starting): workers that see it leave with exit code 0, so their agents stop restarting
    fatal: str | None = None
    start: TrainingState = TrainingState()
    # a committed checkpoint to load before training, with the checksum it was committed under
    resume_checksum: str | None = None
    request: str | None = None
    layout: Layout | None = None
    waiting: str | None = None


def parse_freeze_request(raw: str) -> dict[str, Any]:
    """A manual freeze request as filed under `keys.freeze_override` (id, layers, who, reason,
    time). Whoever reads it must not crash on a malformed one: text that is not a JSON object
    comes back as `{"raw": <its first 200 characters>}`, which has no `layers` and is rejected."""
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"raw": raw[:200]}
