"""storage that proves its bytes (issue 35, item 5): what each code archive unpacks to, each checkpoint's manifest
hash, and the end reason STORAGE_TAMPERED

Revision ID: e5b3c7a9d1f2
Revises: d9a2b4c6e8f0
Create Date: 2026-12-07 01:30:00

- `code_archive.tree` / `tree_sha256`: every file an archive unpacks to with its sha256, listed at upload, and the
  digest each attempt checks its working directory by (service.tenancy.code_proof). An archive stored before has none
  until its next attempt lists it from the stored file, once that file is proven its upload.
- `checkpoints.manifest_sha256`: the sha256 of a checkpoint's manifest as the attempt that wrote it reported it; a
  resume proves the checkpoint by it (workers.proof). Checkpoints reported before have none.
- `endreason` gains STORAGE_TAMPERED on PostgreSQL (SQLite stores enums as plain strings).

Columns are added in place on SQLite too (ALTER TABLE ADD COLUMN, no batch rebuild), as d9a2b4c6e8f0 does.
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel
import sqlmodel.sql.sqltypes
from alembic import op

revision = "e5b3c7a9d1f2"
down_revision = "d9a2b4c6e8f0"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("code_archive", sa.Column("tree", sa.JSON(), nullable=True))
    op.add_column("code_archive", sa.Column("tree_sha256", sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
    op.add_column("checkpoints", sa.Column("manifest_sha256", sqlmodel.sql.sqltypes.AutoString(length=64),
                                           nullable=True))  # fmt: skip
    if op.get_bind().dialect.name == "postgresql":
        # PostgreSQL 12+ allows this inside the migration's transaction (the value is usable once it commits).
        op.execute("ALTER TYPE endreason ADD VALUE IF NOT EXISTS 'STORAGE_TAMPERED'")


def downgrade() -> None:
    # PostgreSQL cannot drop an enum value; an extra value is harmless to the previous release.
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("manifest_sha256")
    with op.batch_alter_table("code_archive") as batch:
        batch.drop_column("tree_sha256")
        batch.drop_column("tree")
