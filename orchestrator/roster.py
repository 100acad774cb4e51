"""The controller's bookkeeping of the store's `workers` table: one row per rank of every
generation, kept current from the facts the controller already has.

    assignment (join request)    -> assigned: node, pid, host
    `started` report             -> running: host, pid, stages, replica, log, started_at
    a re-layout in the running   -> stages, replica: each rank's part in the layout in force
    processes (`layout_planned`)
    any report (one per drain)   -> last_report_at
    presence key seen / gone     -> lease held / lapsed
    a final report               -> lease released (the worker lets its lease go on its way out)
    the post-mortem's verdict    -> failed / died / lost / peer_lost / left / aborted, with the
                                    exit status and detail
    `done`/`stopped`, `leaving`  -> every rank of the generation not ended yet: done / stopped,
                                    left

The controller calls these every tick (leases) and for every report, so the roster keeps what it
last wrote in memory and writes only changes. A restarted controller loads the running
generation's rows back (`load`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipetransformer.core.postmortem import RankEnd
from pipetransformer.core.protocol import Finished, JoinRequest, Leaving, Started, WorkerEvent
from pipetransformer.core.state import Layout
from pipetransformer.store import Store

# the post-mortem's end kinds as worker states (it folds `aborted` into `left`: see `ended`)
_END_STATES = {
    "failed": "failed",
    "died": "died",
    "vanished": "lost",
    "peer_lost": "peer_lost",
    "left": "left",
}
_NOT_ENDED = ("assigned", "running")


class Roster:
    """Writes the `workers` rows of one job for its controller (the store's single writer)."""

    def __init__(self, store: Store, job_id: str) -> None:
        self.store, self.job_id = store, job_id
        # (generation, rank) -> the columns last written that later writes depend on
        self._rows: dict[tuple[int, int], dict[str, Any]] = {}

    # -- generations -----------------------------------------------------------------------

    def assign(self, generation: int, world: int, request: JoinRequest | None) -> None:
        """A generation's ranks, as its join request names them (ranks it does not name, e.g.
        a restarted controller without the request, are known by number only)."""
        nodes = request.nodes if request else []
        pids = request.pids if request else []
        members = []
        for rank in range(world):
            node = nodes[rank] if rank < len(nodes) else ""
            members.append(
                {
                    "rank": rank,
                    "node": node,
                    "pid": pids[rank] if rank < len(pids) else None,
                    # the node is "host:agent-pid": its host is the worker's too
                    "host": node.rsplit(":", 1)[0] if node else None,
                }
            )
        self.store.add_workers(self.job_id, generation, members)
        for rank in range(world):
            self._rows.setdefault((generation, rank), {"state": "assigned", "lease": "unknown"})

    def load(self, generation: int) -> None:
        """What the store holds for a generation (a restarted controller taking it over)."""
        for w in self.store.workers(self.job_id):
            if w.generation == generation:
                keep = ("state", "lease", "exit_code", "signal", "detail")
                self._rows[(generation, w.rank)] = {k: getattr(w, k) for k in keep}

    def _ranks(self, generation: int) -> list[int]:
        return sorted(r for g, r in self._rows if g == generation)

    def _set(self, generation: int, ranks: Iterable[int], **fields: Any) -> None:
        """Write `fields` for those `ranks` whose remembered values differ (one statement)."""
        changed = []
        for rank in ranks:
            row = self._rows.setdefault((generation, rank), {})
            if any(row.get(k, object()) != v for k, v in fields.items()):
                changed.append(rank)
                row.update(fields)
        if changed:
            self.store.update_workers(self.job_id, generation, changed, **fields)

    def _state(self, generation: int, rank: int) -> str | None:
        return self._rows.get((generation, rank), {}).get("state")

    # -- reports ---------------------------------------------------------------------------

    def reported(self, events: Iterable[WorkerEvent]) -> None:
        """One drain's reports: each rank's newest report time, in one statement."""
        newest: dict[tuple[int, int], float] = {}
        for e in events:
            key = (e.generation, e.rank)
            newest[key] = max(e.time, newest.get(key, e.time))
        if newest:
            self.store.touch_workers(self.job_id, newest)

    def started(self, e: Started) -> None:
        facts = {
            "host": e.host,
            "pid": e.pid,
            "stages": e.stages,
            "replica": e.replica,
            "log": e.log,
            "started_at": e.time,
        }
        # an end already recorded (its exit status drained before this report) stands
        if self._state(e.generation, e.rank) in (None, *_NOT_ENDED):
            facts["state"] = "running"
            self._rows.setdefault((e.generation, e.rank), {})["state"] = "running"
        self.store.update_workers(self.job_id, e.generation, [e.rank], **facts)

    def relaid(self, generation: int, layout: Layout) -> None:
        """The generation's processes re-laid themselves out (AutoPipe + AutoDP after a freeze):
        each rank's stages and replica become its part in `layout` (one statement per part)."""
        parts: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for rank in range(layout.world_size):
            placed = layout.placements(rank)
            key = (tuple(s.index for s, _ in placed), placed[0][1])
            parts.setdefault(key, []).append(rank)
        for (stages, replica), ranks in parts.items():
            self.store.update_workers(
                self.job_id, generation, ranks, stages=list(stages), replica=replica
            )

    def finished(self, e: Finished | Leaving) -> None:
        """The generation's training ended as asked (`done`/`stopped`), or it checkpointed so
        that `e.ranks` could leave: every rank not ended yet ends so and lets its lease go."""
        open_ = [r for r in self._ranks(e.generation) if self._state(e.generation, r) in _NOT_ENDED]
        if isinstance(e, Finished):
            self._set(e.generation, open_, state=e.kind, lease="released")
            return
        step = f"checkpointed at step {e.step}"
        for ranks, why in (
            ([r for r in open_ if r in e.ranks], f"asked to leave (SIGTERM); {step}"),
            ([r for r in open_ if r not in e.ranks], f"re-formed without {e.ranks}; {step}"),
        ):
            self._set(e.generation, ranks, state="left", lease="released", detail=why)

    def ended(
        self, generation: int, end: RankEnd, aborted: bool = False, own_word: bool = False
    ) -> None:
        """The post-mortem's verdict on a rank (or its exit status, learnt later). `aborted`: the
        verdict is the rank's own `aborted` report (the post-mortem records it as `left`).
        `own_word`: it came with the rank's own final report, so its lease was let go."""
        state = "aborted" if aborted else _END_STATES[end.kind]
        if state == "left" and self._state(generation, end.member.rank) == "aborted":
            state = "aborted"  # an exit status learnt after its `aborted` report
        fields: dict[str, Any] = {
            "state": state,
            "exit_code": end.exit_code,
            "signal": end.signal,
            "detail": end.detail,
        }
        if own_word:
            fields["lease"] = "released"
        self._set(generation, [end.member.rank], **fields)

    # -- leases ----------------------------------------------------------------------------

    def leases_held(self, generation: int, alive: Iterable[int]) -> None:
        """Ranks whose presence key holds this generation now: held, when first seen."""
        first = [r for r in alive if self._rows.get((generation, r), {}).get("lease") == "unknown"]
        self._set(generation, first, lease="held")

    def lease_gone(self, generation: int, rank: int) -> None:
        """A rank's presence key is gone (or taken by a later generation's rank): lapsed,
        unless the rank let it go with a final report."""
        if self._rows.get((generation, rank), {}).get("lease") not in ("released", "lapsed"):
            self._set(generation, [rank], lease="lapsed")
