"""The Alembic migrations build exactly the schema the models describe, on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel

from service.spec.job import JobSpec
from service.store.db import make_engine
from service.store.migrate import current, upgrade
from service.store.models import Job

ROOT = Path(__file__).resolve().parents[2]
EXPRESSION_INDEXES = ("ix_jobs_admission_order", "ix_jobs_owner_admission_order")


def test_migrated_schema_matches_the_models(db: Engine) -> None:
    with db.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": False}), SQLModel.metadata)
    # Alembic cannot compare expression indexes (priority DESC) on SQLite: check that one by name instead.
    diff = [d for d in diff if not (d[0].endswith("_index") and d[1].name in EXPRESSION_INDEXES)]
    assert diff == []
    assert set(EXPRESSION_INDEXES) <= {ix["name"] for ix in inspect(db).get_indexes("jobs")}
    # ... and as the models define them: on SQLite a batch migration of `jobs` rebuilt them from reflection, which
    # dropped their DESC, and every admission pass sorted the whole queue.
    for name in EXPRESSION_INDEXES:
        assert "priority DESC" in _index_sql(db, name), name


def _index_sql(db: Engine, name: str) -> str:
    with db.connect() as conn:
        if db.dialect.name == "sqlite":
            return str(conn.execute(text("SELECT sql FROM sqlite_master WHERE name = :n"), {"n": name}).scalar())
        return str(conn.execute(text("SELECT indexdef FROM pg_indexes WHERE indexname = :n"), {"n": name}).scalar())
    assert current(db) is not None
    upgrade(db)  # idempotent: a second start finds the schema at head


def test_db_upgrade_command(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    out = subprocess.run([sys.executable, "-m", "api.cli", "db", "upgrade"], cwd=ROOT, capture_output=True, text=True,
                         env={"SHUNTER_DATABASE_URL": url, "PATH": "/usr/bin:/bin"}, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "database at revision" in out.stdout
    assert current(make_engine(url)) is not None


def test_specs_stored_by_the_previous_release_read_back_after_upgrade(tmp_path: Path) -> None:
    """The previous release wrote every default out, the DeepSpeed short form next to a full config included: such a
    row failed validation when the dispatcher read it back (issue 11). The upgrade rewrites it to the spec sent."""
    engine = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    upgrade(engine, "075fa942e034")
    sent = {"entrypoint": {"callable": "examples.gpt2_tiny:train_loop"}, "resources": {"num_workers": 2},
            "strategy": {"kind": "deepspeed", "deepspeed": {"config": {"gradient_accumulation_steps": 4,
                                                                      "zero_optimization": {"stage": 3}}}}}  # fmt: skip
    old_dump = JobSpec.model_validate(sent).model_dump(mode="json")
    old_dump["strategy"]["gradient_accumulation_steps"] = 1  # as the previous release's model filled them in
    old_dump["strategy"]["deepspeed"].update(zero_stage=2, offload_optimizer="none", offload_param="none",
                                             overlap_comm=False)  # fmt: skip
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO jobs (id, name, owner, queue, priority, state, spec, attempt, cancel_requested, "
                 "created_at, updated_at, preemptions) VALUES ('j1', 'job', 'a', 'default', 0, 'QUEUED', :spec, 0, 0, "
                 "'2026-11-01 00:00:00', '2026-11-01 00:00:00', 0)"),
            {"spec": json.dumps(old_dump)},
        )  # fmt: skip
    upgrade(engine)
    with Session(engine) as session:
        row = session.get(Job, "j1")
        assert row is not None
        assert JobSpec.model_validate(row.spec) == JobSpec.model_validate(sent)


def test_every_enum_value_of_the_models_is_in_the_migrated_database(db: Engine) -> None:
    """compare_metadata does not compare enum members: a value added to a model's Enum needs its own migration on
    PostgreSQL (ALTER TYPE ... ADD VALUE), or the first write of it fails there, and only there."""
    wanted: dict[str, set[str]] = {}
    for table in SQLModel.metadata.tables.values():
        for column in table.columns:
            if isinstance(column.type, sa.Enum) and column.type.name:
                wanted.setdefault(column.type.name, set()).update(column.type.enums)
    assert {"jobstate", "endreason"} <= set(wanted)
    if db.dialect.name != "postgresql":
        # SQLite stores enums as VARCHAR without a CHECK: any member reads back; the lengths must fit.
        for table in SQLModel.metadata.tables.values():
            for column in table.columns:
                if isinstance(column.type, sa.Enum) and column.type.length is not None:
                    assert column.type.length >= max(len(v) for v in column.type.enums), column
        return
    with db.connect() as conn:
        rows = conn.execute(text("SELECT t.typname, e.enumlabel FROM pg_enum e JOIN pg_type t ON t.oid = e.enumtypid"))
        have: dict[str, set[str]] = {}
        for name, label in rows:
            have.setdefault(name, set()).add(label)
    missing = {name: sorted(values - have.get(name, set())) for name, values in wanted.items()}
    assert {k: v for k, v in missing.items() if v} == {}
