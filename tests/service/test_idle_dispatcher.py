"""What an idle dispatcher costs (issue 34: an idle `shunter serve` at a 0.25 s tick spent ~0.27 of a core, most of it
on a write transaction at every tick): between its lease passes, with nothing queued and nothing held, a tick writes
nothing and reads no held jobs; it still admits a job posted meanwhile at its next tick, adopts a dead dispatcher's
job once that lease runs out, and reconciles what it gained either way to its end. SQLite and PostgreSQL, the noop
backend (a real cross-process backend: what is under test is the dispatcher's loop, not Ray)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from service.backends.noop import NoopJobs
from service.config.settings import Settings
from service.dispatch.dispatcher import Dispatcher
from service.store.models import JobState
from tests.service.test_poison import GOOD, add, ended, events, job, run_until


@pytest.fixture
def statements(db: Engine) -> Iterator[list[str]]:
    """Every SQL statement sent on `db` (the dispatcher's own, once a test clears what came before)."""
    sent: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
        sent.append(" ".join(statement.split()).upper())

    event.listen(db, "before_cursor_execute", seen)
    yield sent
    event.remove(db, "before_cursor_execute", seen)


def dispatcher(db: Engine, tmp_path: Path, owner: str, backend: NoopJobs, **settings: float) -> Dispatcher:
    conf = Settings(database_url="sqlite://", data_dir=tmp_path / owner, storage_uri=str(tmp_path / "ckpt"),
                    **settings)  # fmt: skip
    return Dispatcher(engine=db, settings=conf, ray=backend, owner=owner)


def writes(sent: list[str]) -> list[str]:
    return [s for s in sent if s.startswith(("INSERT", "UPDATE", "DELETE", "BEGIN IMMEDIATE"))]


def test_idle_ticks_write_nothing_yet_a_posted_job_is_admitted_and_run_to_its_end(
    db: Engine, tmp_path: Path, statements: list[str]
) -> None:
    backend = NoopJobs(tmp_path / "noop", cpus=8, run_seconds=0.2)
    disp = dispatcher(db, tmp_path, "d1", backend, lease_seconds=30)
    try:
        disp.tick()  # the first: leases renewed (and its own adopted), the cluster's snapshot stored
        assert any(s.startswith("UPDATE JOBS") for s in statements), statements
        assert any("CLUSTER_SNAPSHOT" in s for s in writes(statements)), writes(statements)
        statements.clear()
        for _ in range(8):
            disp.tick()
        assert writes(statements) == [], writes(statements)
        assert not [s for s in statements if "JOIN ATTEMPTS" in s], "an idle tick read the jobs it holds"

        posted = add(db, GOOD)
        disp.tick()
        assert job(db, posted).state in (JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED)
        run_until(disp, ended(db, posted))  # held since its admission: reconciled to the end
        assert job(db, posted).state == JobState.SUCCEEDED
    finally:
        disp._pool.shutdown(wait=True)


def test_an_idle_dispatcher_adopts_a_dead_ones_job_when_its_lease_runs_out_and_runs_it_to_its_end(
    db: Engine, tmp_path: Path, statements: list[str]
) -> None:
    backend = NoopJobs(tmp_path / "noop", cpus=8, run_seconds=30)
    dead, idle = (dispatcher(db, tmp_path, name, backend, lease_seconds=1.0) for name in ("dead", "idle"))
    try:
        idle.tick()  # holds nothing from here on, and knows it
        orphan = add(db, GOOD)
        dead.tick()  # admits it, then is never heard from again
        assert job(db, orphan).lease_owner == "dead"
        backend.run_seconds = 0.2  # what the noop job runs from its next read on
        run_until(idle, ended(db, orphan))  # its lease passes come every lease_seconds / 5
        assert job(db, orphan).state == JobState.SUCCEEDED
        adopted = [(e.actor, e.message) for e in events(db, orphan) if e.reason == "adopted"]
        assert adopted == [("idle", "lease taken over from dead")], adopted
    finally:
        for disp in (dead, idle):
            disp._pool.shutdown(wait=True)
