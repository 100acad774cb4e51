"""The generations a controller knows of: which one is in force, and how each one ended.

A generation is a torchrun rendezvous round the controller answered, from the moment it opens
(`Controller.start_generation`, or `attach` for the one a predecessor opened) until it ends, and
then while its end is still being explained. `Generation` holds everything the controller knows
of one: the assignment it published, the post-mortem of its ranks (how each ended,
core/postmortem.py), which ranks' leases were seen, whether its row is still open in the
store, whether its workers leave on purpose, and the explanation last written for it.

`Generations` keeps them (the newest is `current`; ended ones stay, so late reports and exit
statuses of their ranks still land in their post-mortems) and records what is learnt of their
ends: one store event per rank's end, the roster's rows, and the generation row's reason,
improved while late facts arrive. The controller decides when a generation opens, is aborted or
fails; this module keeps the record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pipetransformer.core.postmortem import PostMortem, RankEnd
from pipetransformer.core.protocol import (
    Aborted,
    Assignment,
    Failed,
    PeerLost,
    RankEndReport,
    WorkerExit,
)
from pipetransformer.orchestrator.roster import Roster
from pipetransformer.store import Store

# How a rank's end reads as a store event; leaving as told is not an event.
_END_EVENTS = {
    "died": "worker_died",
    "vanished": "worker_lost",
    "failed": "worker_failed",
    "peer_lost": "peer_lost",
}
_VANISHED = "its lease lapsed with no report (the process or its node died, or it hung)"


@dataclass
class Generation:
    postmortem: PostMortem
    # what the controller published for it; None for a generation known only from its ranks'
    # late reports (one a predecessor ran, reporting after this controller took over)
    assignment: Assignment | None = None
    nodes: list[str] = field(default_factory=list)  # node of each rank, from its join request
    seen: set[int] = field(default_factory=set)  # ranks whose lease was seen
    open: bool = False  # its store row is running (this controller is the store's only writer)
    leaving: bool = False  # its workers leave on purpose (SIGTERM): a re-formation, not a loss
    # a restart would repeat its failure (PostMortem.fatal_text): the job fails
    fatal: str | None = None
    reason: str | None = None  # the explanation last written to its store row
    # ended, its end still being explained until then (time.monotonic()): a dead rank's lease
    # lapses a TTL after its peers' reports arrive
    explain_until: float | None = None

    @classmethod
    def answered(
        cls, assignment: Assignment, postmortem: PostMortem, nodes: list[str]
    ) -> Generation:
        """A generation this controller (or its predecessor) opened with `assignment`."""
        return cls(postmortem, assignment, list(nodes), open=True)

    @property
    def number(self) -> int:
        return self.postmortem.generation

    @property
    def request(self) -> str | None:
        """The id of the join request it answers."""
        return self.assignment.request if self.assignment else None

    @property
    def watched(self) -> bool:
        """Whether its workers' leases are watched: it runs, with a layout, and no one leaves on
        purpose."""
        return (
            self.open
            and self.assignment is not None
            and not self.assignment.waiting
            and not self.leaving
        )


class Generations:
    """Every generation the controller knows of, by number; `current` is the newest answered.
    `explain_s`: how long an ended generation's end is still explained (a dead rank's lease
    lapses a TTL after its peers' reports arrive)."""

    def __init__(
        self,
        store: Store,
        roster: Roster,
        job_id: str,
        explain_s: float,
        notices: list[str] | None = None,
    ) -> None:
        self.store, self.roster, self.job_id, self.explain_s = store, roster, job_id, explain_s
        # the controller's notices (the progress lines' `recovery` lines): an ended
        # generation's better explanation is told there too, not only in the store
        self.notices = notices
        self.current: Generation | None = None
        self.by_number: dict[int, Generation] = {}

    def open(self, generation: Generation) -> None:
        """`generation` is answered: the newest, in force."""
        self.current = self.by_number[generation.number] = generation

    def get(self, number: int) -> Generation | None:
        return self.by_number.get(number)

    def end(self, gen: Generation, state: str, fallback: str) -> None:
        """End a generation in the store with the best explanation known, and keep explaining
        it for a while."""
        pm = gen.postmortem
        reason = pm.summary() if pm.ends else fallback
        self.store.end_generation(self.job_id, gen.number, state, reason=reason)
        gen.open, gen.reason = False, reason
        if not pm.complete:
            gen.explain_until = time.monotonic() + self.explain_s

    def vanished(self, pm: PostMortem, rank: int) -> None:
        """`rank`'s lease is gone with no report and no exit status."""
        self.roster.lease_gone(pm.generation, rank)
        if pm.vanished(rank, _VANISHED):
            self._record_end(pm, rank)
            self.roster.ended(pm.generation, pm.ends[rank])

    def _record_end(self, pm: PostMortem, rank: int) -> None:
        """One store event for how a rank's part in a generation ended (once per rank and
        generation, whatever order the facts came in)."""
        end: RankEnd = pm.ends[rank]
        kind = _END_EVENTS.get(end.kind)
        if kind is None:
            return
        m = end.member
        data = {
            "generation": pm.generation,
            "pid": m.pid,
            "host": m.host,
            "exit_code": end.exit_code,
            "signal": end.signal,
            "phase": end.phase,
            "error" if end.kind in ("failed", "peer_lost") else "how": end.detail,
        }
        self.store.add_event(
            self.job_id,
            kind,
            f"{end.sentence()} [generation {pm.generation}]",
            rank=rank,
            data=data,
            key=f"end:{pm.generation}:{rank}:{kind}",
        )

    def explaining(self) -> list[Generation]:
        """Ended generations whose end is still being explained."""
        return [g for g in self.by_number.values() if g.explain_until is not None]

    def follow_up(self, held: dict[int, int | None]) -> None:
        """Keep explaining ended generations, given which generation each rank's presence key
        holds now: ranks whose key has gone without a word (lapsed, or taken by a later
        generation's rank) vanished; an improved explanation replaces the row's reason."""
        now = time.monotonic()
        for gen in self.explaining():
            pm = gen.postmortem
            for rank in sorted(set(pm.members) | set(range(pm.world))):
                if held.get(rank) == gen.number:
                    continue
                if rank in pm.ends:
                    # e.g. a dead rank's, after its exit status
                    self.roster.lease_gone(gen.number, rank)
                else:
                    self.vanished(pm, rank)
            self.write_reason(gen)
            if pm.complete or (gen.explain_until is not None and now > gen.explain_until):
                gen.explain_until = None

    def write_reason(self, gen: Generation) -> None:
        pm = gen.postmortem
        if gen.open or not pm.ends:
            return
        reason = pm.summary()
        if reason != gen.reason:
            self.store.explain_generation(self.job_id, gen.number, reason)
            gen.reason = reason
            if self.notices is not None:  # the abort's line came before its cause was known
                self.notices.append(f"generation {gen.number} ended: {reason}")

    def rank_ended(self, e: RankEndReport) -> Generation:
        """A rank's own final report (failed / peer_lost / aborted / left), into its
        generation's post-mortem; returns that generation."""
        gen = self.by_number.get(e.generation)
        if gen is None:  # one a predecessor ran: known from here on by its ranks' reports
            gen = self.by_number[e.generation] = Generation(PostMortem(e.generation, {}, 0))
        pm = gen.postmortem
        detail = e.error if isinstance(e, Failed | PeerLost) else e.why
        phase = e.phase if isinstance(e, Failed | PeerLost) else None
        if pm.report(e.rank, e.kind, detail, phase, isinstance(e, Failed) and e.repeats):
            self._record_end(pm, e.rank)
            aborted = isinstance(e, Aborted)
            self.roster.ended(e.generation, pm.ends[e.rank], aborted=aborted, own_word=True)
        self.write_reason(gen)
        return gen

    def exited(self, report: WorkerExit) -> bool:
        """How a worker process ended, from its fork server, matched to a generation's rank by
        host and pid (the newest generation first); False when no generation has it."""
        for number in sorted(self.by_number, reverse=True):
            gen = self.by_number[number]
            pm = gen.postmortem
            rank = pm.rank_of(report.host, report.pid)
            if rank is not None:
                if pm.exited(rank, report.exit_code, report.signal):
                    self._record_end(pm, rank)
                if rank in pm.ends:  # a new verdict, or the status of a known end
                    self.roster.ended(number, pm.ends[rank])
                self.write_reason(gen)
                return True
        return False
