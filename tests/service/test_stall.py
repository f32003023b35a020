"""Hang detection (issue 17): the stall timeout's policy as a table (service.policy.stall), then a real dispatcher on
both databases, on the service's clock (a `VirtualClock`), with the noop backend (a working implementation of the
backend protocol without Ray: what is under test is which attempt is called stalled and when, not Ray; the stacks
themselves are proven on real Ray in test_stall_e2e.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.backends.noop import NoopJobs
from service.config.settings import Settings
from service.core import clock
from service.dispatch.dispatcher import Dispatcher
from service.lifecycle import reports
from service.lifecycle.jobs import submit
from service.policy.stall import StallPolicy, longest_interval, stacks_submission_id, stall_timeout
from service.spec.job import JobSpec
from service.store.models import EndReason, Job, JobEvent, JobState
from service.tenancy.auth import Caller

T0 = datetime(2026, 12, 2, 12, tzinfo=timezone.utc)
POLICY = StallPolicy(detect=True, min_seconds=600, factor=10)


def at(*seconds: float) -> list[datetime]:
    return [T0 + timedelta(seconds=s) for s in seconds]


@pytest.mark.parametrize(
    ("explicit", "times", "policy", "expected"),
    [
        pytest.param(30.0, at(0, 1, 2), POLICY, 30.0, id="the-spec's-own-timeout-wins"),
        pytest.param(30.0, [], StallPolicy(detect=False), 30.0, id="the-spec's-own-timeout-even-with-detection-off"),
        pytest.param(None, at(0, 1, 2), StallPolicy(detect=False), None, id="detection-off-no-default"),
        pytest.param(None, [], POLICY, 600.0, id="no-interval-known-the-minimum"),
        pytest.param(None, at(0), POLICY, 600.0, id="one-report-the-minimum"),
        pytest.param(None, at(0, 5, 10, 15), POLICY, 600.0, id="fast-steps-the-minimum"),
        pytest.param(None, at(0, 100, 130), POLICY, 1000.0, id="ten-times-the-longest-interval"),
        pytest.param(None, at(130, 0, 100, 100), POLICY, 1000.0, id="order-and-repeats-do-not-matter"),
        pytest.param(None, at(0, 50, 100), StallPolicy(min_seconds=5, factor=3), 150.0, id="other-settings"),
    ],
)  # fmt: skip
def test_stall_timeout(
    explicit: float | None, times: list[datetime], policy: StallPolicy, expected: float | None
) -> None:
    got = stall_timeout(explicit, times, policy)
    assert (got[0] if got else None) == expected
    if got is not None:
        assert got[1]  # it always says where it comes from


def test_longest_interval_and_the_dump_job_names() -> None:
    assert longest_interval([]) is None and longest_interval(at(3, 3)) is None
    assert longest_interval(at(0, 10, 15, 45)) == 30.0
    first, later = stacks_submission_id("shunter-j1-2", T0), stacks_submission_id("shunter-j1-2", at(60)[0])
    assert first.startswith("shunter-j1-2-stacks-") and first != later  # one dump job per stall of an attempt


# ---- a real dispatcher on both databases ---------------------------------------------------------------------------
@pytest.fixture
def run(db: Engine, tmp_path: Path) -> Iterator[Any]:
    """(dispatcher, clock) with stall settings of `settings`; jobs stay RUNNING on the noop backend for an hour."""
    made: list[Dispatcher] = []
    virtual = clock.VirtualClock(T0)

    def make(**settings: Any) -> Dispatcher:
        conf = Settings(database_url="sqlite://", data_dir=tmp_path / "data", storage_uri=str(tmp_path / "ckpt"),
                        lease_seconds=100_000, **settings)  # fmt: skip
        disp = Dispatcher(engine=db, settings=conf, ray=NoopJobs(tmp_path / "noop", run_seconds=3600), owner="d1")
        made.append(disp)
        return disp

    with clock.use(virtual):
        yield make, virtual
    for disp in made:
        disp._pool.shutdown(wait=True)


def add(db: Engine, **spec: Any) -> str:
    body = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1},
            "retries": {"max_attempts": 1}, **spec}  # fmt: skip
    with Session(db) as session:
        job, _ = submit(session, JobSpec.model_validate(body), caller=Caller("alice"))
        session.commit()
        return job.id


def job(db: Engine, job_id: str) -> Job:
    with Session(db) as session:
        found = session.get(Job, job_id)
        assert found is not None
        return found


def stall_events(db: Engine, job_id: str) -> list[JobEvent]:
    with Session(db) as session:
        query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "stall").order_by(col(JobEvent.id))
        return list(session.exec(query).all())


def running(db: Engine, disp: Dispatcher, job_id: str) -> None:
    disp.tick()  # admitted and submitted
    assert reports.record_started(db, job_id=job_id, attempt=1)
    disp.tick()
    assert job(db, job_id).state == JobState.RUNNING


def report(db: Engine, job_id: str, step: int, **metrics: float) -> None:
    assert reports.record_report(db, job_id=job_id, attempt=1, metrics={"step": step, **metrics})


def test_a_loop_that_stops_reporting_is_stalled_after_its_timeout_and_its_stacks_asked_for(db: Engine, run) -> None:
    make, virtual = run
    disp = make()
    job_id = add(db, stall_timeout_seconds=30)
    running(db, disp, job_id)
    for step in (1, 2, 3):
        virtual.advance(2)
        report(db, job_id, step, loss=1.0 / step)
        disp.tick()
    virtual.advance(29)
    disp.tick()
    assert job(db, job_id).stalled_at is None and stall_events(db, job_id) == []  # 29 s: not yet
    virtual.advance(1)
    disp.tick()
    asked = job(db, job_id)
    assert asked.stalled_at == virtual.now() and asked.state == JobState.RUNNING
    first, dump = stall_events(db, job_id)
    assert first.reason == "stalled" and "no progress report for 30s since step 3" in (first.message or "")
    assert "stall_timeout_seconds=30" in (first.message or "")
    assert dump.reason == "stack_dump" and "no stacks to dump" in (dump.message or "")
    virtual.advance(1)
    disp.tick()
    assert job(db, job_id).state == JobState.RUNNING  # the stacks get their time to reach the log
    virtual.advance(3)
    for _ in range(3):  # stop, then Ray says STOPPED, then the attempt ends
        disp.tick()
    ended = job(db, job_id)
    assert ended.state == JobState.FAILED and ended.end_reason == EndReason.STALLED
    assert "no progress report for 34s since step 3" in (ended.last_error or "")
    assert "no stack dump ran" in (ended.last_error or "")  # the noop backend has no processes: it says so


def test_a_loop_that_never_reports_is_never_stalled(db: Engine, run) -> None:
    make, virtual = run
    disp = make(stall_min_seconds=5, stall_factor=2)
    job_id = add(db, stall_timeout_seconds=5)
    running(db, disp, job_id)  # every rank started (step 0): not a progress report
    for _ in range(4):
        virtual.advance(600)
        disp.tick()
    quiet = job(db, job_id)
    assert quiet.state == JobState.RUNNING and quiet.stalled_at is None and stall_events(db, job_id) == []


def test_a_report_after_the_stacks_were_asked_for_means_it_recovered(db: Engine, run) -> None:
    make, virtual = run
    disp = make()
    job_id = add(db, stall_timeout_seconds=10)
    running(db, disp, job_id)
    report(db, job_id, 1)
    virtual.advance(10)
    disp.tick()
    assert len(stall_events(db, job_id)) == 2
    virtual.advance(1)
    report(db, job_id, 2)  # a slow step after all
    virtual.advance(9)
    disp.tick()
    assert job(db, job_id).state == JobState.RUNNING and len(stall_events(db, job_id)) == 2
    virtual.advance(1)
    disp.tick()  # quiet 10 s again: a stall of its own, with its own dump
    events = stall_events(db, job_id)
    assert [e.reason for e in events] == ["stalled", "stack_dump"] * 2
    assert "since step 2" in (events[2].message or "")
    assert job(db, job_id).state == JobState.RUNNING


def test_the_default_timeout_is_derived_from_the_attempts_report_intervals(db: Engine, run) -> None:
    """min 20 s, factor 3, reports 10 s apart: stalled 30 s after the last one; nothing is asked of the database for
    a job that reported within the minimum."""
    make, virtual = run
    disp = make(stall_min_seconds=20, stall_factor=3)
    job_id = add(db)
    running(db, disp, job_id)
    for step in range(1, 5):
        virtual.advance(10)
        report(db, job_id, step, loss=1.0)
        disp.tick()
    assert disp.stalls._timeouts == {}  # quiet for less than the minimum each time: not worked out
    virtual.advance(29)
    disp.tick()
    assert job(db, job_id).stalled_at is None
    virtual.advance(1)
    disp.tick()
    (first, _dump) = stall_events(db, job_id)
    assert "stall timeout 30s: 3 x its longest recent interval between reports, 10s" in (first.message or ""), first


def test_with_detection_off_only_a_specs_own_timeout_is_watched(db: Engine, run) -> None:
    make, virtual = run
    disp = make(stall_detection=False, stall_min_seconds=5)
    default, own = add(db), add(db, stall_timeout_seconds=5)
    for job_id in (default, own):
        running(db, disp, job_id)
        report(db, job_id, 1)
    virtual.advance(60)
    disp.tick()
    assert stall_events(db, default) == [] and len(stall_events(db, own)) == 2
