"""cluster_snapshots.scale_request, queues.accelerator_types, jobs.accelerator_type (issue 37)

The room a dispatcher last asked the cluster's autoscaler for; the accelerator types a queue's jobs must ask for;
the accelerator type a job's workers ask for (usage counts GPU-hours by it), filled in from the stored specs.

Revision ID: b3d5f7a9c1e2
Revises: e5b3c7a9d1f2
Create Date: 2026-12-07 08:30:00

All null by default (nothing asked for; a queue of any type; a job of none). Added in place (ALTER TABLE ADD
COLUMN) on SQLite too.
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
    op.add_column("jobs", sa.Column("accelerator_type", sa.String(length=64), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("UPDATE jobs SET accelerator_type = spec->'resources'->>'accelerator_type'"
                   " WHERE spec->'resources'->>'accelerator_type' IS NOT NULL")  # fmt: skip
    else:
        op.execute("UPDATE jobs SET accelerator_type = json_extract(spec, '$.resources.accelerator_type')"
                   " WHERE json_extract(spec, '$.resources.accelerator_type') IS NOT NULL")  # fmt: skip


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("accelerator_type")
    with op.batch_alter_table("queues") as batch:
        batch.drop_column("accelerator_types")
    with op.batch_alter_table("cluster_snapshots") as batch:
        batch.drop_column("scale_request")
