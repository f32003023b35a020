"""Fair share, quotas and usage (issue 15): jobs.team, the resources each attempt held (attempts.cpus/gpus, for
usage and fair share), an index to find attempts by end time, and per-queue owner/team quotas and cohorts.

Revision ID: e8b4c1d9f2a6
Revises: d7a1f3c9b2e4
Create Date: 2026-12-01 04:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "e8b4c1d9f2a6"
down_revision = "d7a1f3c9b2e4"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("team", sa.String(length=128), nullable=True))
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("cpus", sa.Float(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("gpus", sa.Float(), nullable=False, server_default="0"))
    op.create_index("ix_attempts_ended", "attempts", ["ended_at"])
    op.create_index("ix_jobs_finished", "jobs", ["finished_at"])
    op.create_index(
        "ix_jobs_owner_admission_order", "jobs", ["state", "owner", sa.text("priority DESC"), "created_at", "id"]
    )
    with op.batch_alter_table("queues") as batch:
        batch.add_column(sa.Column("owner_quota", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("team_quota", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("cohort", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("borrowing_limit", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("queues") as batch:
        for name in ("borrowing_limit", "cohort", "team_quota", "owner_quota"):
            batch.drop_column(name)
    op.drop_index("ix_jobs_owner_admission_order", table_name="jobs")
    op.drop_index("ix_jobs_finished", table_name="jobs")
    op.drop_index("ix_attempts_ended", table_name="attempts")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("gpus")
        batch.drop_column("cpus")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("team")
