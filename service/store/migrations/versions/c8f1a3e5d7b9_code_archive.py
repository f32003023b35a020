"""code_archive: one row per stored code archive (issue 35, item 7: a per-owner quota, and expiry)

Revision ID: c8f1a3e5d7b9
Revises: b7e2d4f6a8c1
Create Date: 2026-12-07 01:10:00

Archives already on storage are not listed here: a migration does not read the storage (it may be an object store
the migrating process has no credentials for, and every process runs the migrations at start). Each gets its row the
first time it is used after the upgrade (`service.tenancy.code_archives`), from its file.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
import sqlmodel.sql.sqltypes
from alembic import op

revision = "c8f1a3e5d7b9"
down_revision = "b7e2d4f6a8c1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "code_archive",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("owner", sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
        sa.Column("sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ux_code_archive_owner_sha256", "code_archive", ["owner", "sha256"], unique=True)
    op.create_index("ix_code_archive_sha256", "code_archive", ["sha256"])
    op.create_index("ix_code_archive_last_used", "code_archive", ["last_used_at"])


def downgrade() -> None:
    op.drop_table("code_archive")
