"""progress_keys: the stored keys that sign attempt tokens (when SHUNTER_PROGRESS_SECRET is unset)

Revision ID: 9e3f6a1c2b7d
Revises: 5b1d7c2e9a40
Create Date: 2026-12-02 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "9e3f6a1c2b7d"
down_revision = "5b1d7c2e9a40"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "progress_keys",
        sa.Column("kid", sa.String(length=32), nullable=False),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("active_from", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("kid"),
    )


def downgrade() -> None:
    op.drop_table("progress_keys")
