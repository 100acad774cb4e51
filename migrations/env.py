"""Alembic environment for the pipetransformer store.

`store` builds the alembic `Config` in code and hands over an open connection in
`config.attributes["connection"]`, so migrations run on the store's own engine (same SQLite
pragmas, same in-memory database). Without one, an engine is made from `sqlalchemy.url`.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from pipetransformer.store.tables import Base

config = context.config
target_metadata = Base.metadata


def _configure(**kwargs: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        **kwargs,
    )


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade --sql`) without a database."""
    url = config.get_main_option("sqlalchemy.url")
    _configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=bool(url and url.startswith("sqlite")),
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    # SQLite cannot ALTER most things: batch mode recreates the table instead.
    _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from pipetransformer.store import make_engine

    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database: set sqlalchemy.url or pass attributes['connection']")
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
