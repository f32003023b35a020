"""Issue 37: what a growing cluster's autoscaler is asked for. The demand is a pure function (queue, cluster and node
types in, bundles out), table-tested here; then whole admission passes on a real database (SQLite and PostgreSQL)
with a backend that keeps what it was asked (`NoopJobs.request_resources`): the request, its withdrawal, the
events and reasons, submission against declared node types, and fair share deciding whose gang is asked first.
The same against Ray's real autoscaler: tests/service/test_autoscaling.py (slow)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.config.settings import Settings
from service.core.backend import ClusterView, NodeView
from service.core.errors import InvalidSpec
from service.policy.demand import (
    Demand,
    NodeType,
    Running,
    bundles_of,
    check_node_types,
    could_hold,
    demand,
    may_preempt,
    waits_for_room,
)
from service.policy.scheduler import Candidate
from service.spec.job import JobSpec, Resources

NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)
CPU1 = {"CPU": 1.0}
ROOM = "waiting for room for 2 x {'CPU': 1.0}"


def cand(job_id: str, workers: int = 2, per: dict[str, float] | None = None, placement: str = "pack",
         min_workers: int | None = None) -> Candidate:  # fmt: skip
    return Candidate(job_id=job_id, priority=0, seq=0.0, num_workers=workers, per_worker=per or CPU1,
                     placement=placement, min_workers=min_workers)  # fmt: skip


CPU2 = NodeType("cpu2", {"CPU": 2.0}, 3)
T4 = NodeType("t4", {"CPU": 1.0, "accelerator_type:T4": 1.0}, 1)


@pytest.mark.parametrize(
    ("reason", "asked"),
    [
        (ROOM, True),
        ("held behind j0, which has waited longest for room", True),
        ("queue q1 is at its max of 2 running jobs", False),  # a cap: more nodes would not start it
        ("alice would exceed her quota of 4 CPUs", False),
        (None, False),  # admitted, or not in the pass
    ],
)
def test_only_jobs_waiting_for_room_are_asked_for(reason: str | None, asked: bool) -> None:
    assert waits_for_room(reason) is asked


@pytest.mark.parametrize(
    ("per", "workers", "placement", "bundles"),
    [
        (CPU1, 2, "pack", [CPU1, CPU1]),
        (CPU1, 2, "spread", [CPU1, CPU1]),
        (CPU1, 2, "strict_spread", [CPU1, CPU1]),  # bundles cannot say "one per node" (the module doc)
        (CPU1, 3, "strict_pack", [{"CPU": 3.0}]),  # one node for the whole group
        ({"CPU": 1.0, "GPU": 1.0}, 1, "pack", [{"CPU": 1.0, "GPU": 1.0}]),
    ],
)
def test_a_group_as_bundles(per: dict, workers: int, placement: str, bundles: list) -> None:
    assert bundles_of(per, workers, placement) == bundles


@pytest.mark.parametrize(
    ("candidate", "types", "holds"),
    [
        (cand("a", 2), [CPU2], True),
        (cand("a", 6), [CPU2], True),  # 3 nodes of 2 CPUs at their max
        (cand("a", 7), [CPU2], False),
        (cand("a", 7, min_workers=2), [CPU2], True),  # an elastic group needs its min
        (cand("a", 2, placement="strict_pack"), [CPU2], True),
        (cand("a", 3, placement="strict_pack"), [CPU2], False),  # no node type holds 3 CPUs
        (cand("a", 2, placement="strict_spread"), [T4], False),  # one t4 node at most
        (cand("a", 1, per={"CPU": 1.0, "accelerator_type:T4": 0.001}), [CPU2, T4], True),
        (cand("a", 2, per={"CPU": 1.0, "accelerator_type:T4": 0.001}), [CPU2, T4], False),
        (cand("a", 1, per={"CPU": 1.0, "accelerator_type:H100": 0.001}), [CPU2, T4], False),
    ],
)
def test_what_the_node_types_could_hold(candidate: Candidate, types: list, holds: bool) -> None:
    assert could_hold(candidate, types) is holds


def test_the_demand_holds_the_running_groups_then_the_first_waiting_ones_in_admission_order() -> None:
    ordered = [cand("b", 1), cand("q", 3), cand("a", 2), cand("c", 1), cand("big", 9)]
    waiting = {"b": ROOM, "q": "queue q1 is at its max of 1 running jobs", "a": ROOM, "c": ROOM, "big": ROOM}
    running = [Running("r", {"CPU": 2.0}, 1)]
    got = demand(ordered, waiting, running, max_jobs=2, node_types=[CPU2])
    assert got.jobs == ["b", "a"]  # q waits for its cap; only the first two waiting for room
    assert got.bundles == [{"CPU": 2.0}, CPU1, CPU1, CPU1]
    # Without node types nothing is left out for size; `big` (no type holds 9 workers) is left out with them.
    assert demand(ordered, waiting, running, max_jobs=9, node_types=[CPU2]).jobs == ["b", "a", "c"]
    assert demand(ordered, waiting, running, max_jobs=9).jobs == ["b", "a", "c", "big"]


def test_nothing_waiting_for_room_asks_for_nothing_so_idle_nodes_can_go() -> None:
    running = [Running("r", CPU1, 2)]
    assert demand([cand("q")], {"q": "queue q1 is at its max of 1 running jobs"}, running, max_jobs=8) == Demand()
    assert demand([], {}, running, max_jobs=8) == Demand()
    assert demand([cand("a")], {"a": ROOM}, running, max_jobs=0) == Demand()


def test_a_request_is_the_same_whatever_the_order_of_its_bundles() -> None:
    one = Demand([CPU1, {"GPU": 1.0}], ["a"])
    other = Demand([{"GPU": 1.0}, CPU1], ["b"])
    assert one.key() == other.key() and one.key() != Demand([CPU1], ["a"]).key()


def test_submission_refuses_a_group_no_node_type_can_hold() -> None:
    check_node_types(Resources(num_workers=6), [CPU2])
    with pytest.raises(InvalidSpec) as no:
        check_node_types(Resources(num_workers=2, accelerator_type="H100"), [CPU2, T4])
    assert no.value.field == "resources" and "no node type can hold 2 workers" in no.value.detail


def test_accelerator_type_is_a_sliver_of_rays_resource_and_means_the_raw_key() -> None:
    typed = Resources(num_workers=2, accelerator_type="T4")
    assert typed.per_worker() == {"CPU": 1.0, "accelerator_type:T4": 0.001}
    raw = Resources(num_workers=2, resources_per_worker={"accelerator_type:T4": 0.001})
    assert raw.per_worker() == typed.per_worker()
    with pytest.raises(ValueError, match="accelerator_type"):
        Resources(accelerator_type="H100; rm -rf /")


@pytest.mark.parametrize(
    ("in_request", "asked_ago", "grace", "preempts"),
    [
        (True, None, 120, False),  # asked for this very pass: the room may come
        (True, 30, 120, False),
        (True, 120, 120, True),  # the grace is over: preemption proceeds as it would without an autoscaler
        (False, None, 120, True),  # not in the request (past max_jobs): nothing to wait for
        (True, 0, 0, True),  # no grace set
    ],
)
def test_preemption_waits_for_the_autoscaler_within_the_grace(
    in_request: bool, asked_ago: float | None, grace: float, preempts: bool
) -> None:
    wanted = Demand([CPU1], ["hi"] if in_request else [])
    asked = {} if asked_ago is None else {"hi": NOW - timedelta(seconds=asked_ago)}
    assert may_preempt("hi", wanted, asked, NOW, grace) is preempts


# ---- admission passes on a real database, with a backend that keeps what it was asked ---------------------------
def _settings(tmp_path: Path, **kw: object) -> Settings:
    kw = {"queues": {"default": {}}, **kw}
    return Settings(cluster_may_grow=True, data_dir=tmp_path / "data", storage_uri=str(tmp_path / "ckpt"),
                    **kw)  # type: ignore[arg-type]  # fmt: skip


def _submit(db: Engine, settings: Settings, owner: str, workers: int, *, at: datetime, **res: object) -> str:
    from service.lifecycle import jobs
    from service.tenancy.auth import Caller

    spec = JobSpec.model_validate({"entrypoint": {"callable": "examples.mlp:train_loop"},
                                   "resources": {"num_workers": workers, **res}})  # fmt: skip
    with Session(db) as session:
        job, _ = jobs.submit(session, spec, caller=Caller(owner=owner), settings=settings)
        job.created_at = at
        session.add(job)
        session.commit()
        return job.id


def _dispatcher(db: Engine, settings: Settings, cpus: float, tmp_path: Path):  # type: ignore[no-untyped-def]
    from service.backends.noop import NoopJobs
    from service.dispatch.dispatcher import Dispatcher

    backend = NoopJobs(tmp_path / "noop", cpus=cpus, run_seconds=3600)
    return Dispatcher(engine=db, settings=settings, ray=backend, owner="d1"), backend


def _pass(disp, cpus: float) -> list[str]:  # type: ignore[no-untyped-def]
    view = ClusterView([NodeView("n0", "127.0.0.1", True, {"CPU": cpus}, {"CPU": cpus})])
    return disp.admit(view)


def test_a_dispatcher_asks_for_the_waiting_gang_and_withdraws_once_nothing_waits(db: Engine, tmp_path: Path) -> None:
    from service.lifecycle.jobs import cancel
    from service.store.models import Job, JobEvent

    settings = _settings(tmp_path)
    disp, backend = _dispatcher(db, settings, 0.0, tmp_path)
    job = _submit(db, settings, "alice", 2, at=NOW)
    assert _pass(disp, 0.0) == []
    assert backend.requested == [CPU1, CPU1]
    with Session(db) as session:
        row = session.get(Job, job)
        assert row is not None and "asked the autoscaler for room at" in (row.state_reason or "")
        said = session.exec(select(JobEvent).where(JobEvent.reason == "scale_requested")).one()
        assert said.job_id == job and said.kind == "scale"
    backend.requested = None
    _pass(disp, 0.0)
    assert backend.requested is None  # the same request is not sent again
    with Session(db) as session:  # one event however many passes
        assert len(session.exec(select(JobEvent).where(JobEvent.reason == "scale_requested")).all()) == 1
    # Room arrives: it starts, and says how long the room took; the request now holds its running group alone.
    assert _pass(disp, 2.0) == [job]
    with Session(db) as session:
        assert session.exec(select(JobEvent).where(JobEvent.reason == "capacity_arrived")).one().job_id == job
    assert backend.requested == []  # nothing waits for room: withdrawn
    # A job queued and cancelled before room came: asked for, then withdrawn.
    other = _submit(db, settings, "bob", 3, at=NOW)
    _pass(disp, 2.0)
    assert backend.requested == [CPU1, CPU1, CPU1, CPU1, CPU1]  # the running group's 2, the waiting one's 3
    from service.tenancy.auth import Caller

    with Session(db) as session:
        cancel(session, other, caller=Caller(owner="bob"))
        session.commit()
    _pass(disp, 2.0)
    assert backend.requested == []


def test_a_restarted_dispatcher_keeps_the_first_ask_and_replaces_a_request_left_standing(
    db: Engine, tmp_path: Path
) -> None:
    """A dispatcher that starts reads each waiting job's ask time back from its `scale_requested` event: no second
    event, and the scale-up timeout counts from the first ask, not from the restart. Its first pass sends its request
    whatever it is: with nothing waiting, an empty one replaces what an earlier dispatcher left standing in Ray."""
    from service.lifecycle.jobs import cancel
    from service.store.models import Job, JobEvent, JobState
    from service.tenancy.auth import Caller

    settings = _settings(tmp_path, scale_up_timeout_seconds=600)
    disp, _ = _dispatcher(db, settings, 0.0, tmp_path)
    job = _submit(db, settings, "alice", 2, at=NOW)
    _pass(disp, 0.0)
    first = disp.scaling.asked[job]
    again, backend = _dispatcher(db, settings, 0.0, tmp_path)  # a restart
    _pass(again, 0.0)
    assert again.scaling.asked[job] == first
    assert backend.requested == [CPU1, CPU1]  # its own request: the same gang
    with Session(db) as session:
        assert len(session.exec(select(JobEvent).where(JobEvent.reason == "scale_requested")).all()) == 1
    # The timeout counts from the first ask: a dispatcher started 601 s after it gives up at its first pass.
    with Session(db) as session:
        said = session.exec(select(JobEvent).where(JobEvent.reason == "scale_requested")).one()
        said.at -= timedelta(seconds=601)
        session.add(said)
        session.commit()
    late, _ = _dispatcher(db, settings, 0.0, tmp_path)
    _pass(late, 0.0)
    with Session(db) as session:
        row = session.get(Job, job)
        assert row is not None and row.state == JobState.FAILED and "within 600 s" in (row.last_error or "")
    # Nothing waits now; a request an earlier dispatcher sent is still in Ray: the next one to start replaces it.
    other = _submit(db, settings, "bob", 2, at=NOW)
    _pass(late, 0.0)
    with Session(db) as session:
        cancel(session, other, caller=Caller(owner="bob"))
        session.commit()
    fresh, backend = _dispatcher(db, settings, 0.0, tmp_path)
    backend.requested = [CPU1, CPU1]  # what Ray still holds
    _pass(fresh, 0.0)
    assert backend.requested == []


def test_fair_share_decides_whose_gang_is_asked_for_first(db: Engine, tmp_path: Path) -> None:
    """alice has used the cluster; bob has not: bob's gang is asked for first, though alice queued first."""
    from service.store.models import Attempt, Job, utcnow

    settings = _settings(tmp_path, scale_max_pending_jobs=1, fair_share={"half_life_hours": 24})
    now = utcnow()
    with Session(db) as session:  # an hour of 4 CPUs alice used, ended a minute ago
        used = Job(name="old", owner="alice", spec={}, state="SUCCEEDED", attempt=1, created_at=now)
        session.add(used)
        session.flush()
        session.add(Attempt(job_id=used.id, number=1, submission_id=f"shunter-{used.id}-1", cpus=4.0,
                            started_at=now - timedelta(hours=1), ended_at=now - timedelta(minutes=1)))  # fmt: skip
        session.commit()
    disp, backend = _dispatcher(db, settings, 0.0, tmp_path)
    alices = _submit(db, settings, "alice", 2, at=now - timedelta(seconds=2))
    bobs = _submit(db, settings, "bob", 3, at=now - timedelta(seconds=1))
    _pass(disp, 0.0)
    assert backend.requested == [CPU1, CPU1, CPU1]
    assert disp.scaling.sent is not None and disp.scaling.sent.jobs == [bobs]
    with Session(db) as session:
        rows = {j.id: j for j in session.exec(select(Job).where(col(Job.id).in_([alices, bobs]))).all()}
        assert "asked the autoscaler" in (rows[bobs].state_reason or "")
        assert "asked the autoscaler" not in (rows[alices].state_reason or "")


