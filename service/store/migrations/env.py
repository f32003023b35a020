"""Alembic environment: migrations run on the connection `service.store.migrate` hands in (SQLite or PostgreSQL)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from service.store import notify_tables  # noqa: F401  (registers the tables)

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
