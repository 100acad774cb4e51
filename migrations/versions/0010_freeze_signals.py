"""What the freeze policy read at each decision point: `freeze_signals`, one row per decision
point.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27

Rank 0 reports `core.protocol.FreezeSignal` at every AutoFreeze decision point (policies
`output` and `gradient`; `schedule` and `off` read nothing): the decision point's step and
number, the boundary after it and the automatic cap (`bound`), which policy and statistic, and
per block the statistic read (`signal`) and the value at or below which the block counts as
settled (`limits`), both JSON lists with null where unknown, and what reading them cost
(`probe_s`). The dashboard's Freezing view draws how far each block is from its threshold.

One decision point is one row: (job_id, step) is unique. After a recovery a job takes the
decision points since its resumed checkpoint again, and the newer generation's reading is the
one the job followed; the store keeps the report of the highest generation (`generation`) and
skips any other, so a report drained twice is a no-op. The unique constraint's index serves the
reads, which take a job's rows by step. Rows go with their job (ON DELETE CASCADE), as every
child table's.

A new table only: nothing stored before this revision changes, and the downgrade drops it (with
what was stored since).

Self-contained (no imports from `store`), like every revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp() -> sa.DateTime:
    # `store.tables.UTCDateTime` stores through this type.
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "freeze_signals",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("time", _timestamp(), nullable=False),
        sa.Column("decision", sa.Integer(), nullable=False),
        sa.Column("boundary", sa.Integer(), nullable=False),
        sa.Column("bound", sa.Integer(), nullable=False),
        sa.Column("policy", sa.String(length=16), nullable=False),
        sa.Column("statistic", sa.String(length=32), nullable=False),
        sa.Column("signal", sa.Text(), nullable=False),
        sa.Column("limits", sa.Text(), nullable=False),
        sa.Column("probe_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_freeze_signals_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_freeze_signals")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_freeze_signals_job_id_step")),
    )


def downgrade() -> None:
    op.drop_table("freeze_signals")
