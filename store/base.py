"""What every part of the store shares: the connection, the schema's revision, and running a
call as one transaction that rides out transient errors. The per-table mixins
(`store.jobs`, `store.metrics`, ...) build on it, and `store.Store` is all of them."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Self, TypeVar

from alembic import command
from alembic.runtime.migration import MigrationContext
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from pipetransformer.store.engine import DEFAULT_RETRY_S, alembic_config, make_engine, retrying
from pipetransformer.store.errors import NotFound, UnknownJob
from pipetransformer.store.tables import Generation, Job

T = TypeVar("T")


class StoreBase:
    """Typed access to the job database. Construct with `Store.open(url)` to migrate first.

    Every public method is one transaction. A transaction that fails because the database is
    unreachable for a moment (server restarting, network blip, SQLite "database is locked") is
    retried with exponential backoff until `retry_s` seconds have passed since its first try,
    each retry logged as a warning; after that it raises `StoreUnavailable`. Every write is safe
    to run twice (the retry of a commit whose acknowledgement was lost finds its own row and
    stops), so a retried write lands exactly once and returns what its landed try would have.
    That relies on the store's single writer: no one else inserts the same rows meanwhile.
    """

    def __init__(self, url: str, read_only: bool = False, retry_s: float = DEFAULT_RETRY_S) -> None:
        """Connect to `url` without touching the schema. `read_only` (the dashboard) makes
        every write method raise PermissionError and the connection itself refuse writes.
        `retry_s` bounds how long one call keeps retrying transient errors (0: no retry)."""
        if not retry_s >= 0:
            raise ValueError(f"retry_s must be >= 0 seconds, got {retry_s!r}")
        self.url = url
        self.read_only = read_only
        self.retry_s = float(retry_s)
        # outages ridden out inside one call, (what, seconds): the caller reports them
        self.recoveries: collections.deque[tuple[str, float]] = collections.deque(maxlen=100)
        self._engine = make_engine(url, read_only=read_only)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    @classmethod
    def open(cls, url: str, migrate: bool = True, retry_s: float = DEFAULT_RETRY_S) -> Self:
        """Connect, and (by default) upgrade the schema to the newest alembic revision."""
        store = cls(url, retry_s=retry_s)
        if migrate:
            try:
                store.migrate()
            except BaseException:
                store.close()
                raise
        return store

    def migrate(self, revision: str = "head") -> None:
        """`alembic upgrade <revision>` on this store's engine."""
        if self.read_only:
            raise PermissionError(f"{self!r} is open read-only; it cannot migrate")

        def upgrade() -> None:
            # One transaction: PostgreSQL's DDL is transactional, so a retry starts clean.
            with self._engine.begin() as conn:
                command.upgrade(alembic_config(connection=conn), revision)

        self._retrying("migrate", upgrade)

    def revision(self) -> str | None:
        """The schema's alembic revision; None for a database without the schema."""

        def current() -> str | None:
            with self._engine.connect() as conn:
                return MigrationContext.configure(conn).get_current_revision()

        return self._retrying("revision", current)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({make_url(self.url).render_as_string(hide_password=True)!r})"

    # ---- transactions

    def _retrying(self, what: str, attempt: Callable[[], T]) -> T:
        return retrying(
            attempt, who=repr(self), what=what, retry_s=self.retry_s, recoveries=self.recoveries
        )

    def _write(self, what: str, tx: Callable[[Session], T]) -> T:
        """Run `tx` in one write transaction (committed on return), retrying transient
        failures. `tx` must be safe to run again after a commit whose outcome was lost."""
        if self.read_only:
            raise PermissionError(f"{self!r} is open read-only")

        def attempt() -> T:
            with self._sessions.begin() as session:
                return tx(session)

        return self._retrying(what, attempt)

    def _read(self, what: str, tx: Callable[[Session], T]) -> T:
        def attempt() -> T:
            with self._sessions() as session:
                return tx(session)

        return self._retrying(what, attempt)

    # ---- lookups every table needs

    def _job(self, session: Session, job_id: str) -> Job:
        job = session.get(Job, job_id)
        if job is None:
            raise self._unknown(session, job_id)
        return job

    def _unknown(self, session: Session, job_id: str) -> UnknownJob:
        known = session.scalars(select(Job.id).order_by(Job.created_at.desc(), Job.id))
        return UnknownJob(job_id, list(known))

    def _generation(self, s: Session, job_id: str, number: int) -> Generation:
        self._job(s, job_id)
        gen = s.scalar(
            select(Generation).where(Generation.job_id == job_id, Generation.number == number)
        )
        if gen is None:
            raise NotFound(f"job {job_id!r} has no generation {number}")
        return gen