def test_with_node_types_a_job_none_can_hold_is_refused_at_submission(db: Engine, tmp_path: Path) -> None:
    types = {"cpu2": {"resources": {"CPU": 2}, "max": 3}, "t4": {"resources": {"CPU": 1, "accelerator_type:T4": 1},
                                                                 "max": 1}}  # fmt: skip
    from service.store.models import ClusterSnapshot

    settings = _settings(tmp_path, node_types=types)
    with Session(db) as session:  # a head that holds no workers, as an autoscaling cluster's does
        head = {"node_id": "h", "address": "127.0.0.1", "alive": True, "total": {"memory": 1e9}, "available": {}}
        session.add(ClusterSnapshot(id=1, nodes=[head], total={"memory": 1e9}, available={}))
        session.commit()
    _submit(db, settings, "alice", 6, at=NOW)  # today's cluster holds nothing; three cpu2 nodes would
    _submit(db, settings, "alice", 1, at=NOW, accelerator_type="T4")
    with pytest.raises(InvalidSpec) as refused:
        _submit(db, settings, "alice", 2, at=NOW, accelerator_type="T4")  # one t4 node at most
    assert refused.value.field == "resources"
    _submit(db, settings, "alice", 7, at=NOW)  # three cpu2 nodes and the t4 one
    with pytest.raises(InvalidSpec):
        _submit(db, settings, "alice", 8, at=NOW)


