"""jobs.spec_bytes: each job's spec size, so an owner's bytes of specs not yet ended have a bound (issue 35, item 3)

Revision ID: d9a2b4c6e8f0
Revises: c8f1a3e5d7b9
Create Date: 2026-12-07 01:15:00

Filled in from each stored spec's JSON text (its length in bytes as the database keeps it; a submission from now on
stores the compact JSON's length, a few bytes less for the same spec). The column is added in place on SQLite too
(ALTER TABLE ADD COLUMN): a batch rebuild of `jobs` would drop the `DESC` of the admission-order indexes (see
a9c3e5f1d7b2).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "d9a2b4c6e8f0"
down_revision = "c8f1a3e5d7b9"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("spec_bytes", sa.Integer(), nullable=False, server_default="0"))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("UPDATE jobs SET spec_bytes = octet_length(spec::text)")
    else:
        op.execute("UPDATE jobs SET spec_bytes = length(CAST(spec AS BLOB))")
    op.create_index("ix_jobs_owner_state_spec_bytes", "jobs", ["owner", "state", "spec_bytes"])


def downgrade() -> None:
    op.drop_index("ix_jobs_owner_state_spec_bytes", table_name="jobs")
    op.drop_column("jobs", "spec_bytes")
