"""The SQL store's side: `StoreCounter` counts the rows, statements and commits the controller's
store writes (SQLAlchemy events), and `_Postgres` is the throwaway PostgreSQL server behind
`--store postgresql`."""

from __future__ import annotations

import sys

from _common import ROOT

from pipetransformer.store import Store


class StoreCounter:
    """Rows and statements the store's engine wrote, and its commits (SQLAlchemy events)."""

    def __init__(self, store: Store) -> None:
        from sqlalchemy import event

        self.rows = self.statements = self.commits = 0
        engine = store._engine  # the store's one engine (a benchmark may look inside)
        event.listen(engine, "after_cursor_execute", self._executed)
        event.listen(engine, "commit", self._committed)

    def _executed(self, conn, cursor, statement, parameters, context, executemany) -> None:
        verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else ""
        if verb in ("INSERT", "UPDATE", "DELETE"):
            self.statements += 1
            self.rows += max(int(cursor.rowcount or 0), 0)

    def _committed(self, conn) -> None:
        self.commits += 1

    def snapshot(self) -> tuple[int, int, int]:
        return self.rows, self.statements, self.commits


class _Postgres:
    """A throwaway PostgreSQL server (tests/fixtures_postgres.py), one database per size."""

    def __init__(self) -> None:
        sys.path.insert(0, str(ROOT))
        from tests.fixtures_postgres import PostgresServer, find_postgres_bin, missing_postgres

        why = missing_postgres()
        if why:
            raise RuntimeError(f"--store postgresql: {why}")
        self.server = PostgresServer(find_postgres_bin())
        self.server.start()

    def url(self) -> str:
        return self.server.create_database()

    def close(self) -> None:
        self.server.stop()
        self.server.cleanup()
