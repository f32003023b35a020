"""Signals (service.store.signals) and what the dispatcher does with them, on a real SQLite file and a real PostgreSQL.

A dispatcher whose tick is 30 s here can only act within a second by a signal: a job posted, an attempt's driver
saying its run ended. The no-op backend stands in for Ray (its jobs stay RUNNING for an hour unless stopped): what
is tested is the dispatcher's own timing and records, not Ray's; tests/service/test_e2e_serve.py proves the driver's
word with real Ray.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.backends.noop import NoopJobs
from service.config.settings import Settings
from service.dispatch.dispatcher import Dispatcher
from service.lifecycle import reports
from service.lifecycle.jobs import submit
from service.spec.job import JobSpec
from service.store import signals
from service.store.models import Attempt, EndReason, Job, JobEvent, JobState
from service.tenancy.auth import Caller
from tests.conftest import wait_for

TICK = 30.0  # the dispatcher's tick here: what happens well before it was the work of a signal
SPEC = {"name": "sig", "entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}


@pytest.fixture(autouse=True)
def _hub_closed_after(db: Engine) -> Iterator[None]:
    """Each test's database is dropped after it: its hub's listener must not go on reconnecting to it."""
    yield
    signals.hub_for(db).close()


def listening(engine: Engine) -> signals.Hub:
    hub = signals.hub_for(engine)
    if hub.postgres:
        hub.subscribe(signals.EVENTS, lambda _: None)  # starts the listener
        assert hub.listening.wait(10), "the PostgreSQL listener did not connect"
    return hub


def test_a_signal_is_heard_after_its_commit_and_never_after_a_rollback(db: Engine) -> None:
    hub = listening(db)
    heard: list[str] = []
    got = threading.Event()

    def on(payload: str) -> None:
        heard.append(payload)
        got.set()

    unsubscribe = hub.subscribe(signals.ADMISSION, on)
    try:
        with Session(db) as session:
            signals.publish(session, signals.ADMISSION, "rolled-back")
            session.rollback()
        with Session(db) as session:
            signals.publish(session, signals.ADMISSION, "j1")
            signals.publish(session, signals.ADMISSION, "j1")
            signals.publish(session, signals.ADMISSION, "j2")
            assert not got.is_set(), "heard before the commit"
            session.commit()
        assert got.wait(5)
        wait_for(lambda: len(heard) >= 2, timeout=30, what="both payloads")
        time.sleep(0.3)  # anything else (the rolled-back one, a repeat) would have come by now
        assert sorted(heard) == ["j1", "j2"]
    finally:
        unsubscribe()


def test_postgres_carries_a_signal_from_another_connection(db: Engine) -> None:
    hub = listening(db)
    if not hub.postgres:
        pytest.skip("SQLite signals stay in their process; the dispatcher's tick covers the rest")
    waker = signals.Waker(db)
    try:
        dsn = db.url.set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(dsn, autocommit=True) as other:  # another process's connection, as far as PG knows
            other.execute("SELECT pg_notify('shunter_admission', 'job-a,job-b')")
        assert waker.wait(5), "the notification never arrived"
        wait_for(lambda: waker._heard >= {"job-a", "job-b"}, timeout=30, what="both job ids")
        assert waker.take() == {"job-a", "job-b"}
        assert not waker.event.is_set()
    finally:
        waker.close()


@pytest.fixture
def dispatcher(db: Engine, tmp_path: Path) -> Iterator[Dispatcher]:
    url = db.url.render_as_string(hide_password=False)
    settings = Settings(database_url=url, data_dir=tmp_path / "data", storage_uri=str(tmp_path / "ckpt"),
                        dispatcher_tick_seconds=TICK, driver_linger_seconds=1.0)  # fmt: skip
    listening(db)
    disp = Dispatcher(engine=db, settings=settings, owner="d1", ray=NoopJobs(tmp_path / "noop", run_seconds=3600))
    stop = threading.Event()
    thread = threading.Thread(target=disp.run, args=(stop,), daemon=True)
    thread.start()
    wait_for(lambda: disp._started and disp.last_tick_seconds > 0, timeout=30, what="the first tick")
    try:
        yield disp
    finally:
        stop.set()
        thread.join(timeout=30)


def state_event_at(engine: Engine, job_id: str, to: JobState) -> float | None:
    with Session(engine) as session:
        event = session.exec(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.to_state == to)).first()
    return None if event is None else event.at.timestamp()


def post(engine: Engine) -> tuple[str, float]:
    with Session(engine) as session:
        job, _ = submit(session, JobSpec.model_validate(SPEC), caller=Caller())
        session.commit()
        return job.id, time.time()


def test_a_job_posted_on_an_idle_cluster_starts_without_waiting_for_the_tick(db: Engine, dispatcher: Dispatcher):
    job_id, posted = post(db)
    wait_for(lambda: state_event_at(db, job_id, JobState.STARTING) is not None, timeout=TICK / 3, what="STARTING")
    started = state_event_at(db, job_id, JobState.STARTING)
    # The tick is 30 s: well under it, only the post's signal can have woken the dispatcher (bench.admission times it).
    assert started is not None and started - posted < TICK / 3, f"STARTING {started - posted:.3f}s after the post"


def test_a_job_written_in_one_statement_wakes_the_dispatcher_and_its_followers(db: Engine, dispatcher: Dispatcher):
    """POST /v1/jobs writes a job, its event and their signals in one statement on PostgreSQL (`written_at_once`):
    the signals still go out with its commit, to other processes (LISTEN) and this one's hub alike."""
    hub = listening(db)
    heard: list[str] = []
    hub.subscribe(signals.EVENTS, heard.append)
    with Session(db) as session:
        job, _ = submit(session, JobSpec.model_validate(SPEC), caller=Caller(), written_at_once=True)
        job_id = job.id
        session.commit()
    # The tick is 30 s: only the signal can have started it this soon.
    wait_for(lambda: state_event_at(db, job_id, JobState.STARTING) is not None, timeout=10, what="STARTING")
    wait_for(lambda: job_id in heard, timeout=10, what="the job's event signal")


