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
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.pool import StaticPool

import pipetransformer.migrations as migrations
from pipetransformer.store.errors import StoreUnavailable

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


# The databases the store is built and tested for, as a user writes their URLs.
SUPPORTED_URLS = "sqlite:///PATH or postgresql://USER:PASSWORD@HOST:PORT/DATABASE"
_SQLITE_DRIVERS = ("sqlite", "sqlite+pysqlite")
_POSTGRES_DRIVERS = ("postgresql", "postgresql+psycopg")


def url_problem(url: str) -> str | None:
    """What is wrong with a store URL before anything connects, or None: it does not parse,
    names a database (or driver) the store does not support, or is a SQLite file whose
    directory does not exist. Reads nothing but the file system's directory entries."""
    try:
        u = make_url(url)
    except ArgumentError:
        return f"is not a database URL; use {SUPPORTED_URLS}"
    backend = u.get_backend_name()
    if backend == "sqlite":
        if u.drivername not in _SQLITE_DRIVERS:
            return f"driver {u.drivername!r} is not supported; use {SUPPORTED_URLS}"
        path = sqlite_path(url)
        if path is None:
            return None  # in memory
        parent = path.expanduser().parent
        if not parent.exists():
            return f"names a SQLite file in {parent}, which does not exist; create it first"
        if not parent.is_dir():
            return f"names a SQLite file in {parent}, which is not a directory"
        if path.exists() and not path.is_file():
            return f"names {path} as its SQLite file, which is not a file"
        return None
    if backend == "postgresql":
        if u.drivername not in _POSTGRES_DRIVERS:
            return f"driver {u.drivername!r} is not installed here; use postgresql:// (psycopg 3)"
        return None
    return f"scheme {u.drivername!r} is not supported; use {SUPPORTED_URLS}"


def server_of(url: str) -> str:
    """HOST:PORT of a database server as a person would look for it (the driver's defaults
    filled in)."""
    u = make_url(url)
    return f"{u.host or 'localhost'}:{u.port or 5432}"


def unreachable(url: str, timeout_s: float = 5.0) -> str | None:
    """Why the database server behind `url` does not answer within about `timeout_s`, or None
    when it does (or the URL is a SQLite file, which needs no server). One connection attempt,
    no retries: for a person waiting at a command line, not for a controller that must ride
    out a restart (`retrying`)."""
    u = make_url(url)
    if u.get_backend_name() != "postgresql":
        return None
    u = u.update_query_dict({"connect_timeout": str(max(1, round(timeout_s)))})
    engine = make_engine(u.render_as_string(hide_password=False))
    try:
        with engine.connect():
            return None
    except DBAPIError as exc:
        return _first_line(exc.orig if exc.orig is not None else exc)
    finally:
        engine.dispose()


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
