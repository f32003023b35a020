"""endreason gains CLUSTER_RESTARTED on PostgreSQL (c4d2e8a17f30 added the column, not the enum value)

Revision ID: d7a1f3c9b2e4
Revises: c4d2e8a17f30
Create Date: 2026-11-30 22:00:00

Found by the chaos run on PostgreSQL: the first attempt lost with a Ray head restart could not be recorded there
(`invalid input value for enum endreason`), and its job waited forever. SQLite stores enums as plain strings.
"""

from __future__ import annotations

from alembic import op

revision = "d7a1f3c9b2e4"
down_revision = "c4d2e8a17f30"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        # PostgreSQL 12+ allows this inside the migration's transaction (the value is usable once it commits).
        op.execute("ALTER TYPE endreason ADD VALUE IF NOT EXISTS 'CLUSTER_RESTARTED'")


def downgrade() -> None:
    # PostgreSQL cannot drop an enum value; an extra value is harmless to the previous release.
    pass
