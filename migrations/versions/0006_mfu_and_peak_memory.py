"""Model FLOPs utilisation and per-rank peak GPU memory per step.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24

`metrics.mfu` is a nullable float (a fraction; NULL where unknown: the CPU, older workers).
`metrics.peak_memory_mib` is nullable text holding a JSON list (peak GPU memory allocated per
rank in MiB, index = rank, null where a rank did not say), set only on steps at control points.
Rows stored before this revision keep NULL in both.

SQLite: both columns are added and dropped in place (`recreate="never"`), as in revision 0005
and for the same reasons (no table recreation of `metrics`; dropping needs SQLite >= 3.35).

Self-contained (no imports from `orchestrator`), like every revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("metrics", recreate="never") as batch:
        batch.add_column(sa.Column("mfu", sa.Float(), nullable=True))
        batch.add_column(sa.Column("peak_memory_mib", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("metrics", recreate="never") as batch:
        batch.drop_column("peak_memory_mib")
        batch.drop_column("mfu")
