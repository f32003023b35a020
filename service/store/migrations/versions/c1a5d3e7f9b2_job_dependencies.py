"""Job dependencies (issue 18): the job_dependencies table and what admission reads of it

Revision ID: c1a5d3e7f9b2
Revises: b7e2c4a9d1f6
Create Date: 2026-12-02 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
import sqlmodel.sql.sqltypes
from alembic import op

revision = "c1a5d3e7f9b2"
down_revision = "b7e2c4a9d1f6"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TYPE endreason ADD VALUE IF NOT EXISTS 'DEPENDENCY_FAILED'")
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("waiting_on", sa.Integer(), server_default="0", nullable=False))
    op.create_table(
        "job_dependencies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("depends_on", sqlmodel.sql.sqltypes.AutoString(length=32), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("condition", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column("alias", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column("outcome", sqlmodel.sql.sqltypes.AutoString(length=16), nullable=True),
        sa.Column("settled_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("checkpoint", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.ForeignKeyConstraint(["depends_on"], ["jobs.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ux_job_dependencies_edge", "job_dependencies", ["job_id", "depends_on"], unique=True)
    op.create_index("ix_job_dependencies_on", "job_dependencies", ["depends_on", "outcome"])


def downgrade() -> None:
    # PostgreSQL cannot drop an enum value: DEPENDENCY_FAILED stays in the type, unused.
    op.drop_index("ix_job_dependencies_on", table_name="job_dependencies")
    op.drop_index("ux_job_dependencies_edge", table_name="job_dependencies")
    op.drop_table("job_dependencies")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("waiting_on")
