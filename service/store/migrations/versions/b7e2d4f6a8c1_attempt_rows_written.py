"""The rows an attempt's own reports wrote (issue 35: a job's writes are capped per attempt)

Revision ID: b7e2d4f6a8c1
Revises: a9c3e5f1d7b2
Create Date: 2026-12-06 19:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "b7e2d4f6a8c1"
down_revision = "a9c3e5f1d7b2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("rows_written", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("rows_written")
