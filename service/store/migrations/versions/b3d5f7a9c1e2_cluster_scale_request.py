"""cluster_snapshots.scale_request, queues.accelerator_types (issue 37)

The first is the room a dispatcher last asked the cluster's autoscaler for; the second, the accelerator types a
queue's jobs must ask for.

Revision ID: b3d5f7a9c1e2
Revises: e5b3c7a9d1f2
Create Date: 2026-12-07 08:30:00

Both null by default (nothing asked for; a queue of any type). Added in place (ALTER TABLE ADD COLUMN) on SQLite too.
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
    op.add_column("queues", sa.Column("accelerator_types", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("queues") as batch:
        batch.drop_column("accelerator_types")
    with op.batch_alter_table("cluster_snapshots") as batch:
        batch.drop_column("scale_request")
