"""What the store raises besides ValueError (bad input) and PermissionError (a read-only store)."""

from __future__ import annotations

from collections.abc import Sequence

# An unknown job's message lists at most this many of the ids that do exist.
_MAX_LISTED_IDS = 20


class NotFound(LookupError):
    """A row the caller named (job, generation, checkpoint) does not exist."""


class UnknownJob(NotFound):
    """No job with this id; the message lists the ids that do exist."""

    def __init__(self, job_id: str, known_ids: Sequence[str]):
        self.job_id = job_id
        self.known_ids = list(known_ids)
        if not self.known_ids:
            known = "there are no jobs in this store"
        else:
            shown = ", ".join(self.known_ids[:_MAX_LISTED_IDS])
            more = len(self.known_ids) - _MAX_LISTED_IDS
            known = f"known jobs: {shown}" + (f" (and {more} more)" if more > 0 else "")
        super().__init__(f"unknown job {job_id!r}; {known}")


class JobExists(ValueError):
    """`create_job` with an id that is already taken."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"job {job_id!r} already exists")


class StoreConflict(ValueError):
    """A write contradicts what is stored (e.g. a different layout under the same version)."""


class StoreUnavailable(ConnectionError):
    """The database stayed unreachable for longer than the store's `retry_s`.

    Raised from the transient error of the last try (`__cause__`). The write did not land,
    unless a try's commit reached the server just before the connection broke; every write is
    idempotent, so calling it again once the database is back is safe either way."""
