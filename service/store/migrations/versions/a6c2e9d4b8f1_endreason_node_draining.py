"""endreason gains NODE_DRAINING on PostgreSQL (issue 16: an attempt that checkpointed and stopped on a drain notice)

Revision ID: a6c2e9d4b8f1
Revises: f3a9d2c7e1b5
Create Date: 2026-12-02 04:00:00
"""

from __future__ import annotations

from alembic import op

revision = "a6c2e9d4b8f1"
down_revision = "f3a9d2c7e1b5"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TYPE endreason ADD VALUE IF NOT EXISTS 'NODE_DRAINING'")


def downgrade() -> None:
    # PostgreSQL cannot drop an enum value; an extra value is harmless to the previous release.
    pass
