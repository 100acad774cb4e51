"""Jobs no longer store a freeze boundary: it is the boundary of the job's latest layout.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

The layout in force owns the boundary (`Layout.freeze_boundary`, in `layouts.layout_json`);
`jobs.freeze_boundary` was a second copy that could disagree with it. The store now derives
the job's boundary from its highest-versioned layout (0 before the first one).

SQLite: the column goes by `ALTER TABLE ... DROP COLUMN` (SQLite 3.35+), never by batch mode's
table recreation. Recreating `jobs` means `DROP TABLE jobs`, and with foreign keys on (the store
turns them on for every connection, and SQLite cannot turn them off inside the migration's
transaction) that deletes every job's generations, layouts, metrics, checkpoints and events by
ON DELETE CASCADE. Hence `recreate="never"` on both sides.

Downgrade adds the column back and fills it from each job's latest layout (0 without one).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SQLITE_DROP_COLUMN = (3, 35, 0)

# `layouts.layout_json` is text holding a JSON object; its "freeze_boundary" as an integer.
_BOUNDARY = {
    "sqlite": "CAST(json_extract(layouts.layout_json, '$.freeze_boundary') AS INTEGER)",
    "postgresql": "CAST(CAST(layouts.layout_json AS JSON) ->> 'freeze_boundary' AS INTEGER)",
}


def _dialect() -> str:
    return op.get_context().dialect.name


def upgrade() -> None:
    context = op.get_context()
    version = context.dialect.server_version_info  # None when emitting SQL (--sql)
    if _dialect() == "sqlite" and version is not None and version < SQLITE_DROP_COLUMN:
        raise RuntimeError(
            f"revision 0004 needs SQLite >= {'.'.join(map(str, SQLITE_DROP_COLUMN))} "
            f"(ALTER TABLE DROP COLUMN); this one is {'.'.join(map(str, version))}"
        )
    with op.batch_alter_table("jobs", recreate="never") as batch:
        batch.drop_column("freeze_boundary")


def downgrade() -> None:
    dialect = _dialect()
    if dialect not in _BOUNDARY:
        raise NotImplementedError(f"revision 0004 cannot be downgraded on {dialect}")
    # SQLite adds a NOT NULL column only with a default.
    with op.batch_alter_table("jobs", recreate="never") as batch:
        batch.add_column(
            sa.Column("freeze_boundary", sa.Integer(), nullable=False, server_default="0")
        )
    op.execute(
        "UPDATE jobs SET freeze_boundary = COALESCE(("
        f"SELECT {_BOUNDARY[dialect]} FROM layouts WHERE layouts.job_id = jobs.id "
        "ORDER BY layouts.version DESC LIMIT 1), 0)"
    )
    if dialect != "sqlite":
        # As revision 0001 made it; SQLite keeps the default (removing it means recreating
        # `jobs`, see above), which changes nothing for rows written with a value.
        op.alter_column("jobs", "freeze_boundary", server_default=None)
