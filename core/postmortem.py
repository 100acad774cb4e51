"""Why a generation ended: which rank died and how, apart from the ranks that only lost a peer.

When one worker dies, its peers fail too (a gloo collective says "Connection closed by peer"),
usually before the dead rank's etcd lease lapses; attributing the end to whichever rank's report
or lease the controller happens to see first blames a survivor. So the controller collects, per
generation, how each of its ranks ended, from three sources that arrive in any order:

- the rank's own final report: `failed` (its own exception: a cause), `peer_lost` (a
  collective failed because a peer went away: a victim), `aborted` (it left because the
  controller aborted the generation) or `left` (SIGTERM: it was stopped);
- the exit status its fork server reaped (`exited`): killed by a signal or an abnormal exit
  code, a cause unless the rank's own report already explains it;
- its presence key vanishing (lease lapsed or replaced by a later generation's rank) with no
  report and no exit status: a cause (the process or its node died, or it hung).

Pure: plain values in, a verdict out; the controller does the I/O (etcd, store).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace
from typing import Literal

from pipetransformer.core.protocol import is_abnormal

EndKind = Literal["failed", "died", "vanished", "peer_lost", "left"]
CAUSES: tuple[EndKind, ...] = ("failed", "died", "vanished")
OWN_WORD: tuple[EndKind, ...] = ("failed", "peer_lost", "left")  # what a rank reports itself


def describe_status(exit_code: int | None = None, signum: int | None = None) -> str:
    """'killed by signal 9 (SIGKILL)' or 'exited with code 3'."""
    if signum is not None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {signum} ({name})"
    return f"exited with code {exit_code}"


@dataclass(frozen=True)
class Member:
    """A rank of a generation: its worker process."""

    rank: int
    pid: int | None = None
    host: str | None = None

    def who(self) -> str:
        where = f" on {self.host}" if self.host else ""
        return f"rank {self.rank} (pid {self.pid}{where})" if self.pid else f"rank {self.rank}"


@dataclass(frozen=True)
class RankEnd:
    """How one rank's part in a generation ended."""

    member: Member
    kind: EndKind
    detail: str  # the error, the exit status, or how it vanished
    exit_code: int | None = None
    signal: int | None = None
    phase: str | None = None  # failed: "build" (before the first step) or "train"
    repeats: bool = False  # failed: the rank says a restart would fail the same way (its data)

    @property
    def is_cause(self) -> bool:
        return self.kind in CAUSES

    def sentence(self) -> str:
        who = self.member.who()
        if self.kind == "died":
            return f"{who} {self.detail}"
        if self.kind == "failed":
            at = " while starting" if self.phase == "build" else ""
            return f"{who} failed{at}: {self.detail}"
        if self.kind == "vanished":
            return f"{who} vanished: {self.detail}"
        if self.kind == "peer_lost":
            return f"{who} lost its peer ({self.detail})"
        return f"{who} left ({self.detail})"