def test_the_drivers_last_word_ends_the_attempt_at_once_and_its_log_is_kept_once_ray_is_done(
    db: Engine, dispatcher: Dispatcher
) -> None:
    job_id, _ = post(db)
    wait_for(lambda: state_event_at(db, job_id, JobState.STARTING) is not None, timeout=TICK / 3, what="STARTING")
    with Session(db) as session:
        attempt = session.exec(select(Attempt).where(Attempt.job_id == job_id)).one()
    wait_for(lambda: dispatcher.ray.info(attempt.submission_id) is not None, timeout=TICK / 3, what="submitted")
    said = time.time()
    assert reports.record_attempt_end(db, job_id=job_id, attempt=1, reason=EndReason.SUCCEEDED, message="succeeded")
    wait_for(lambda: state_event_at(db, job_id, JobState.SUCCEEDED) is not None, timeout=TICK / 3, what="SUCCEEDED")
    ended = state_event_at(db, job_id, JobState.SUCCEEDED)
    assert ended is not None and ended - said < TICK / 3, f"SUCCEEDED {ended - said:.3f}s after the driver's word"
    assert dispatcher.ray.info(attempt.submission_id).status == "RUNNING"  # Ray (here: no-op) was still at it
    with Session(db) as session:
        row = session.get(Attempt, attempt.id)
        assert row is not None and row.ray_status is None and row.log_uri is None and row.driver_ended_at is not None
    # Still running past driver_linger_seconds: stopped, with an event saying why; then its log is kept.
    time.sleep(1.1)
    dispatcher.late.step()
    assert dispatcher.ray.info(attempt.submission_id).status == "STOPPED"
    dispatcher.late.step()
    with Session(db) as session:
        row = session.get(Attempt, attempt.id)
        assert row is not None and row.ray_status == "STOPPED" and row.log_uri is not None
        assert Path(row.log_uri.removeprefix("file://")).read_text().startswith("noop job")
        reasons = [e.reason for e in session.exec(select(JobEvent).where(JobEvent.job_id == job_id)).all()]
        assert "ray_job_lingered" in reasons
        assert session.get(Job, job_id).state == JobState.SUCCEEDED  # the stop changed nothing of the job's end
    assert dispatcher.late.pending == {}


def test_a_ray_job_that_fails_after_its_attempt_succeeded_is_an_event_not_a_failure(
    db: Engine, dispatcher: Dispatcher
) -> None:
    """The attempt succeeded on every rank's word (workers.progress.announce_finished); Ray Train's teardown or the
    driver's exit then failed, so Ray calls the Ray Job FAILED: the job stays SUCCEEDED, and an event says so."""
    job_id, _ = post(db)
    wait_for(lambda: state_event_at(db, job_id, JobState.STARTING) is not None, timeout=TICK / 3, what="STARTING")
    with Session(db) as session:
        attempt = session.exec(select(Attempt).where(Attempt.job_id == job_id)).one()
    wait_for(lambda: dispatcher.ray.info(attempt.submission_id) is not None, timeout=TICK / 3, what="submitted")
    assert reports.record_attempt_end(db, job_id=job_id, attempt=1, reason=EndReason.SUCCEEDED, message="succeeded")
    wait_for(lambda: state_event_at(db, job_id, JobState.SUCCEEDED) is not None, timeout=TICK / 3, what="SUCCEEDED")
    dispatcher.ray.fail(attempt.submission_id)
    dispatcher.late.step()
    assert attempt.id not in dispatcher.late.pending
    with Session(db) as session:
        row = session.get(Attempt, attempt.id)
        assert row is not None and row.ray_status == "FAILED" and row.end_reason is EndReason.SUCCEEDED
        events = session.exec(select(JobEvent).where(JobEvent.job_id == job_id)).all()
        teardown = [e for e in events if e.reason == "ray_teardown_failed"]
        assert len(teardown) == 1 and "stays SUCCEEDED" in (teardown[0].message or "")
        assert session.get(Job, job_id).state == JobState.SUCCEEDED


