"""Who gives which unit to whom when a re-layout happens in the running processes (the same
ranks before and after: freezing moved the boundary, no process was lost).

Each rank holds whole partition units (`embed`, `blocks.<i>`, `head`; `held_units`); a layout
says which. A unit a rank holds under both layouts stays where it is (a *keep*); one it gains
comes from a rank that held it under the old layout (a *move*), chosen among the old holders
so that the sends spread over them (replicas hold the same units). Optimizer state travels with
a unit only where the unit still trains under the new boundary (`trains`); a newly frozen
unit moves its weights alone. Pure: the trainer carries the moves out (`trainer.handover`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipetransformer.core.state import Layout, StageLayout


def held_units(stages: Sequence[StageLayout], depth: int) -> list[str]:
    """The units a rank running `stages` (its stages, in pipeline order) holds: its stages'
    blocks; where it runs stage 0, the embedding and the blocks before stage 0 (the frozen
    prefix it runs forward-only outside the pipeline); where it runs the last stage, the head."""
    owns_first = stages[0].index == 0
    blocks = {i for s in stages for i in range(s.start, s.end)}
    if owns_first:
        blocks |= set(range(stages[0].start))
    units = ["embed"] if owns_first else []
    units += [f"blocks.{i}" for i in sorted(blocks)]
    if any(s.end == depth for s in stages):
        units.append("head")
    return units


def rank_units(layout: Layout, rank: int) -> list[str]:
    """The units `rank` holds under `layout`."""
    return held_units([s for s, _ in layout.placements(rank)], layout.num_blocks)


def trains(unit: str, boundary: int) -> bool:
    """Whether `unit` trains (has optimizer state) under freeze boundary `boundary`: the head
    always, a block from the boundary on, the embedding only while nothing is frozen."""
    if unit == "head":
        return True
    if unit == "embed":
        return boundary == 0
    return int(unit.removeprefix("blocks.")) >= boundary


@dataclass(frozen=True, order=True)
class Move:
    """`unit` goes from rank `src` to rank `dst`, with its optimizer state when `optimizer`."""

    src: int
    dst: int
    unit: str
    optimizer: bool


@dataclass(frozen=True)
class Handover:
    """What every rank keeps and what moves between ranks, from layout `old` to `new`."""

    old: Layout
    new: Layout
    keeps: dict[int, tuple[str, ...]]  # rank -> units it holds under both layouts
    moves: tuple[Move, ...]  # sorted by (src, dst, unit): both ends enumerate them alike

    def sends(self, rank: int) -> list[Move]:
        return [m for m in self.moves if m.src == rank]

    def receives(self, rank: int) -> list[Move]:
        return [m for m in self.moves if m.dst == rank]

    def with_optimizer(self, unit: str) -> bool:
        """Whether `unit`'s optimizer state comes along (it still trains under the new layout)."""
        return trains(unit, self.new.freeze_boundary)


def plan_handover(old: Layout, new: Layout) -> Handover:
    """The keeps and moves that take every rank from its units under `old` to its units under
    `new`. Both layouts span the same ranks and model, and the boundary never moves back (a
    unit that trains under `new` trained under `old`, so its optimizer state exists)."""
    if new.world_size != old.world_size:
        raise ValueError(
            f"an in-memory re-layout keeps the ranks: {old.world_size} ranks before, "
            f"{new.world_size} after"
        )
    if new.num_blocks != old.num_blocks:
        raise ValueError(f"the model has {old.num_blocks} blocks, the new layout {new.num_blocks}")
    if new.freeze_boundary < old.freeze_boundary:
        raise ValueError(
            f"the freeze boundary moves back ({old.freeze_boundary} -> {new.freeze_boundary})"
        )
    world = old.world_size
    before = {r: set(rank_units(old, r)) for r in range(world)}
    holders: dict[str, list[int]] = {}
    for r in range(world):
        for unit in before[r]:
            holders.setdefault(unit, []).append(r)
    keeps: dict[int, tuple[str, ...]] = {}
    moves: list[Move] = []
    load = dict.fromkeys(range(world), 0)  # units each rank sends so far
    for dst in range(world):
        wanted = rank_units(new, dst)
        keeps[dst] = tuple(u for u in wanted if u in before[dst])
        for unit in wanted:
            if unit in before[dst]:
                continue
            # the old holder with the fewest sends so far (the lowest rank on a tie)
            src = min(holders[unit], key=lambda r: (load[r], r))
            load[src] += 1
            moves.append(Move(src, dst, unit, trains(unit, new.freeze_boundary)))
    return Handover(old, new, keeps, tuple(sorted(moves)))
