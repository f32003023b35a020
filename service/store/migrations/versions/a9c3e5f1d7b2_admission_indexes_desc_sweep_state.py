"""The admission-order indexes keep `priority DESC` on SQLite; jobs by sweep and state

Revision ID: a9c3e5f1d7b2
Revises: f4d8a6b0c3e5
Create Date: 2026-12-03 14:20:00

On SQLite every `batch_alter_table("jobs")` since 075fa942e034 rebuilt the table with its indexes as reflected, and
reflection drops the `DESC` of an expression index: `ix_jobs_admission_order` came back as (state, priority,
created_at, id), which cannot give `ORDER BY priority DESC, created_at, id`, so each admission pass sorted the whole
queue (an admission pass at 100k queued: 8 ms when the index was made, 173 ms after). Both are made again as the
models say (tests/service/test_migrations.py now checks their definitions). A later batch migration of `jobs` must
make them again too. PostgreSQL alters in place and keeps them.

`ix_jobs_sweep_state`: `max_parallel` reads the queued members of sweeps that have one; by (sweep_id, state) that
is a probe per sweep, where by state alone it was every queued job (84 ms at 100k queued, with no sweep at all).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "a9c3e5f1d7b2"
down_revision = "f4d8a6b0c3e5"
branch_labels = None
depends_on = None

DESC_INDEXES: dict[str, list[str | sa.TextClause]] = {
    "ix_jobs_admission_order": ["state", sa.text("priority DESC"), "created_at", "id"],
    "ix_jobs_owner_admission_order": ["state", "owner", sa.text("priority DESC"), "created_at", "id"],
}


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name, columns in DESC_INDEXES.items():
            op.drop_index(name, table_name="jobs")
            op.create_index(name, "jobs", columns)
    op.create_index("ix_jobs_sweep_state", "jobs", ["sweep_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_jobs_sweep_state", table_name="jobs")
