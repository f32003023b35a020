"""Pre-flight results, stalls and node faults (issue 17): endreason gains PREFLIGHT_FAILED and STALLED on PostgreSQL;
attempts.preflight and excluded_nodes, jobs.stalled_at, and the node_faults table that node exclusion reads

Revision ID: b7e2c4a9d1f6
Revises: a6c2e9d4b8f1
Create Date: 2026-12-02 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
import sqlmodel.sql.sqltypes
from alembic import op

revision = "b7e2c4a9d1f6"
down_revision = "a6c2e9d4b8f1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TYPE endreason ADD VALUE IF NOT EXISTS 'PREFLIGHT_FAILED'")
        op.execute("ALTER TYPE endreason ADD VALUE IF NOT EXISTS 'STALLED'")
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("preflight", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("excluded_nodes", sa.JSON(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("stalled_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "node_faults",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("address", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
        sa.Column("job_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("reason", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cleared_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cleared_by", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_node_faults_job", "node_faults", ["job_id"])
    op.create_index("ix_node_faults_at", "node_faults", ["at"])


def downgrade() -> None:
    op.drop_index("ix_node_faults_at", table_name="node_faults")
    op.drop_index("ix_node_faults_job", table_name="node_faults")
    op.drop_table("node_faults")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("stalled_at")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("excluded_nodes")
        batch.drop_column("preflight")
