"""The freeze boundary each step trained under.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25

`metrics.frozen` is a nullable integer: the freeze boundary of the layout a step trained under,
as the worker reported it (`Metrics.frozen`). Layouts are recorded when the controller drains
the workers' report, a few steps after training under them began, so a step's boundary cannot
be read off layout timestamps exactly; this column says it. Rows stored before this revision
keep NULL (readers fall back to the layouts' times).

SQLite: the column is added and dropped in place (`recreate="never"`), as in revisions 0005 and
0006 and for the same reasons (no table recreation of `metrics`; dropping needs SQLite >= 3.35).

Self-contained (no imports from `store`), like every revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("metrics", recreate="never") as batch:
        batch.add_column(sa.Column("frozen", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("metrics", recreate="never") as batch:
        batch.drop_column("frozen")
