"""jobs.world_size: the workers of the current attempt as admitted (issue 16: an elastic job's size in its range)

Revision ID: f3a9d2c7e1b5
Revises: e8b4c1d9f2a6
Create Date: 2026-12-01 23:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "f3a9d2c7e1b5"
down_revision = "e8b4c1d9f2a6"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("world_size", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("world_size")
