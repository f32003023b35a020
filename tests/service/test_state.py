"""The state table, on a real SQLite file and a real PostgreSQL database."""

from __future__ import annotations

import itertools

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.core.errors import IllegalTransition, StaleWrite
from service.lifecycle.state import ALLOWED, is_allowed, transition
from service.store.db import session_scope
from service.store.models import Job, JobEvent, JobState

S = JobState


def make_job(session: Session, state: JobState = S.QUEUED, **kw: object) -> Job:
    job = Job(name="t", spec={"entrypoint": {"callable": "a:b"}}, state=state, **kw)
    session.add(job)
    session.commit()
    return job


def test_table_is_the_documented_machine() -> None:
    assert ALLOWED[S.QUEUED] == {S.STARTING, S.CANCELLED, S.FAILED}
    assert ALLOWED[S.STARTING] == {S.RUNNING, S.SUCCEEDED, S.FAILED, S.QUEUED, S.CANCELLING}
    assert ALLOWED[S.RUNNING] == {S.SUCCEEDED, S.FAILED, S.QUEUED, S.CANCELLING}
    assert ALLOWED[S.CANCELLING] == {S.CANCELLED, S.SUCCEEDED, S.FAILED}
    assert ALLOWED[S.SUCCEEDED] == set()
    for terminal in (S.FAILED, S.CANCELLED):
        assert ALLOWED[terminal] == {S.QUEUED}  # only an explicit retry leaves them


@pytest.mark.parametrize(("frm", "to"), [(a, b) for a, b in itertools.product(S, S) if not is_allowed(a, b)])
def test_every_illegal_transition_is_refused(db: Engine, frm: JobState, to: JobState) -> None:
    with Session(db) as session:
        job = make_job(session, frm)
        with pytest.raises(IllegalTransition):
            transition(session, job, to=to, reason="test")
        session.rollback()
        assert session.get(Job, job.id).state == frm
        assert session.exec(select(JobEvent).where(JobEvent.job_id == job.id)).all() == []


@pytest.mark.parametrize(("frm", "to"), [(a, b) for a, b in itertools.product(S, S) if is_allowed(a, b)])
def test_every_legal_transition_writes_exactly_one_event(db: Engine, frm: JobState, to: JobState) -> None:
    with Session(db) as session:
        job = make_job(session, frm)
        transition(session, job, to=to, reason="because", message="why")
        session.commit()
        row = session.get(Job, job.id)
        session.refresh(row)
        assert row.state == to
        events = session.exec(select(JobEvent).where(JobEvent.job_id == job.id)).all()
        assert [(e.from_state, e.to_state, e.reason, e.message) for e in events] == [(frm, to, "because", "why")]
        if to.is_terminal:
            assert row.finished_at is not None and row.lease_token is None


def test_stale_reader_loses_cleanly(db: Engine) -> None:
    """Two writers read QUEUED; the first wins, the second gets StaleWrite and writes no event."""
    with Session(db, expire_on_commit=False) as s:
        job_a = make_job(s)
        job_b = Job.model_validate(job_a.model_dump())  # a second reader's copy, read before the change
    with session_scope(db) as a:
        transition(a, job_a, to=S.STARTING, reason="admitted")
    with pytest.raises(StaleWrite), session_scope(db) as b:
        transition(b, job_b, to=S.CANCELLED, reason="cancel")
    with Session(db) as s:
        assert s.get(Job, job_a.id).state == S.STARTING
        assert len(s.exec(select(JobEvent).where(JobEvent.job_id == job_a.id)).all()) == 1


def test_write_fenced_by_lease_token(db: Engine) -> None:
    with Session(db) as session:
        job = make_job(session, S.RUNNING, lease_owner="d1", lease_token="new-token")
        with pytest.raises(StaleWrite):
            transition(session, job, to=S.SUCCEEDED, reason="done", lease_token="old-token")
        session.rollback()
        transition(session, job, to=S.SUCCEEDED, reason="done", lease_token="new-token")
        session.commit()
        assert session.get(Job, job.id).state == S.SUCCEEDED
