"""cluster_snapshots.scale_request: the room a dispatcher last asked the cluster's autoscaler for (issue 37)

Revision ID: b3d5f7a9c1e2
Revises: e5b3c7a9d1f2
Create Date: 2026-12-07 08:30:00

Null when nothing is asked for (or the cluster does not grow). Added in place (ALTER TABLE ADD COLUMN) on SQLite too.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "b3d5f7a9c1e2"
down_revision = "e5b3c7a9d1f2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("cluster_snapshots", sa.Column("scale_request", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("cluster_snapshots") as batch:
        batch.drop_column("scale_request")
