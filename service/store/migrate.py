"""Schema migrations (Alembic), for SQLite and PostgreSQL alike: `shunter db upgrade`, and at every start.

Several processes may start at once against one PostgreSQL: the upgrade runs under an advisory lock, so one
migrates and the others find the schema at head.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
MIGRATION_LOCK_KEY = 0x53485544  # "SHUD"


def _config(connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database to `revision` (default: the newest schema)."""
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        command.upgrade(_config(connection), revision)


def current(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def revision(engine: Engine, message: str) -> None:
    """Autogenerate a new migration from the models (a developer command)."""
    with engine.begin() as connection:
        command.revision(_config(connection), message=message, autogenerate=True)
