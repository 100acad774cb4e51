"""Initial schema: jobs, generations, layouts, metrics, evaluations, checkpoints, events.

Revision ID: 0001
Revises:
Create Date: 2026-01-01

Self-contained on purpose (no imports from `orchestrator`): a revision is a snapshot and must
keep producing the same schema when the models move on.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp() -> sa.DateTime:
    # `store.tables.UTCDateTime` stores through this type.
    return sa.DateTime(timezone=True)


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer(), nullable=False)


def _job_id(table: str) -> list[sa.SchemaItem]:
    return [
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f(f"fk_{table}_job_id_jobs"), ondelete="CASCADE"
        ),
    ]


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.Column("workdir", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.Column("updated_at", _timestamp(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("samples_consumed", sa.Integer(), nullable=False),
        sa.Column("lr", sa.Float(), nullable=False),
        sa.Column("freeze_boundary", sa.Integer(), nullable=False),
        sa.Column("layout_version", sa.Integer(), nullable=False),
        sa.Column("accuracy", sa.Float(), nullable=True),
        sa.CheckConstraint(
            "state IN ('pending', 'running', 'completed', 'failed', 'interrupted')",
            name=op.f("ck_jobs_state"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(op.f("ix_jobs_created_at"), "jobs", ["created_at"], unique=False)

    op.create_table(
        "generations",
        _id(),
        *_job_id("generations"),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("started_at", _timestamp(), nullable=False),
        sa.Column("ended_at", _timestamp(), nullable=True),
        sa.CheckConstraint(
            "state IN ('running', 'completed', 'failed', 'aborted', 'interrupted')",
            name=op.f("ck_generations_state"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_generations")),
        sa.UniqueConstraint("job_id", "number", name=op.f("uq_generations_job_id_number")),
    )

    op.create_table(
        "layouts",
        _id(),
        *_job_id("layouts"),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("layout_json", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_layouts")),
        sa.UniqueConstraint("job_id", "version", name=op.f("uq_layouts_job_id_version")),
    )

    op.create_table(
        "metrics",
        _id(),
        *_job_id("metrics"),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("samples_per_s", sa.Float(), nullable=True),
        sa.Column("lr", sa.Float(), nullable=False),
        sa.Column("time", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_metrics")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_metrics_job_id_step")),
    )

    op.create_table(
        "evaluations",
        _id(),
        *_job_id("evaluations"),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("accuracy", sa.Float(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("time", _timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evaluations")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_evaluations_job_id_step")),
    )

    op.create_table(
        "checkpoints",
        _id(),
        *_job_id("checkpoints"),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("layout_version", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("checksum", sa.String(length=128), nullable=False),
        sa.Column("samples_consumed", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", _timestamp(), nullable=False),
        sa.CheckConstraint(
            "state IN ('committed', 'deleted', 'corrupt')", name=op.f("ck_checkpoints_state")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("job_id", "step", name=op.f("uq_checkpoints_job_id_step")),
    )

    op.create_table(
        "events",
        _id(),
        *_job_id("events"),
        sa.Column("time", _timestamp(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data_json", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index("ix_events_job_id_time", "events", ["job_id", "time"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_events_job_id_time", table_name="events")
    op.drop_table("events")
    op.drop_table("checkpoints")
    op.drop_table("evaluations")
    op.drop_table("metrics")
    op.drop_table("layouts")
    op.drop_table("generations")
    op.drop_index(op.f("ix_jobs_created_at"), table_name="jobs")
    op.drop_table("jobs")
