"""One bad job never stops the others (issue 11): poisoned rows ahead of good jobs, on SQLite and PostgreSQL.

A real dispatcher, a real database and the noop backend (a real cross-process implementation of the backend
protocol: what is under test is the dispatcher's handling of the job, not Ray). Each poison was seen to stop
admission, wedge a job or abort the tick on the dispatcher before this test was written.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text, update
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col, select

from service.backends.noop import NoopJobs
from service.config.settings import Settings
from service.core.backend import ClusterView, NodeView, RayJobInfo, submission_id
from service.dispatch.dispatcher import Dispatcher
from service.lifecycle.jobs import submit
from service.spec.job import JobSpec
from service.store.db import make_engine
from service.store.models import Attempt, EndReason, Job, JobEvent, JobState, utcnow
from service.tenancy.auth import Caller

GOOD = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}
FULL_DS_CONFIG = {  # the curl: a full DeepSpeed config, accepted with 201, then stopped admission for all
    "entrypoint": {"callable": "examples.gpt2_tiny:train_loop"}, "config": {"steps": 6},
    "strategy": {"kind": "deepspeed", "deepspeed": {"config": {"zero_optimization": {"stage": 3}}}},
    "resources": {"num_workers": 2},
}  # fmt: skip


class Backend(NoopJobs):
    """The noop backend, with a cluster answer that a test can make malformed, and whose running jobs hold
    `held_per_job` CPUs each (the plain noop backend reports all of its room free at all times)."""

    malformed = False
    held_per_job = 0.0

    def cluster(self) -> ClusterView:
        if self.malformed:
            return ClusterView(nodes=[NodeView("n1", "127.0.0.1", True, {"CPU": "lots"}, {"CPU": float("nan")})])
        view = super().cluster()
        running = sum(1 for i in self.list_submission_ids() if (info := self.info(i)) and not info.is_terminal)
        view.nodes[0].available["CPU"] = max(0.0, self.cpus - self.held_per_job * running)
        return view


@pytest.fixture
def make(db: Engine, tmp_path: Path) -> Iterator[Callable[..., tuple[Dispatcher, Backend]]]:
    made: list[Dispatcher] = []

    def _make(*, cpus: float = 64, run_seconds: float = 0.0, data_dir: Path | None = None, **settings: Any):
        backend = Backend(tmp_path / "noop", cpus=cpus, run_seconds=run_seconds)
        conf = Settings(database_url="sqlite://", data_dir=data_dir or tmp_path / "data",
                        storage_uri=str(tmp_path / "ckpt"), lease_seconds=30, **settings)  # fmt: skip
        disp = Dispatcher(engine=db, settings=conf, ray=backend, owner="d1")
        made.append(disp)
        return disp, backend

    yield _make
    for disp in made:
        disp._pool.shutdown(wait=True)


def add(db: Engine, spec: dict[str, Any], *, priority: int = 0) -> str:
    with Session(db) as session:
        job, _ = submit(session, JobSpec.model_validate({**spec, "priority": priority}), caller=Caller("alice"))
        session.commit()
        return job.id


def poison(db: Engine, job_id: str, spec: dict[str, Any]) -> None:
    """Write a spec the API would refuse straight into the row, as an older release or a bad migration could."""
    with Session(db) as session:
        session.execute(update(Job).where(col(Job.id) == job_id).values(spec=spec))
        session.commit()


def job(db: Engine, job_id: str) -> Job:
    with Session(db) as session:
        row = session.get(Job, job_id)
        assert row is not None
        return row


def events(db: Engine, job_id: str) -> list[JobEvent]:
    with Session(db) as session:
        return list(session.exec(select(JobEvent).where(JobEvent.job_id == job_id).order_by(col(JobEvent.id))).all())


def run_until(disp: Dispatcher, done: Callable[[], bool], *, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        disp.tick()
        if done():
            return
        time.sleep(0.05)
    raise AssertionError("the jobs did not reach their end in time")


def ended(db: Engine, *ids: str) -> Callable[[], bool]:
    return lambda: all(JobState(job(db, i).state).is_terminal for i in ids)


def test_the_full_deepspeed_config_job_is_admitted_and_does_not_hold_up_the_next(make: Callable, db: Engine) -> None:
    disp, _ = make()
    ds, after = add(db, FULL_DS_CONFIG, priority=5), add(db, GOOD)
    run_until(disp, ended(db, ds, after))
    assert job(db, ds).state == JobState.SUCCEEDED
    assert job(db, after).state == JobState.SUCCEEDED


def test_poisoned_queued_rows_end_as_user_errors_and_good_jobs_behind_them_run(make: Callable, db: Engine) -> None:
    disp, backend = make()
    bad = {
        # Both the full config and the short form: what the old dump of the curl's spec looked like.
        "both forms": {**copy.deepcopy(FULL_DS_CONFIG),
                       "strategy": {"kind": "deepspeed", "deepspeed": {"zero_stage": 2, "config": {}}}},
        "not a spec": {"garbage": True},
        "superscript resume id": {**GOOD, "checkpoint": {"resume_from": "²"}},
        "30-digit resume id": {**GOOD, "checkpoint": {"resume_from": "9" * 30}},
        "nan workers": {**GOOD, "resources": {"num_workers": "NaN"}},
    }  # fmt: skip
    ids = {}
    for name, spec in bad.items():
        ids[name] = add(db, GOOD, priority=10)
        poison(db, ids[name], spec)
    good = [add(db, GOOD) for _ in range(3)]
    run_until(disp, ended(db, *ids.values(), *good))
    assert [job(db, g).state for g in good] == [JobState.SUCCEEDED] * 3
    for name, job_id in ids.items():
        row = job(db, job_id)
        assert (row.state, row.end_reason) == (JobState.FAILED, EndReason.USER_ERROR), name
        assert row.last_error and row.last_error.startswith("spec:"), (name, row.last_error)
        assert backend.info(submission_id(job_id, 1)) is None, f"{name}: never reached the backend"


def test_a_resume_id_that_names_no_checkpoint_fails_that_job_only(make: Callable, db: Engine) -> None:
    disp, backend = make()
    missing = add(db, {**GOOD, "checkpoint": {"resume_from": "123456"}}, priority=10)
    good = add(db, GOOD)
    run_until(disp, ended(db, missing, good))
    row = job(db, missing)
    assert (row.state, row.end_reason) == (JobState.FAILED, EndReason.USER_ERROR)
    assert "checkpoint.resume_from" in (row.last_error or "")
    assert backend.info(submission_id(missing, 1)) is None
    assert job(db, good).state == JobState.SUCCEEDED


def test_a_job_admitted_by_an_older_release_with_a_bad_resume_id_is_not_wedged(make: Callable, db: Engine) -> None:
    """The old dispatcher left such a job STARTING for ever with its resources reserved."""
    disp, _ = make()
    wedged = add(db, GOOD, priority=10)
    now = utcnow()
    with Session(db) as session:  # as the old code left it: admitted, leased to us, its submission never built
        session.execute(update(Job).where(col(Job.id) == wedged).values(
            state=JobState.STARTING, attempt=1, lease_owner="d1", lease_token="t", lease_expires_at=now,
            spec={**GOOD, "checkpoint": {"resume_from": "²"}}))  # fmt: skip
        session.add(Attempt(job_id=wedged, number=1, submission_id=submission_id(wedged, 1), started_at=now))
        session.commit()
    good = add(db, GOOD)
    run_until(disp, ended(db, wedged, good))
    row = job(db, wedged)
    assert (row.state, row.end_reason) == (JobState.FAILED, EndReason.USER_ERROR)
    assert "resume_from" in (row.last_error or "")
    assert job(db, good).state == JobState.SUCCEEDED


def test_a_tick_that_cannot_read_the_cluster_still_reconciles_what_it_holds(make: Callable, db: Engine) -> None:
    disp, backend = make(run_seconds=0.5)
    held = add(db, GOOD)
    disp.tick()  # admitted and submitted
    assert job(db, held).state == JobState.STARTING
    backend.malformed = True
    queued = add(db, GOOD)
    run_until(disp, ended(db, held))
    assert job(db, held).state == JobState.SUCCEEDED
    assert job(db, queued).state == JobState.QUEUED  # nothing is admitted on a view that cannot be trusted
    backend.malformed = False
    run_until(disp, ended(db, queued))


def test_a_log_that_cannot_be_kept_is_an_event_not_a_wedged_job(make: Callable, db: Engine, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "logs").write_text("a file where the logs directory should be")  # every keep_log fails with OSError
    disp, _ = make(data_dir=data)
    ids = [add(db, GOOD) for _ in range(3)]
    run_until(disp, ended(db, *ids))
    for job_id in ids:
        assert job(db, job_id).state == JobState.SUCCEEDED
        with Session(db) as session:
            attempt = session.exec(select(Attempt).where(Attempt.job_id == job_id)).one()
        assert attempt.log_uri is None
        assert any(e.kind == "host" and e.reason == "log_failed" for e in events(db, job_id))


def test_a_preemption_victim_whose_storage_cannot_be_written_does_not_stop_admission(
    make: Callable, db: Engine
) -> None:
    disp, backend = make(cpus=2, run_seconds=1.0, queues={"default": {"preemption": True}}, preemption_grace_seconds=0)
    backend.held_per_job = 2
    victim = add(db, {**GOOD, "resources": {"num_workers": 2}, "checkpoint": {"storage": "/proc/shunter/ckpt"}})
    disp.tick()
    assert job(db, victim).state == JobState.STARTING
    urgent = add(db, {**GOOD, "resources": {"num_workers": 2}}, priority=100)
    run_until(disp, ended(db, victim, urgent))
    assert job(db, urgent).state == JobState.SUCCEEDED
    assert job(db, victim).state == JobState.SUCCEEDED
    kinds = [(e.kind, e.reason) for e in events(db, victim)]
    assert ("preemption", "preemption_requested") in kinds
    assert ("host", "preemption_notice_failed") in kinds
    assert job(db, victim).preemptions == 1


class SaysFailedWithNul(Backend):
    """Ray ends every job FAILED with a message holding a NUL, as a log tail of binary output does."""

    def info(self, submission_id: str) -> RayJobInfo | None:
        found = super().info(submission_id)
        if found is None:
            return None
        return RayJobInfo(submission_id, "FAILED", message="exit 1, last logs: before\x00after", driver_exit_code=1)


def test_a_nul_in_what_ray_says_of_a_job_does_not_make_its_end_unwritable(db: Engine, tmp_path: Path) -> None:
    """PostgreSQL text cannot hold NUL: before service.store.db scrubbed it, the job's end failed to commit on every
    tick and the job stayed RUNNING for ever, holding its quota."""
    backend = SaysFailedWithNul(tmp_path / "noop")
    conf = Settings(database_url="sqlite://", data_dir=tmp_path / "data", storage_uri=str(tmp_path / "ckpt"))
    disp = Dispatcher(engine=db, settings=conf, ray=backend, owner="d1")
    try:
        job_id = add(db, {**GOOD, "retries": {"max_attempts": 1}})
        run_until(disp, ended(db, job_id))
    finally:
        disp._pool.shutdown(wait=True)
    row = job(db, job_id)
    assert row.state == JobState.FAILED and row.end_reason == EndReason.INFRA
    assert row.last_error is not None and "before" in row.last_error and "after" in row.last_error
    if db.dialect.name == "postgresql":
        assert "before\ufffdafter" in row.last_error


def _add_missing_schema(conn: Connection) -> None:
    """The current models' tables and columns that the database lacks, added as they are (no enum type changes)."""
    from sqlalchemy import inspect
    from sqlmodel import SQLModel

    import service.store.db  # noqa: F401  (imports every table module)

    have = inspect(conn)
    tables = set(have.get_table_names())
    for table in SQLModel.metadata.sorted_tables:
        if table.name not in tables:
            table.create(conn)
            continue
        present = {c["name"] for c in have.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            kind = column.type.compile(dialect=conn.dialect)
            default = column.server_default.arg if column.server_default is not None else None
            tail = f" NOT NULL DEFAULT {default}" if default is not None and not column.nullable else ""
            conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}{tail}'))


