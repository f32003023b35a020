"""Growing a running elastic job toward its max (issue 16): pure policy tables (service.policy.growth), then admission
passes on a real database: grow_requested, the yield, and the next attempt admitted larger with a `resized` event."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.policy.growth import Growable, grow
from service.policy.scheduler import Candidate, NodeFree

NOW = datetime(2026, 12, 2, 12, tzinfo=timezone.utc)


def job(job_id: str, size: int, least: int = 1, most: int = 8, *, prio: int = 0, ran: float = 900.0,
        cpu: float = 1.0) -> Growable:  # fmt: skip
    return Growable(Candidate(job_id, prio, 0.0, most, {"CPU": cpu}, "pack", "default", "alice", None, None, least),
                    size, ran)  # fmt: skip


def nodes(*cpus: float) -> list[NodeFree]:
    return [NodeFree(f"n{i}", {"CPU": c}) for i, c in enumerate(cpus)]


@pytest.mark.parametrize(
    ("jobs", "free", "waiting", "kw", "grown"),
    [
        pytest.param([job("e", 2)], (4,), [], {}, {"e": 6}, id="grows-into-free-room"),
        pytest.param([job("e", 2)], (16,), [], {}, {"e": 8}, id="never-past-max"),
        pytest.param([job("e", 2)], (2, 1), [], {}, {"e": 5}, id="across-nodes"),
        pytest.param([job("e", 8)], (4,), [], {}, {}, id="at-max-stays"),
        pytest.param([job("e", 2)], (0,), [], {}, {}, id="no-room-stays"),
        pytest.param([job("e", 2, prio=1)], (4,), [1], {}, {}, id="an-equal-priority-waiter-goes-first"),
        pytest.param([job("e", 2, prio=1)], (4,), [5], {}, {}, id="a-higher-priority-waiter-goes-first"),
        pytest.param([job("e", 2, prio=1)], (4,), [0], {}, {"e": 6}, id="a-lower-priority-waiter-does-not-hold-it"),
        pytest.param([job("e", 2, ran=30)], (4,), [], {}, {}, id="too-soon-after-its-start"),
        pytest.param([job("e", 4)], (1,), [], {"min_gain": 0.5}, {}, id="gain-too-small-for-a-restart"),
        pytest.param([job("e", 4)], (2,), [], {"min_gain": 0.5}, {"e": 6}, id="gain-worth-a-restart"),
        pytest.param([job("e", 2, cpu=2.0)], (3,), [], {}, {"e": 3}, id="whole-workers-only"),
        pytest.param([job("lo", 2, prio=0), job("hi", 2, prio=3)], (3,), [], {}, {"hi": 5}, id="higher-first"),
        pytest.param([job("a", 2, most=3), job("b", 2)], (4,), [], {}, {"a": 3, "b": 5}, id="each-takes-its-room"),
    ],
)  # fmt: skip
def test_grow(jobs: list[Growable], free: tuple[float, ...], waiting: list[int], kw: dict, grown: dict) -> None:
    assert grow(jobs, nodes(*free), waiting=waiting, after_seconds=600, **kw) == grown


def test_quotas_bound_the_growth() -> None:
    """The check sees only the extra resources on top of what the job holds; alice may add 1 CPU: 2 -> 3."""

    def check(cand: Candidate, extra: dict[str, float]) -> str | None:
        return "alice would exceed her CPUs" if extra.get("CPU", 0) > 1 else None

    assert grow([job("e", 2)], nodes(8), waiting=[], after_seconds=0, check=check) == {"e": 3}


# ---- admission passes on a real database ------------------------------------------------------------------------
def test_a_running_elastic_job_grows_through_a_yield_and_comes_back_larger(db: Engine) -> None:
    from service.config.settings import Settings
    from service.core.backend import ClusterView, NodeView
    from service.dispatch import admission
    from service.lifecycle.state import transition
    from service.spec.job import JobSpec
    from service.store.models import Attempt, EventKind, Job, JobEvent, JobState

    settings = Settings(elastic_grow_after_seconds=60)
    spec_of = lambda j: (JobSpec.model_validate(j.spec), None)  # noqa: E731
    resources_of = lambda j: JobSpec.model_validate(j.spec).resources.total(j.world_size)  # noqa: E731

    def admit(total: float, free: float, at: datetime) -> tuple[list[Job], list[Job]]:
        view = ClusterView([NodeView("n0", "127.0.0.1", True, {"CPU": total}, {"CPU": free})])
        return admission.admit(db, settings, view, owner="test", now=at, spec_of=spec_of, resources_of=resources_of)

    with Session(db) as session:
        session.add(Job(name="e", spec={"entrypoint": {"callable": "a:b"}, "resources": {"num_workers":
                        {"min": 1, "max": 6}}}, owner="alice", created_at=NOW))  # fmt: skip
        session.commit()
    started, _ = admit(8, 2, NOW)  # 2 of 8 CPUs free: it starts at 2
    assert [j.world_size for j in started] == [2]
    with Session(db) as session:
        row = session.exec(select(Job)).one()
        transition(session, row, to=JobState.RUNNING, reason="running", actor="test", lease_token=row.lease_token)
        session.commit()
    assert admit(8, 6, NOW + timedelta(seconds=30)) == ([], [])  # room appears, but the attempt is too young
    _, asked = admit(8, 6, NOW + timedelta(seconds=90))
    assert [j.name for j in asked] == ["e"]
    with Session(db) as session:
        row = session.exec(select(Job)).one()
        assert row.preempt_requested_at is not None
        said = session.exec(select(JobEvent).where(JobEvent.reason == "grow_requested")).one()
        assert said.kind == EventKind.RESIZED.value and "room for 6 workers (it runs 2)" in (said.message or "")
        # It yields (the dispatcher's PREEMPTED path) and is queued again: the next pass admits it at 6.
        transition(session, row, to=JobState.QUEUED, reason="preempted", actor="test", lease_token=row.lease_token,
                   values={"preempt_requested_at": None, "preemptions": 1})  # fmt: skip
        attempt = session.exec(select(Attempt)).one()
        attempt.ended_at = NOW + timedelta(seconds=95)
        session.add(attempt)
        session.commit()
    again, _ = admit(8, 8, NOW + timedelta(seconds=100))
    assert [j.world_size for j in again] == [6]
    with Session(db) as session:
        resized = session.exec(select(JobEvent).where(JobEvent.reason == "resized").order_by(col(JobEvent.id))).all()
        assert [e.message for e in resized] == [
            "grows from 2 to 6 workers (attempt 2 resumes from the latest checkpoint at the new size)"
        ]


def test_a_waiting_job_of_equal_priority_keeps_an_elastic_job_from_growing(db: Engine) -> None:
    from service.config.settings import Settings
    from service.core.backend import ClusterView, NodeView
    from service.dispatch import admission
    from service.lifecycle.state import transition
    from service.spec.job import JobSpec
    from service.store.models import Job, JobState

    settings = Settings(elastic_grow_after_seconds=0)
    spec_of = lambda j: (JobSpec.model_validate(j.spec), None)  # noqa: E731
    resources_of = lambda j: JobSpec.model_validate(j.spec).resources.total(j.world_size)  # noqa: E731
    with Session(db) as session:
        session.add(Job(name="e", spec={"entrypoint": {"callable": "a:b"}, "resources": {"num_workers":
                        {"min": 1, "max": 6}}}, owner="alice", created_at=NOW))  # fmt: skip
        session.commit()
    view = ClusterView([NodeView("n0", "127.0.0.1", True, {"CPU": 8.0}, {"CPU": 2.0})])
    admission.admit(db, settings, view, owner="t", now=NOW, spec_of=spec_of, resources_of=resources_of)
    with Session(db) as session:
        row = session.exec(select(Job)).one()
        transition(session, row, to=JobState.RUNNING, reason="running", actor="t", lease_token=row.lease_token)
        # A rigid 5-worker job of the same priority waits: 4 CPUs free are not enough for it, and not for e either.
        session.add(Job(name="big", spec={"entrypoint": {"callable": "a:b"}, "resources": {"num_workers": 5}},
                        owner="bob", created_at=NOW + timedelta(seconds=1)))  # fmt: skip
        session.commit()
    view = ClusterView([NodeView("n0", "127.0.0.1", True, {"CPU": 8.0}, {"CPU": 4.0})])
    started, asked = admission.admit(db, settings, view, owner="t", now=NOW + timedelta(seconds=5), spec_of=spec_of,
                                     resources_of=resources_of)  # fmt: skip
    assert (started, asked) == ([], [])
