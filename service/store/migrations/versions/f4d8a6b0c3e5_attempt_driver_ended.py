"""When an attempt's driver said its run ended (issue 20): the attempt ends on that word, not on Ray's teardown

Revision ID: f4d8a6b0c3e5
Revises: e3c7f5a9b2d4
Create Date: 2026-12-02 19:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "f4d8a6b0c3e5"
down_revision = "e3c7f5a9b2d4"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("driver_ended_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("driver_ended_at")