def test_with_node_types_a_job_none_can_hold_is_refused_before_any_dispatcher_has_read_the_cluster(
    db: Engine, tmp_path: Path
) -> None:
    """A service just started has no cluster snapshot yet: a submission then was taken in (a slow-tier run of the
    autoscaling test submitted that fast). The node types alone decide it."""
    types = {"cpu1": {"resources": {"CPU": 1}, "max": 2}, "t4": {"resources": {"CPU": 1, "accelerator_type:T4": 1},
                                                                 "max": 1}}  # fmt: skip
    settings = _settings(tmp_path, node_types=types)
    with pytest.raises(InvalidSpec) as refused:
        _submit(db, settings, "alice", 2, at=NOW, accelerator_type="T4")
    assert refused.value.field == "resources" and "no node type can hold 2 workers" in refused.value.detail
    _submit(db, settings, "alice", 2, at=NOW)  # two cpu1 nodes would


def test_without_node_types_a_job_whose_room_never_comes_fails_after_the_timeout(db: Engine, tmp_path: Path) -> None:
    from service.store.models import Job, JobState

    settings = _settings(tmp_path, scale_up_timeout_seconds=600)
    disp, backend = _dispatcher(db, settings, 0.0, tmp_path)
    job = _submit(db, settings, "alice", 2, at=NOW)
    _pass(disp, 0.0)
    assert job in disp.scaling.asked
    _pass(disp, 0.0)  # within the timeout: it waits
    with Session(db) as session:
        assert session.get(Job, job).state == JobState.QUEUED  # type: ignore[union-attr]
    disp.scaling.asked[job] -= timedelta(seconds=601)  # as if first asked for 601 s ago
    _pass(disp, 0.0)
    with Session(db) as session:
        row = session.get(Job, job)
        assert row is not None and row.state == JobState.FAILED and row.end_reason == "user_error"
        assert "did not grow to hold it within 600 s" in (row.last_error or "")
        assert "waiting for room for 2 x" in (row.last_error or "")  # the reason it waited
    # With node types declared, what could be held waits for as long as it takes.
    typed = _settings(tmp_path, scale_up_timeout_seconds=600, node_types={"c": {"resources": {"CPU": 2}, "max": 1}})
    disp, _ = _dispatcher(db, typed, 0.0, tmp_path)
    other = _submit(db, typed, "bob", 2, at=NOW)
    _pass(disp, 0.0)
    disp.scaling.asked[other] -= timedelta(seconds=601)
    _pass(disp, 0.0)
    with Session(db) as session:
        assert session.get(Job, other).state == JobState.QUEUED  # type: ignore[union-attr]


