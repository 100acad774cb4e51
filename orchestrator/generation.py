"""One generation as the controller sees it: a torchrun rendezvous round it answered, from the
moment it opens (`Controller.start_generation`, or `attach` for the one a predecessor opened)
until it ends, and then while its end is still being explained.

Everything the controller knows about a generation lives here rather than in a dozen parallel
fields of its own: the assignment it published, the post-mortem of its ranks (how each ended,
orchestrator/postmortem.py), which ranks' leases were seen, whether its row is still open in the
store, whether its workers are leaving on purpose, and the explanation last written for it.
Pure: the controller does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.protocol import Assignment
from orchestrator.postmortem import PostMortem


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
    fatal: str | None = None  # every rank failed the same way while starting: the job fails
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
