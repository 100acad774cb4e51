"""Reaching the database: URLs, engines with the settings the store relies on, the alembic
configuration, and riding out transient errors (a PostgreSQL restart or fail-over, a locked
SQLite file) with backoff."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from pathlib import Path
from time import monotonic, sleep
from typing import Any, TypeVar

from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.pool import StaticPool

import migrations
from store.errors import StoreUnavailable

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent
# The database URL when no --db is given (how containers pass it: from a Secret, never as an
# argument, which any process listing would show)
DB_ENV = "PIPETRANSFORMER_DB"
SQLITE_BUSY_TIMEOUT_MS = 10_000
# How long one Store call keeps retrying an unreachable database (Store(..., retry_s=...)).
DEFAULT_RETRY_S = 30.0
_RETRY_FIRST_DELAY_S = 0.05
_RETRY_MAX_DELAY_S = 2.0
# A connect attempt to an unreachable host must fail, not hang past the retry budget.
POSTGRES_CONNECT_TIMEOUT_S = 10

# PostgreSQL SQLSTATEs worth retrying besides class 08 (connection exception): the server is
# shutting down or starting up (admin/crash shutdown, "cannot connect now"), or out of slots.
_PG_TRANSIENT_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})
_SQLITE_TRANSIENT_MESSAGES = ("database is locked", "database table is locked")
_NO_SQLSTATE = object()

log = logging.getLogger(__name__)
T = TypeVar("T")


# --------------------------------------------------------------------------- URLs and engines


def sqlite_url(path: str | Path) -> str:
    """SQLAlchemy URL of the SQLite file at `path` (made absolute)."""
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def sqlite_path(url: str) -> Path | None:
    """The file behind a SQLite URL; None for other databases and in-memory SQLite."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    database = u.database
    if u.query.get("uri") in ("true", "1") and database.startswith("file:"):
        database = database.removeprefix("file:").split("?", 1)[0]
    return Path(database)


def _sqlite_pragmas(read_only: bool) -> Callable[[Any, Any], None]:
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            # SQLite ignores foreign keys (and so ON DELETE CASCADE) unless asked, per connection.
            cursor.execute("PRAGMA foreign_keys=ON")
            # The dashboard reads while the controller writes: WAL lets readers proceed during a
            # write, and busy_timeout makes a second writer wait instead of failing at once.
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            if read_only:
                # WAL is a property of the file, set by the writer; a reader changes nothing.
                cursor.execute("PRAGMA query_only=ON")
            else:
                cursor.execute("PRAGMA journal_mode=WAL")
        finally:
            cursor.close()

    return on_connect


def _postgres_read_only(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
    finally:
        cursor.close()
    dbapi_connection.commit()


def make_engine(url: str, read_only: bool = False) -> Engine:
    """An engine for `url` with the settings the store relies on (SQLite pragmas, pooling,
    PostgreSQL connection checks). A plain `postgresql://` URL uses psycopg 3.

    `read_only` makes the database itself refuse writes on these connections."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        kwargs: dict[str, Any] = {}
        if sqlite_path(url) is None:
            # One shared connection, or every pooled connection would see its own empty DB.
            kwargs = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        engine = create_engine(u, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas(read_only))
        return engine
    if u.drivername == "postgresql":
        # SQLAlchemy's default PostgreSQL driver is psycopg2; this project ships psycopg 3.
        u = u.set(drivername="postgresql+psycopg")
    if u.get_driver_name() in ("psycopg", "psycopg2") and "connect_timeout" not in u.query:
        u = u.update_query_dict({"connect_timeout": str(POSTGRES_CONNECT_TIMEOUT_S)})
    # pre_ping: after a server restart the pool's connections are dead; test before use.
    engine = create_engine(u, pool_pre_ping=True)
    if read_only and u.get_backend_name() == "postgresql":
        event.listen(engine, "connect", _postgres_read_only)
    return engine


def alembic_config(connection: Connection | None = None, url: str | None = None) -> Config:
    """An alembic Config for the packaged `migrations`, built in code (no alembic.ini).

    Pass an open `connection` to migrate on it (used by `Store`), or a `url`.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # ConfigParser escaping
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


# --------------------------------------------------------------------------- transient errors


def is_transient(exc: BaseException) -> bool:
    """Whether a database error is worth retrying: the connection was lost or refused, the
    server is restarting, or SQLite's file is locked past its busy timeout. Constraint
    violations, read-only refusals, bad SQL and the like are not."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    if not isinstance(exc, OperationalError):
        return False
    orig = exc.orig
    if any(m in str(orig).lower() for m in _SQLITE_TRANSIENT_MESSAGES):
        return True
    # psycopg 3 names it `sqlstate`, psycopg2 `pgcode`; other drivers have neither.
    code = getattr(orig, "sqlstate", getattr(orig, "pgcode", _NO_SQLSTATE))
    if code is _NO_SQLSTATE:
        return False
    # No SQLSTATE means the client gave up on the connection (refused, reset, timed out).
    return code is None or code.startswith("08") or code in _PG_TRANSIENT_SQLSTATES


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def retrying(
    attempt: Callable[[], T],
    *,
    who: str,
    what: str,
    retry_s: float,
    recoveries: collections.deque[tuple[str, float]],
) -> T:
    """Run `attempt` until it succeeds, it fails with a non-transient error, or `retry_s`
    seconds have passed (then StoreUnavailable, chained to the last error). Each retry is
    logged as a warning naming `who` (the store) and `what` (the call); a call that needed
    retries appends (what, seconds it took) to `recoveries`."""
    started = monotonic()
    delay = _RETRY_FIRST_DELAY_S
    tries = 1
    while True:
        try:
            result = attempt()
            if tries > 1:
                recoveries.append((what, monotonic() - started))
            return result
        except DBAPIError as exc:
            if not is_transient(exc):
                raise
            waited = monotonic() - started
            left = retry_s - waited
            reason = _first_line(exc.orig if exc.orig is not None else exc)
            if left <= 0:
                raise StoreUnavailable(
                    f"{who}: {what} failed: the database stayed unreachable for "
                    f"{waited:.1f}s ({tries} tries, retry_s={retry_s:g}); last error: {reason}"
                ) from exc
            pause = min(delay, left)
            log.warning(
                "%s: %s failed (try %d, %s); retrying in %.2fs, giving up in %.1fs",
                who,
                what,
                tries,
                reason,
                pause,
                left,
            )
            sleep(pause)
            delay = min(delay * 2, _RETRY_MAX_DELAY_S)
            tries += 1