def test_a_high_priority_job_preempts_only_once_the_scale_up_grace_is_over(db: Engine, tmp_path: Path) -> None:
    from service.lifecycle.state import transition
    from service.store.models import Job, JobState

    settings = _settings(tmp_path, scale_up_grace_seconds=120, queues={"default": {"preemption": True}})
    disp, backend = _dispatcher(db, settings, 2.0, tmp_path)
    low = _submit(db, settings, "alice", 2, at=NOW)
    assert _pass(disp, 2.0) == [low]
    with Session(db) as session:
        row = session.get(Job, low)
        assert row is not None
        transition(session, row, to=JobState.RUNNING, reason="running", actor="test")
        session.commit()
    from service.lifecycle import jobs
    from service.tenancy.auth import Caller

    spec = JobSpec.model_validate({"entrypoint": {"callable": "examples.mlp:train_loop"}, "priority": 10,
                                   "resources": {"num_workers": 2}})  # fmt: skip
    with Session(db) as session:
        high, _ = jobs.submit(session, spec, caller=Caller(owner="bob"), settings=settings)
        session.commit()
        high_id = high.id

    def yielding() -> bool:
        with Session(db) as session:
            row = session.get(Job, low)
            return row is not None and row.preempt_requested_at is not None

    view = ClusterView([NodeView("n0", "127.0.0.1", True, {"CPU": 2.0}, {"CPU": 0.0})])
    disp.admit(view)
    assert backend.requested and high_id in disp.scaling.asked and not yielding()  # asked for; no one stopped
    disp.admit(view)
    assert not yielding()
    disp.scaling.asked[high_id] -= timedelta(seconds=121)  # the room has not come within the grace
    disp.admit(view)
    assert yielding()


