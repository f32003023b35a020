"""Secrets (issue 38): the encrypted values jobs name, the key they are encrypted with when none is configured, and
each attempt's used bootstrap credential

Revision ID: c6e8a0b2d4f7
Revises: b3d5f7a9c1e2
Create Date: 2026-12-07 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "c6e8a0b2d4f7"
down_revision = "b3d5f7a9c1e2"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secrets",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("scope", sa.String(length=8), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("ciphertext", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=128), nullable=False),
    )
    op.create_index("ux_secrets_name", "secrets", ["scope", "holder", "name"], unique=True)
    op.create_table(
        "secret_keys",
        sa.Column("kid", sa.String(length=32), primary_key=True),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.add_column("attempts", sa.Column("bootstrap_nonce", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("bootstrap_nonce")
    op.drop_table("secret_keys")
    op.drop_index("ux_secrets_name", table_name="secrets")
    op.drop_table("secrets")