def test_a_write_the_database_refuses_ends_that_job_after_patience_not_never(tmp_path: Path) -> None:
    """A database the new release did not migrate yet lacks the end reason `cluster_restarted` (PostgreSQL enum):
    recording that one attempt's end fails with a DataError on every tick. The job is given up on after
    `job_fault_patience_seconds`, as any job shunter cannot handle, and the others carry on."""
    from service.store.migrate import upgrade
    from tests.service.conftest import fresh_pg_database

    with fresh_pg_database("shunter_oldschema") as url:
        engine = make_engine(url)
        try:
            upgrade(engine, "c4d2e8a17f30")  # the schema of the release before the enum value was migrated
            with engine.begin() as conn:  # with the tables and columns later releases added (the enum value stays
                _add_missing_schema(conn)  # missing): every release's own, read off the models, so none is forgotten
            backend = Backend(tmp_path / "noop", run_seconds=60)
            conf = Settings(database_url="sqlite://", data_dir=tmp_path / "data", storage_uri=str(tmp_path / "c"),
                            job_fault_patience_seconds=1.0)  # fmt: skip
            disp = Dispatcher(engine=engine, settings=conf, ray=backend, owner="d1")
            try:
                lost = add(engine, GOOD)
                disp.tick()
                assert job(engine, lost).state in (JobState.STARTING, JobState.RUNNING)
                (backend.dir / submission_id(lost, 1)).unlink()  # Ray forgot it: its head restarted
                backend.run_seconds = 0.0
                good = add(engine, GOOD)
                run_until(disp, ended(engine, lost, good), seconds=30)
            finally:
                disp._pool.shutdown(wait=True)
            assert job(engine, good).state == JobState.SUCCEEDED
            gave_up = job(engine, lost)
            assert gave_up.state == JobState.FAILED and gave_up.end_reason == EndReason.INFRA
            assert "could not handle this job" in (gave_up.last_error or "") and "DataError" in gave_up.last_error
        finally:
            engine.dispose()
