"""Where each rank's time goes: `stage_times`, one row per rank and reporting interval; and
`step_traces`, one traced step per rank and trace request.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26

Workers report `core.protocol.StageTimes` once per reporting interval: the steps
`from_step`+1 .. `to_step` under one layout version, on the rank's stages of its replica, with
the seconds spent in each phase of `core.stage_times.PHASES` (one `<phase>_s` column each), the
interval's wall time and how the phases were timed (`clock`: 'cuda' or 'host'). `status`, the
end-of-run summary and the dashboard's Pipeline view read them to name the slowest stage and
the measured pipeline bubble.

A report drained twice (a replayed queue entry, a retried commit) must not be stored twice:
(job_id, generation, rank, to_step) is unique. Readers take a job's newest intervals, hence the
index on (job_id, to_step). Rows go with their job (ON DELETE CASCADE), as every child table's.

`step_traces` holds the traced steps a trace request asked for (`core.protocol.StepTrace`,
`pipetransformer trace JOB` or the dashboard): one row per rank and request, its spans as JSON;
unique per (job_id, request, generation, rank), read by (job_id, request).

New tables only: nothing stored before this revision changes, and the downgrade drops them (with
what was stored since).

Self-contained (no imports from `store`), like every revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# as core.stage_times.PHASES had them at this revision
_PHASES = (
    "forward",
    "backward",
    "pipeline_wait",
    "grad_sync",
    "optimizer",
    "frozen_prefix",
    "data_wait",
    "checkpoint",
    "evaluation",
    "other",
)


def _timestamp() -> sa.DateTime:
    # `store.tables.UTCDateTime` stores through this type.
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "stage_times",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("time", _timestamp(), nullable=False),
        sa.Column("from_step", sa.Integer(), nullable=False),
        sa.Column("to_step", sa.Integer(), nullable=False),
        sa.Column("layout_version", sa.Integer(), nullable=False),
        sa.Column("stages", sa.Text(), nullable=False),
        sa.Column("replica", sa.Integer(), nullable=False),
        sa.Column("wall_s", sa.Float(), nullable=False),
        *(sa.Column(f"{phase}_s", sa.Float(), nullable=False) for phase in _PHASES),
        sa.Column("clock", sa.String(length=8), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_stage_times_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stage_times")),
        sa.UniqueConstraint(
            "job_id",
            "generation",
            "rank",
            "to_step",
            name=op.f("uq_stage_times_job_id_generation_rank_to_step"),
        ),
    )
    op.create_index(
        "ix_stage_times_job_id_to_step", "stage_times", ["job_id", "to_step"], unique=False
    )
    op.create_table(
        "step_traces",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("request", sa.String(length=64), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("started", sa.Float(), nullable=False),
        sa.Column("time", _timestamp(), nullable=False),
        sa.Column("layout_version", sa.Integer(), nullable=False),
        sa.Column("stages", sa.Text(), nullable=False),
        sa.Column("replica", sa.Integer(), nullable=False),
        sa.Column("spans", sa.Text(), nullable=False),
        sa.Column("clock", sa.String(length=8), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_step_traces_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_step_traces")),
        sa.UniqueConstraint(
            "job_id",
            "request",
            "generation",
            "rank",
            name=op.f("uq_step_traces_job_id_request_generation_rank"),
        ),
    )
    op.create_index(
        "ix_step_traces_job_id_request", "step_traces", ["job_id", "request"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_step_traces_job_id_request", table_name="step_traces")
    op.drop_table("step_traces")
    op.drop_index("ix_stage_times_job_id_to_step", table_name="stage_times")
    op.drop_table("stage_times")
