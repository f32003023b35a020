"""Node exclusion (issue 17): which nodes an attempt's end names, which a job's retries keep off, which everyone's
admissions keep off for a cool-down (pure tables); then on a real database (SQLite and PostgreSQL): an attempt end
recorded through `service.lifecycle.reports` writes the faults, admission keeps the job's next attempt off the node
(and tells the driver through the submission), never traps a job the rest of the cluster cannot hold, and an admin's
clear lets the node back in."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.config import policies
from service.policy.exclusion import Fault, Rules, for_everyone, for_job, named_nodes

NOW = datetime(2026, 12, 2, 9, 0, tzinfo=timezone.utc)
A, B, C = "a" * 56, "b" * 56, "c" * 56


def fault(node: str, job: str, reason: str, minutes_ago: float = 1.0, owner: str | None = None) -> Fault:
    return Fault(node, job, reason, NOW - timedelta(minutes=minutes_ago), owner=owner)


@pytest.mark.parametrize(
    ("reason", "message", "named"),
    [
        ("preflight_failed", f"pre-flight check failed: rank 1 on node_id='{A}' (10.0.0.2): sent 1002", [A]),
        ("worker_lost", f"ActorDiedError: ... node_id='{B}' ... node_id='{B}'", [B]),
        ("node_lost", f"gloo: Connection closed by peer. Lost nodes: {A}, {C}.", [A, C]),
        ("collective_timeout", f"timed out (node_id='{C}')", [C]),
        ("user_error", f"ValueError on node_id='{A}'", []),  # the job's own bug names no node at fault
        ("preflight_failed", "pre-flight check failed: the all-reduce hung with every rank in it", []),
        ("worker_lost", "node_id='xyz'", []),  # not a node id
    ],
)  # fmt: skip
def test_named_nodes(reason: str, message: str, named: list[str]) -> None:
    assert named_nodes(reason, message) == named


@pytest.mark.parametrize(
    ("faults", "kept"),
    [
        ([], {}),
        ([fault(A, "j", "preflight_failed")], {A: "failed the pre-flight check"}),
        ([fault(A, "j", "worker_lost")], {}),  # once may be the job's own doing
        ([fault(A, "j", "worker_lost"), fault(A, "j", "worker_lost")], {A: "2 attempts ended worker_lost there"}),
        ([fault(A, "j", "worker_lost"), fault(B, "j", "worker_lost")], {}),
        ([fault(A, "j", "collective_timeout")] * 2 + [fault(B, "j", "preflight_failed")],
         {A: "2 attempts ended collective_timeout there", B: "failed the pre-flight check"}),
        ([fault(A, "j", "node_lost")] * 3, {}),  # a lost node is gone: its id never comes back
    ],
)  # fmt: skip
def test_for_job(faults: list[Fault], kept: dict[str, str]) -> None:
    assert for_job(faults, Rules(repeats=2)) == kept


@pytest.mark.parametrize(
    ("faults", "rules", "kept"),
    [
        ([fault(A, "j1", "preflight_failed"), fault(A, "j2", "worker_lost")], Rules(jobs=3), {}),
        ([fault(A, f"j{i}", "preflight_failed") for i in range(3)], Rules(jobs=3), {A: ("j0", "j1", "j2")}),
        ([fault(A, "j1", "worker_lost")] * 5, Rules(jobs=3), {}),  # one job failing often is that job's exclusion
        ([fault(A, "j0", "preflight_failed", 40)] + [fault(A, f"j{i}", "worker_lost") for i in (1, 2)],
         Rules(jobs=3, cooldown=timedelta(minutes=30)), {}),  # the oldest is past the cool-down
        ([fault(A, "j0", "preflight_failed", 40)] + [fault(A, f"j{i}", "worker_lost") for i in (1, 2)],
         Rules(jobs=3, cooldown=timedelta(minutes=60)), {A: ("j0", "j1", "j2")}),
        ([fault(B, f"j{i}", "node_lost") for i in range(3)], Rules(jobs=3), {}),
        ([fault(A, "j1", "preflight_failed")], Rules(jobs=1), {A: ("j1",)}),
        # One owner's jobs alone never keep a node from everyone when two owners are needed (a job writes its own end)
        ([fault(A, f"j{i}", "preflight_failed", owner="mallory") for i in range(5)], Rules(jobs=3, owners=2), {}),
        ([fault(A, f"j{i}", "preflight_failed", owner=o) for i, o in enumerate(["m", "m", "alice"])],
         Rules(jobs=3, owners=2), {A: ("j0", "j1", "j2")}),
        ([fault(A, f"j{i}", "preflight_failed", owner=o) for i, o in enumerate(["m", "alice"])],
         Rules(jobs=3, owners=2), {}),  # two owners but not three jobs
    ],
)  # fmt: skip
def test_for_everyone(faults: list[Fault], rules: Rules, kept: dict[str, tuple[str, ...]]) -> None:
    out = for_everyone(faults, rules, now=NOW)
    assert {n: e.jobs for n, e in out.items()} == kept
    for e in out.values():
        assert e.until == max(f.at for f in faults if f.node_id == e.node_id) + rules.cooldown


# ---- on a real database ------------------------------------------------------------------------------------------
def _admit(db: Engine, settings, nodes: list[tuple], now: datetime):  # noqa: ANN001, ANN202
    """An admission pass over (node, CPUs[, CPUs free]) nodes."""
    from service.core.backend import ClusterView, NodeView
    from service.dispatch import admission
    from service.spec.job import JobSpec

    view = ClusterView([NodeView(n[0], "10.0.0.1", True, {"CPU": n[1]}, {"CPU": n[-1]}) for n in nodes])
    spec_of = lambda j: (JobSpec.model_validate(j.spec), None)  # noqa: E731
    resources_of = lambda j: JobSpec.model_validate(j.spec).resources.total(j.world_size)  # noqa: E731
    return admission.admit(db, settings, view, owner="test", now=now, spec_of=spec_of, resources_of=resources_of)


def _fail_attempt(db: Engine, job_id: str, message: str, reason: str = "preflight_failed") -> None:
    from service.lifecycle import reports
    from service.lifecycle.state import transition
    from service.store.models import EndReason, Job, JobState

    assert reports.record_attempt_end(db, job_id=job_id, attempt=1, reason=EndReason(reason), message=message)
    with Session(db) as session:
        row = session.get(Job, job_id)
        assert row is not None
        transition(session, row, to=JobState.QUEUED, reason="retry", actor="test", lease_token=row.lease_token)
        session.commit()


def test_the_retry_is_kept_off_the_named_node_and_the_driver_is_told(db: Engine) -> None:
    from service.config.settings import Settings
    from service.dispatch import submission
    from service.spec.job import JobSpec
    from service.store.models import Attempt, Job, JobEvent, NodeFault

    settings = Settings()
    spec = {"entrypoint": {"callable": "a:b"}, "resources": {"num_workers": 2}, "retries": {"max_attempts": 3}}
    with Session(db) as session:
        session.add(Job(id="j1", name="j", spec=spec, created_at=NOW))
        session.commit()
    started, _ = _admit(db, settings, [(A, 1), (B, 1), (C, 1)], NOW)
    assert [j.id for j in started] == ["j1"]
    _fail_attempt(db, "j1", f"PreflightFailed: pre-flight check failed: rank 1 on node_id='{B}' (10.0.0.3): sent 1002")
    with Session(db) as session:
        (row,) = session.exec(select(NodeFault)).all()
        assert (row.node_id, row.job_id, row.attempt, row.reason) == (B, "j1", 1, "preflight_failed")
    # Only A and B are free (C is busy): without B the group does not fit now, so it waits rather than use B.
    assert _admit(db, settings, [(A, 1), (B, 1), (C, 1, 0)], NOW + timedelta(seconds=1))[0] == []
    started, _ = _admit(db, settings, [(A, 1), (B, 1), (C, 1)], NOW + timedelta(seconds=2))
    assert [j.id for j in started] == ["j1"]
    with Session(db) as session:
        second = session.exec(select(Attempt).where(Attempt.number == 2)).one()
        assert second.excluded_nodes == [B]
        said = session.exec(select(JobEvent).where(JobEvent.reason == "node_excluded")).one()
        assert said.message == f"attempt 2 is kept off node {B}: it failed the pre-flight check"
        job = session.get(Job, "j1")
        assert job is not None
        sub = submission.build(session, job, JobSpec.model_validate(job.spec), settings)
    assert sub.runtime_env["env_vars"]["SHUNTER_EXCLUDED_NODES"] == B


def test_a_job_the_rest_of_the_cluster_cannot_hold_is_run_where_it_can(db: Engine) -> None:
    from service.config.settings import Settings
    from service.store.models import Attempt, Job

    settings = Settings()
    with Session(db) as session:
        session.add(Job(id="j2", name="j", spec={"entrypoint": {"callable": "a:b"}, "resources": {"num_workers": 2}},
                        created_at=NOW))  # fmt: skip
        session.commit()
    assert _admit(db, settings, [(A, 1), (B, 1)], NOW)[0]
    _fail_attempt(db, "j2", f"rank 0 on node_id='{A}' (10.0.0.2): sent 1001")
    started, _ = _admit(db, settings, [(A, 1), (B, 1)], NOW + timedelta(seconds=1))
    assert [j.id for j in started] == ["j2"]  # two 1-CPU nodes are all there is: A is not kept out
    with Session(db) as session:
        assert session.exec(select(Attempt).where(Attempt.number == 2)).one().excluded_nodes is None


def test_several_jobs_failing_on_a_node_keep_it_out_of_everyones_admissions_until_cleared(db: Engine) -> None:
    from service.config.settings import Settings
    from service.lifecycle import node_faults
    from service.store.models import Job

    settings = Settings(node_exclusion_jobs=2)
    with Session(db) as session:
        for i in range(3):
            session.add(Job(id=f"k{i}", name="k", spec={"entrypoint": {"callable": "a:b"}}, created_at=NOW))
        session.commit()
    started, _ = _admit(db, settings, [(A, 3)], NOW)
    assert sorted(j.id for j in started) == ["k0", "k1", "k2"]
    for job_id in ("k0", "k1"):
        _fail_attempt(db, job_id, f"rank 0 on node_id='{A}' (10.0.0.2): hung")
    with Session(db) as session:
        everyone, _ = node_faults.excluded(
            session, [], policies.exclusion_rules(settings), now=NOW + timedelta(seconds=1)
        )
        assert list(everyone) == [A] and everyone[A].jobs == ("k0", "k1")
    assert _admit(db, settings, [(A, 3)], NOW + timedelta(seconds=1))[0] == []  # out for everyone
    with Session(db) as session:
        assert node_faults.clear(session, A, actor="admin") == 2
        session.commit()
    assert sorted(j.id for j in _admit(db, settings, [(A, 3)], NOW + timedelta(seconds=2))[0]) == ["k0", "k1"]


def test_one_owners_jobs_alone_cannot_keep_a_node_from_everyone_when_tokens_are_on(db: Engine) -> None:
    from service.config.settings import Settings
    from service.lifecycle import node_faults
    from service.store.models import Job

    tokens = {"t-m": {"owner": "mallory"}, "t-a": {"owner": "alice"}}
    settings = Settings(api_tokens=tokens)
    assert policies.exclusion_rules(settings).owners == 2 and policies.exclusion_rules(Settings()).owners == 1
    with Session(db) as session:
        for i, owner in enumerate(["mallory"] * 4 + ["alice"]):
            session.add(Job(id=f"m{i}", name="m", owner=owner, spec={"entrypoint": {"callable": "a:b"}},
                            created_at=NOW))  # fmt: skip
        session.commit()
    assert len(_admit(db, settings, [(A, 5)], NOW)[0]) == 5
    for job_id in ("m0", "m1", "m2", "m3"):  # mallory's jobs all claim A failed them
        _fail_attempt(db, job_id, f"rank 0 on node_id='{A}' (10.0.0.2): sent 1002")
    later = NOW + timedelta(seconds=1)
    with Session(db) as session:
        everyone, per_job = node_faults.excluded(session, ["m0"], policies.exclusion_rules(settings), now=later)
    assert everyone == {} and per_job == {"m0": {A: "failed the pre-flight check"}}  # only mallory's own retries
    _fail_attempt(db, "m4", f"rank 0 on node_id='{A}' (10.0.0.2): sent 1002")  # a second owner's job fails there too
    with Session(db) as session:
        everyone, _ = node_faults.excluded(session, [], policies.exclusion_rules(settings), now=later)
    assert list(everyone) == [A] and everyone[A].jobs == ("m0", "m1", "m2", "m3", "m4")