def test_a_restarted_dispatcher_keeps_the_log_the_dead_one_left(db: Engine, dispatcher: Dispatcher, tmp_path: Path):
    job_id, _ = post(db)
    wait_for(lambda: state_event_at(db, job_id, JobState.STARTING) is not None, timeout=TICK / 3, what="STARTING")
    with Session(db) as session:
        attempt = session.exec(select(Attempt).where(Attempt.job_id == job_id)).one()
    wait_for(lambda: dispatcher.ray.info(attempt.submission_id) is not None, timeout=TICK / 3, what="submitted")
    reports.record_attempt_end(db, job_id=job_id, attempt=1, reason=EndReason.USER_ERROR, message="ValueError: x")
    wait_for(lambda: state_event_at(db, job_id, JobState.FAILED) is not None, timeout=TICK / 3, what="FAILED")
    with Session(db) as session:
        assert session.get(Job, job_id).last_error == "ValueError: x"  # the driver's words, not a placeholder
    dispatcher.late.pending.clear()  # as if it died before Ray's job ended
    dispatcher.ray.stop(attempt.submission_id)
    other = Dispatcher(engine=db, settings=dispatcher.settings, owner="d2", ray=dispatcher.ray)
    other.late.pick_up()
    assert set(other.late.pending) == {attempt.id}
    other.late.step()
    with Session(db) as session:
        row = session.get(Attempt, attempt.id)
        assert row is not None and row.ray_status == "STOPPED" and row.log_uri is not None


CANCEL_ELSEWHERE = """
import sys, time
from sqlmodel import Session
from service.store.db import make_engine
from service.tenancy.auth import Caller
from service.lifecycle.jobs import cancel
engine = make_engine(sys.argv[1])
with Session(engine) as session:
    cancel(session, sys.argv[2], caller=Caller())
    session.commit()
print(time.time(), flush=True)
"""


def _follow(url: str, job_id: str, seen: list[tuple[float, dict]], ended: threading.Event) -> None:
    import json

    import httpx

    try:
        with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", params={"follow": "true"}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append((time.time(), json.loads(line.removeprefix("data: "))))
    except httpx.HTTPError:
        pass  # the server went at the end of the test, cutting the streams still open
    finally:
        ended.set()


def test_an_event_stream_hears_a_new_event_at_once_not_at_its_next_read(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every stream's reads are set a minute apart: only the signal of the write can bring the cancel's event within
    a second. On PostgreSQL the cancel is written by another process (LISTEN/NOTIFY carries it), and the API process
    listens on one connection however many streams are open; on SQLite, where signals stay in their process (`serve`
    runs the dispatcher in the API's), by this one."""
    import subprocess
    import sys

    from api import sse
    from tests.live_api import live_api

    monkeypatch.setattr(sse, "SAFETY_POLL_SECONDS", 60.0)
    monkeypatch.setattr(sse, "POLL_SECONDS", 60.0)
    postgres = db.dialect.name == "postgresql"
    job_id, _ = post(db)
    others = [post(db)[0] for _ in range(4)]
    with live_api(db, tmp_path) as api:
        seen: list[tuple[float, dict]] = []
        ended = threading.Event()
        streams = [threading.Thread(target=_follow, args=(api.url, job_id, seen, ended), daemon=True)]
        quiet = [threading.Event() for _ in others]
        streams += [threading.Thread(target=_follow, args=(api.url, other, [], done), daemon=True)
                    for other, done in zip(others, quiet, strict=True)]  # fmt: skip
        for thread in streams:
            thread.start()
        wait_for(lambda: [e["to_state"] for _, e in seen] == ["QUEUED"], timeout=10, what="the stream's history")
        if postgres:
            wait_for(lambda: sse.followers_for(db).listening, timeout=10, what="the API's listener")
            listeners = _listening_connections(db)
            assert listeners == 1, f"{listeners} listening connections for 5 streams: one per process expected"
            url = db.url.render_as_string(hide_password=False)
            out = subprocess.run([sys.executable, "-c", CANCEL_ELSEWHERE, url, job_id], capture_output=True, text=True,
                                 timeout=60, check=True)  # fmt: skip
            committed = float(out.stdout.split()[-1])
        else:
            with Session(db) as session:
                from service.lifecycle.jobs import cancel

                cancel(session, job_id, caller=Caller())
                session.commit()
            committed = time.time()
        assert ended.wait(5), f"the stream did not end after the cancel: {seen}"
        arrived, last = seen[-1]
        assert last["to_state"] == "CANCELLED", seen
        # Heard by the signal, not by the streams' 10 s safety-net read (PostgreSQL).
        assert arrived - committed < 5.0, f"the cancel's event came {arrived - committed:.2f}s after its commit"
        assert not any(done.is_set() for done in quiet), "another job's stream ended"


def _listening_connections(engine: Engine) -> int:
    from sqlalchemy import text

    with engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                 "AND query LIKE 'LISTEN %'")).scalar_one()  # fmt: skip
