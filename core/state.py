"""The data models every part shares (as JSON): the layout a job trains under and where its
training is. The messages that carry them between workers and the controller are in
`core.protocol`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator


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
        # Frozen blocks may leave the pipeline (run forward-only before stage 0) or stay frozen
        # in their stages (freeze.relayout 'off'), so the first stage starts at the freeze
        # boundary or at block 0; after that, ranges are contiguous.
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
    # the freeze boundary is not here: the layout it continues under owns it
    layout_version: int = 1
    checkpoint: str | None = None  # path of the last committed checkpoint