@dataclass
class PostMortem:
    """Collects how each rank of one generation ended, in whatever order the facts arrive."""

    generation: int
    members: dict[int, Member]
    world: int = 0  # ranks in the generation (members may be unknown: a restarted controller)
    ends: dict[int, RankEnd] = field(default_factory=dict)
    _exits: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)
    # why the generation re-formed on purpose (a rank asked to leave), when it did: then there
    # is no cause to find, and its ranks' keys going away is no loss
    re_formed: str | None = None

    def leave(self, why: str) -> None:
        """Every rank checkpointed and leaves together (a `leaving` report): all end as left."""
        self.re_formed = why
        for rank in sorted(set(self.members) | set(range(self.world))):
            self.report(rank, "left", why)

    @classmethod
    def of(cls, generation: int, world: int, pids: list[int], nodes: list[str]) -> PostMortem:
        """From a join request: its world size, and the pid and node ("host:agent-pid") of each
        rank where it names them."""
        members = {}
        for rank, pid in enumerate(pids):
            host = nodes[rank].rsplit(":", 1)[0] if rank < len(nodes) else None
            members[rank] = Member(rank, pid, host)
        return cls(generation, members, world)

    def member(self, rank: int) -> Member:
        return self.members.get(rank) or Member(rank)

    def rank_of(self, host: str, pid: int) -> int | None:
        """The rank whose worker was process `pid` on `host`, if it belongs to this generation."""
        for m in self.members.values():
            if m.pid == pid and (m.host is None or m.host == host):
                return m.rank
        return None

    # -- facts ---------------------------------------------------------------------------------

    def report(
        self,
        rank: int,
        kind: str,
        detail: str = "",
        phase: str | None = None,
        repeats: bool = False,
    ) -> bool:
        """The rank's own final report (failed / peer_lost / aborted / left; `repeats`: a
        failure a restart repeats). Returns whether it told something new. Its own word wins
        over an exit status or a vanished key."""
        if kind == "aborted":
            kind, detail = "left", detail or "the controller aborted the generation"
        if kind not in OWN_WORD:
            raise ValueError(f"not a final report: {kind!r}")
        current = self.ends.get(rank)
        if current is not None and current.kind in OWN_WORD:
            return False
        code, sig = self._exits.get(rank, (None, None))
        self.ends[rank] = RankEnd(self.member(rank), kind, detail, code, sig, phase, repeats)  # type: ignore[arg-type]
        return True

    def exited(self, rank: int, exit_code: int | None, signum: int | None) -> bool:
        """The exit status the rank's fork server reaped. A clean one (done, re-form) adds
        nothing; an abnormal one is the cause unless the rank already said why it ended."""
        self._exits[rank] = (exit_code, signum)
        if not is_abnormal(exit_code, signum):
            return False
        current = self.ends.get(rank)
        status = describe_status(exit_code, signum)
        if current is not None and current.kind != "vanished":
            # its own report explains the exit (a failure exits 1): keep it, note the status
            self.ends[rank] = replace(current, exit_code=exit_code, signal=signum)
            return False
        self.ends[rank] = RankEnd(self.member(rank), "died", status, exit_code, signum)
        return True

    def vanished(self, rank: int, how: str) -> bool:
        """The rank's presence key is gone (or held by a later generation) and nothing else is
        known of it yet."""
        if rank in self.ends:
            return False
        self.ends[rank] = RankEnd(self.member(rank), "vanished", how)
        return True

    # -- verdict -------------------------------------------------------------------------------

    @property
    def causes(self) -> list[RankEnd]:
        return [e for _, e in sorted(self.ends.items()) if e.is_cause]

    @property
    def victims(self) -> list[RankEnd]:
        return [e for _, e in sorted(self.ends.items()) if not e.is_cause]

    @property
    def complete(self) -> bool:
        """Every rank's end is known and at least one of them is a cause."""
        ranks = set(self.members) | set(range(self.world))
        return bool(self.causes or self.re_formed) and set(self.ends) >= ranks

    def repeating(self) -> RankEnd | None:
        """The first rank that failed with an error it says a restart repeats, if any."""
        ends = (self.ends.get(r) for r in range(self.world))
        return next((e for e in ends if e and e.kind == "failed" and e.repeats), None)

    def fatal_text(self) -> str | None:
        """`deterministic_failure` as the job's message says it."""
        if (repeating := self.repeating()) is not None:
            return f"rank {repeating.member.rank} met an error a restart would repeat: {repeating.detail}"
        error = self.deterministic_failure()
        return None if error is None else f"every rank failed the same way while starting: {error}"

    def deterministic_failure(self) -> str | None:
        """The error, if a restart would repeat it exactly: a rank failed with an error it says
        repeats (the user's data: a corrupt file read mid-epoch, by whichever rank reads it), or
        every one of the generation's ranks failed while starting with the same exception (a
        spec or environment problem)."""
        if (repeating := self.repeating()) is not None:
            return repeating.detail
        ends = [self.ends.get(r) for r in range(self.world)]
        if self.world < 1 or any(
            e is None or e.kind != "failed" or e.phase != "build" for e in ends
        ):
            return None
        errors = {e.detail for e in ends if e is not None}
        return errors.pop() if len(errors) == 1 else None

    def summary(self) -> str:
        """One line for the generation row and its event: causes first, then the victims."""
        causes, victims = self.causes, self.victims
        parts = [e.sentence() for e in causes]
        lost = [e for e in victims if e.kind == "peer_lost"]
        if lost:
            ranks = ", ".join(str(e.member.rank) for e in lost)
            s = "s" if len(lost) > 1 else ""
            its = "their" if len(lost) > 1 else "its"
            parts.append(f"rank{s} {ranks} only lost {its} peer")
        if not causes:
            parts.append(self.re_formed or "the failed process is not identified yet")
        return "; ".join(parts)
