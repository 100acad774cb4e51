"""Events get a dedup key, unique per job, so recording the same event twice is a no-op.

Revision ID: 0002
Revises: 0001
Create Date: 2026-02-01

Rows already stored keep a NULL key (NULLs never collide in a unique constraint, on SQLite and
PostgreSQL alike). Batch mode lets SQLite add the constraint by recreating the table.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("events") as batch:
        batch.add_column(sa.Column("dedup_key", sa.String(length=255), nullable=True))
        batch.create_unique_constraint(
            batch.f("uq_events_job_id_dedup_key"), ["job_id", "dedup_key"]
        )


def downgrade() -> None:
    with op.batch_alter_table("events") as batch:
        batch.drop_constraint(batch.f("uq_events_job_id_dedup_key"), type_="unique")
        batch.drop_column("dedup_key")
