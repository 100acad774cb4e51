"""Per-block gradient norms per step, and a `workers` table: every rank of every generation.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-15

`metrics.grad_norms` is nullable text holding a JSON list (one norm per block, null where not
finite); rows stored before this revision keep NULL. `workers` has one row per rank of each
generation: where it ran (node, host, pid, log), what it ran (stages, replica), when it was
assigned, started and last reported, its lease and how it ended.

SQLite: the column is added and dropped in place (`ALTER TABLE ... ADD/DROP COLUMN`), never by
batch mode's table recreation (`recreate="never"`): see revision 0004 for why recreating a
table is a trap here (with foreign keys on, dropping a parent cascade-deletes its children), and
`metrics` holds every step of every job, which a recreation would copy. Dropping the column on
downgrade needs SQLite >= 3.35, which revision 0004 already required.

Self-contained (no imports from `orchestrator`), like every revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# as store.tables had them at this revision
_WORKER_STATES = (
    "assigned",
    "running",
    "done",
    "stopped",
    "left",
    "aborted",
    "failed",
    "died",
    "lost",
    "peer_lost",
)
_LEASE_STATES = ("unknown", "held", "lapsed", "released")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _timestamp() -> sa.DateTime:
    # `store.tables.UTCDateTime` stores through this type.
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("metrics", recreate="never") as batch:
        batch.add_column(sa.Column("grad_norms", sa.Text(), nullable=True))

    op.create_table(
        "workers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node", sa.Text(), nullable=False),
        sa.Column("host", sa.Text(), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("stages_json", sa.Text(), nullable=True),
        sa.Column("replica", sa.Integer(), nullable=True),
        sa.Column("log", sa.Text(), nullable=True),
        sa.Column("assigned_at", _timestamp(), nullable=False),
        sa.Column("started_at", _timestamp(), nullable=True),
        sa.Column("last_report_at", _timestamp(), nullable=True),
        sa.Column("lease", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("signal", sa.Integer(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.CheckConstraint(_in("state", _WORKER_STATES), name=op.f("ck_workers_state")),
        sa.CheckConstraint(_in("lease", _LEASE_STATES), name=op.f("ck_workers_lease")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_workers_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint(
            "job_id", "generation", "rank", name=op.f("uq_workers_job_id_generation_rank")
        ),
    )


def downgrade() -> None:
    op.drop_table("workers")
    with op.batch_alter_table("metrics", recreate="never") as batch:
        batch.drop_column("grad_norms")
