"""job warnings; drop the never-read jobs.cancel_requested and attempts.resume_from; stored specs read back

Specs stored before this revision have every default written out, including the DeepSpeed short form next to a
full `config` and `gradient_accumulation_steps: 1`; the spec model now says "not given" with null, so such rows
are rewritten to validate back to the spec their user sent.

Revision ID: 5b1d7c2e9a40
Revises: 075fa942e034
Create Date: 2026-11-30 18:40:00
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "5b1d7c2e9a40"
down_revision = "075fa942e034"
branch_labels = None
depends_on = None


_DEEPSPEED_DEFAULTS = {"zero_stage": 2, "offload_optimizer": "none", "offload_param": "none", "overlap_comm": False}


def normalised(spec: Any) -> Any:
    """The spec with the old written-out defaults turned back into "not given" (None)."""
    strategy = spec.get("strategy") if isinstance(spec, dict) else None
    if not isinstance(strategy, dict):
        return spec
    strategy = dict(strategy)
    if strategy.get("gradient_accumulation_steps") == 1:
        strategy["gradient_accumulation_steps"] = None
    deepspeed = strategy.get("deepspeed")
    if isinstance(deepspeed, dict):
        strategy["deepspeed"] = {
            k: (None if k in _DEEPSPEED_DEFAULTS and v == _DEEPSPEED_DEFAULTS[k] else v) for k, v in deepspeed.items()
        }
    return {**spec, "strategy": strategy}


def _rewrite_specs() -> None:
    jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("spec", sa.JSON))
    bind = op.get_bind()
    for job_id, spec in bind.execute(sa.select(jobs.c.id, jobs.c.spec)).all():
        fixed = normalised(spec)
        if fixed != spec:
            bind.execute(jobs.update().where(jobs.c.id == job_id).values(spec=fixed))


def upgrade() -> None:
    _rewrite_specs()
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
