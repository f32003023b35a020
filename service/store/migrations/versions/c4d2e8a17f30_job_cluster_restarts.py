"""jobs.cluster_restarts: attempts lost with a Ray head restart (not counted against max_attempts by default)

Revision ID: c4d2e8a17f30
Revises: 9e3f6a1c2b7d
Create Date: 2026-11-30 20:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c4d2e8a17f30"
down_revision = "9e3f6a1c2b7d"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("cluster_restarts", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("cluster_restarts")
