"""Question answering's F1 on each held-out evaluation.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25

`evaluations.f1` is a nullable float: SQuAD's F1 (a fraction 0..1) of a question-answering job's
evaluation, whose `accuracy` is the exact match; NULL for classification and for rows stored
before this revision.

SQLite: the column is added and dropped in place (`recreate="never"`), as in revisions 0005 to
0007 and for the same reasons.

Self-contained (no imports from `store`), like every revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("evaluations", recreate="never") as batch:
        batch.add_column(sa.Column("f1", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("evaluations", recreate="never") as batch:
        batch.drop_column("f1")
