"""job warnings; drop the never-read jobs.cancel_requested and attempts.resume_from

Revision ID: 5b1d7c2e9a40
Revises: 075fa942e034
Create Date: 2026-11-30 18:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "5b1d7c2e9a40"
down_revision = "075fa942e034"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch mode: SQLite cannot drop a column in place; Alembic copies the table.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("warnings", sa.JSON(), nullable=True))
        batch.drop_column("cancel_requested")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("resume_from")


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("resume_from", sa.Text(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("cancel_requested", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.drop_column("warnings")
