"""The Alembic migrations build exactly the schema the models describe, on SQLite and on PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

from service.db import make_engine
from service.migrate import current, upgrade

ROOT = Path(__file__).resolve().parents[2]
EXPRESSION_INDEX = "ix_jobs_admission_order"


def test_migrated_schema_matches_the_models(db: Engine) -> None:
    with db.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": False}), SQLModel.metadata)
    # Alembic cannot compare expression indexes (priority DESC) on SQLite: check that one by name instead.
    diff = [d for d in diff if not (d[0].endswith("_index") and d[1].name == EXPRESSION_INDEX)]
    assert diff == []
    assert EXPRESSION_INDEX in {ix["name"] for ix in inspect(db).get_indexes("jobs")}
    assert current(db) is not None
    upgrade(db)  # idempotent: a second start finds the schema at head


def test_db_upgrade_command(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    out = subprocess.run([sys.executable, "-m", "api.cli", "db", "upgrade"], cwd=ROOT, capture_output=True, text=True,
                         env={"SHUNTER_DATABASE_URL": url, "PATH": "/usr/bin:/bin"}, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "database at revision" in out.stdout
    assert current(make_engine(url)) is not None