def test_an_accelerator_name_ray_does_not_know_is_a_warning_on_the_job_not_a_refusal(
    db: Engine, tmp_path: Path
) -> None:
    from service.store.models import Job

    settings = _settings(tmp_path)
    known = _submit(db, settings, "alice", 1, at=NOW, accelerator_type="H100")
    typo = _submit(db, settings, "alice", 1, at=NOW, accelerator_type="H1OO")
    with Session(db) as session:
        assert session.get(Job, known).warnings is None  # type: ignore[union-attr]
        (said,) = session.get(Job, typo).warnings  # type: ignore[union-attr, misc]
        assert "'H1OO' is not one of Ray's accelerator names" in said


def test_the_start_estimate_counts_the_time_new_nodes_took_lately(db: Engine, tmp_path: Path) -> None:
    """A waiting job the current cluster never holds gets no estimate from the replay; asked of the autoscaler, it
    starts by the median time room took to come for the last jobs, counted from its own ask."""
    from service import estimate
    from service.lifecycle.state import record_event
    from service.store.models import EventKind, utcnow

    settings = _settings(tmp_path)
    now = utcnow()
    with Session(db) as session:
        for took in (10, 20, 300):  # three jobs whose room came after 10, 20 and 300 s: the median is 20
            old = _submit(db, settings, "bob", 1, at=now)
            at = now - timedelta(hours=1)
            record_event(session, old, kind=EventKind.SCALE, reason="scale_requested", attempt=None, at=at)
            record_event(session, old, kind=EventKind.SCALE, reason="capacity_arrived", attempt=1,
                         at=at + timedelta(seconds=took))  # fmt: skip
        session.commit()
    waiting = _submit(db, settings, "alice", 2, at=now)
    with Session(db) as session:
        assert estimate._compute(session, settings, now)[waiting].start is None  # nothing holds it now
        record_event(session, waiting, kind=EventKind.SCALE, reason="scale_requested", attempt=None,
                     at=now - timedelta(seconds=5))  # fmt: skip
        session.commit()
        got = estimate._compute(session, settings, now)[waiting].start
    assert got is not None and abs((got - now).total_seconds() - 15) < 0.01  # asked 5 s ago; room takes 20 s


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_the_upgrade_fills_in_the_accelerator_type_of_existing_jobs(kind: str, tmp_path: Path) -> None:
    """Jobs stored before `jobs.accelerator_type` have it set from their stored spec (the field, as the spec of that
    release could hold it), so their GPU-hours count by type after the upgrade."""
    import contextlib

    import sqlalchemy as sa

    from service.store.db import make_engine
    from service.store.migrate import upgrade
    from service.store.models import Job
    from tests.service.conftest import fresh_pg_database

    with contextlib.ExitStack() as stack:
        url = f"sqlite:///{tmp_path / 'old.db'}" if kind == "sqlite" else stack.enter_context(fresh_pg_database())
        engine = make_engine(url)
        stack.callback(engine.dispose)
        upgrade(engine, "e5b3c7a9d1f2")  # the revision before
        old = sa.Table("jobs", sa.MetaData(), autoload_with=engine)
        assert "accelerator_type" not in old.c
        typed = {"entrypoint": {"callable": "a:b"}, "resources": {"num_workers": 1, "accelerator_type": "A100"}}
        rows = [Job(name="typed", owner="a", spec=typed), Job(name="plain", owner="a", spec={"entrypoint": {}})]
        with engine.begin() as conn:
            conn.execute(sa.insert(old), [{c.name: getattr(r, c.name) for c in old.c} for r in rows])
        upgrade(engine)
        with Session(engine) as session:
            assert {j.name: j.accelerator_type for j in session.exec(select(Job)).all()} == {"typed": "A100",
                                                                                             "plain": None}  # fmt: skip
