"""Notifications (issue 18): per-job webhook targets and the durable delivery outbox

Revision ID: e3c7f5a9b2d4
Revises: d2b6e4f8a1c3
Create Date: 2026-12-02 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
import sqlmodel.sql.sqltypes
from alembic import op

revision = "e3c7f5a9b2d4"
down_revision = "d2b6e4f8a1c3"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "notifications",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("event_id", sqlmodel.sql.sqltypes.AutoString(length=40), nullable=False),
        sa.Column("job_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("target", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("format", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("to_state", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("claim_token", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_notifications_due", "notifications", ["state", "next_at"])
    op.create_index("ix_notifications_job", "notifications", ["job_id", "id"])
    op.create_index("ux_notifications_event_target", "notifications", ["event_id", "target"], unique=True)
    op.create_table(
        "notify_secrets",
        sa.Column("job_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("target", sa.Integer(), nullable=False),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("job_id", "target"),
    )


def downgrade() -> None:
    op.drop_table("notify_secrets")
    op.drop_index("ux_notifications_event_target", table_name="notifications")
    op.drop_index("ix_notifications_job", table_name="notifications")
    op.drop_index("ix_notifications_due", table_name="notifications")
    op.drop_table("notifications")
