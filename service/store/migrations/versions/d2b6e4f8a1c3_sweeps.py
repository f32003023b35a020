"""Sweeps and arrays (issue 18): the sweeps table and each member job's sweep

Revision ID: d2b6e4f8a1c3
Revises: c1a5d3e7f9b2
Create Date: 2026-12-02 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
import sqlmodel.sql.sqltypes
from alembic import op

revision = "d2b6e4f8a1c3"
down_revision = "c1a5d3e7f9b2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("team", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.Column("max_parallel", sa.Integer(), nullable=True),
        sa.Column("metric_name", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True),
        sa.Column("metric_mode", sqlmodel.sql.sqltypes.AutoString(length=8), nullable=True),
        sa.Column("idempotency_key", sqlmodel.sql.sqltypes.AutoString(length=255), nullable=True),
        sa.Column("request_hash", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancelled_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sweeps_created_id", "sweeps", ["created_at", "id"])
    op.create_index("ix_sweeps_owner_created_id", "sweeps", ["owner", "created_at", "id"])
    op.create_index("ux_sweeps_idempotency", "sweeps", ["owner", "idempotency_key"], unique=True)
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("sweep_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=True))
        batch.add_column(sa.Column("sweep_index", sa.Integer(), nullable=True))
    op.create_index("ix_jobs_sweep", "jobs", ["sweep_id", "sweep_index"])


def downgrade() -> None:
    op.drop_index("ix_jobs_sweep", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("sweep_index")
        batch.drop_column("sweep_id")
    op.drop_index("ux_sweeps_idempotency", table_name="sweeps")
    op.drop_index("ix_sweeps_owner_created_id", table_name="sweeps")
    op.drop_index("ix_sweeps_created_id", table_name="sweeps")
    op.drop_table("sweeps")
