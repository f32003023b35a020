"""Job dependencies (depends_on): the pure decisions as tables, then the database side on SQLite and PostgreSQL (edges,
waiting, settling in the dependency's own transition, cascades, retries, admission), then the API's answers."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, select
from typer.testing import CliRunner

from api.cli import app as cli
from service.config.settings import Settings
from service.core.errors import Conflict, InvalidSpec
from service.dispatch import submission
from service.lifecycle import jobs, leases
from service.lifecycle.state import Move, transition, transition_many
from service.policy import end_reasons
from service.spec.depends_on import Condition, OnFailure, references, substitute
from service.spec.job import JobSpec
from service.store.models import EndReason, Job, JobDependency, JobEvent, JobState
from service.tenancy.auth import Caller
from service.workflows import dependencies
from tests.live_api import live_api

S = JobState
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
BASE = {"entrypoint": {"callable": "examples.mlp:train_loop"}}


# ---- decisions ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("condition", "state", "expected"),
    [
        (Condition.succeeded, S.QUEUED, None),
        (Condition.succeeded, S.STARTING, None),
        (Condition.succeeded, S.RUNNING, None),
        (Condition.succeeded, S.CANCELLING, None),
        (Condition.succeeded, S.SUCCEEDED, "met"),
        (Condition.succeeded, S.FAILED, "missed"),
        (Condition.succeeded, S.CANCELLED, "missed"),
        (Condition.ended, S.RUNNING, None),
        (Condition.ended, S.SUCCEEDED, "met"),
        (Condition.ended, S.FAILED, "met"),
        (Condition.ended, S.CANCELLED, "met"),
    ],
)
def test_outcome(condition: Condition, state: JobState, expected: str | None) -> None:
    assert dependencies.outcome(condition, state) == expected


@pytest.mark.parametrize(("policy", "state"), [(OnFailure.fail, S.FAILED), (OnFailure.cancel, S.CANCELLED)])
def test_miss_state(policy: OnFailure, state: JobState) -> None:
    assert dependencies.miss_state(policy) is state


@pytest.mark.parametrize(
    ("pending", "total", "said"),
    [
        ([("j1", Condition.succeeded)], 1, "waiting for job j1 to succeed (1 of 1 dependency left)"),
        ([("j1", Condition.succeeded)], 2, "waiting for job j1 to succeed (1 of 2 dependencies left)"),
        ([("j1", Condition.succeeded), ("j2", Condition.ended)], 2,
         "waiting for job j1 to succeed, job j2 to end (2 of 2 dependencies left)"),
        ([(f"j{i}", Condition.ended) for i in range(5)], 6,
         "waiting for job j0 to end, job j1 to end, job j2 to end and 2 more (5 of 6 dependencies left)"),
    ],
)  # fmt: skip
def test_waiting_reason(pending: list[tuple[str, Condition]], total: int, said: str) -> None:
    assert dependencies.waiting_reason(pending, total) == said


@pytest.mark.parametrize(
    ("config", "found"),
    [
        ({"lr": 1, "init_from": "plain"}, []),
        ({"init_from": "${deps.pre.checkpoint}"}, [("config.init_from", "pre", "checkpoint")]),
        ({"a": {"b": ["x", "${deps.p.model}/final.pt"]}}, [("config.a.b[1]", "p", "model")]),
        ({"m": "${deps.a.model}:${deps.b.checkpoint}"}, [("config.m", "a", "model"), ("config.m", "b", "checkpoint")]),
    ],
)
def test_references(config: dict[str, Any], found: list[tuple[str, str, str]]) -> None:
    assert references(config) == found


@pytest.mark.parametrize(
    ("config", "values", "out", "missing"),
    [
        ({"i": "${deps.pre.checkpoint}", "n": 3}, {("pre", "checkpoint"): "/c/1"}, {"i": "/c/1", "n": 3}, []),
        ({"i": ["${deps.pre.model}/w.pt"]}, {("pre", "model"): "s3://b/o"}, {"i": ["s3://b/o/w.pt"]}, []),
        ({"i": "${deps.pre.checkpoint}"}, {}, {"i": "${deps.pre.checkpoint}"}, ["config.i: ${deps.pre.checkpoint}"]),
        ({"i": "$deps.pre.checkpoint"}, {}, {"i": "$deps.pre.checkpoint"}, []),  # not a reference: left alone
    ],
)
def test_substitute(config: dict[str, Any], values: dict, out: dict[str, Any], missing: list[str]) -> None:
    assert substitute(config, lambda alias, kind: values.get((alias, kind))) == (out, missing)


@pytest.mark.parametrize(
    ("patch", "loc"),
    [
        ({"depends_on": [{"job": "j1"}, {"job": "j1", "on": "ended"}]}, ("depends_on", 1, "job")),
        ({"depends_on": [{"job": "j1", "as": "a"}, {"job": "j2", "as": "a"}]}, ("depends_on", 1, "as")),
        ({"depends_on": [{"job": "j1", "as": "1a"}]}, ("depends_on", 0, "as")),
        ({"depends_on": [{"job": "j1", "on": "failed"}]}, ("depends_on", 0, "on")),
        ({"depends_on": [{"job": "j/1"}]}, ("depends_on", 0, "job")),
        ({"depends_on": [{"job": "j1", "as_": "a"}]}, ("depends_on", 0, "as_")),  # only "as" is the name
        ({"depends_on": [{"job": f"j{i}"} for i in range(65)]}, ("depends_on",)),
        ({"config": {"x": "${deps.pre.checkpoint}"}}, ("config", "x")),  # no depends_on entry is named pre
        ({"depends_on": [{"job": "j1", "as": "pre"}], "config": {"x": {"y": "${deps.pre.weights}"}}},
         ("config", "x.y")),
        ({"on_dependency_failure": "ignore"}, ("on_dependency_failure",)),
    ],
)  # fmt: skip
def test_bad_dependency_specs_name_the_field(patch: dict[str, Any], loc: tuple) -> None:
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate({**BASE, **patch})
    assert [tuple(e["loc"]) for e in err.value.errors()] == [loc]


# ---- on a real database ------------------------------------------------------------------------------------------
def put(db: Engine, job_id: str, state: JobState = S.RUNNING, *, owner: str = "anonymous", **spec: Any) -> None:
    with Session(db) as session:
        session.add(Job(id=job_id, name=job_id, owner=owner, state=state, spec={**BASE, **spec}, created_at=NOW,
                        attempt=1 if state is not S.QUEUED else 0))  # fmt: skip
        session.commit()


def submit(db: Engine, caller: Caller | None = None, **spec: Any) -> str:
    with Session(db) as session:
        job, _ = jobs.submit(session, JobSpec.model_validate({**BASE, **spec}), caller=caller or Caller())
        session.commit()
        return job.id


def end(db: Engine, job_id: str, to: JobState, checkpoint: str | None = None) -> None:
    """End a job the way the dispatcher does: one transition (its dependents settle in the same transaction)."""
    with Session(db) as session:
        job = session.get(Job, job_id)
        assert job is not None
        if checkpoint:
            job.latest_checkpoint = checkpoint
            session.add(job)
            session.flush()
        reason = {S.SUCCEEDED: EndReason.SUCCEEDED, S.FAILED: EndReason.USER_ERROR}.get(to, EndReason.CANCELLED)
        if to is S.CANCELLED and job.state == S.RUNNING:
            transition(session, job, to=S.CANCELLING, reason="cancel_requested")
        transition(session, job, to=to, reason=reason.value, values={"end_reason": reason}, actor="test")
        session.commit()


def row(db: Engine, job_id: str) -> Job:
    with Session(db) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def admissible(db: Engine) -> list[str]:
    with Session(db) as session:
        return [j.id for j in leases.queued(session, now=NOW + timedelta(days=1))]


def test_a_job_waits_for_its_dependencies_and_is_ready_after_the_last(db: Engine) -> None:
    put(db, "a")
    put(db, "b")
    c = submit(db, depends_on=[{"job": "a", "as": "pre"}, {"job": "b", "on": "ended"}])
    assert row(db, c).waiting_on == 2
    assert row(db, c).state_reason == "waiting for job a to succeed, job b to end (2 of 2 dependencies left)"
    assert c not in admissible(db)
    end(db, "b", S.FAILED)  # on: ended: a failure meets it
    assert (row(db, c).waiting_on, row(db, c).state) == (1, S.QUEUED)
    assert row(db, c).state_reason == "waiting for job a to succeed (1 of 2 dependencies left)"
    assert c not in admissible(db)
    end(db, "a", S.SUCCEEDED, checkpoint="/ckpt/a/3")
    job = row(db, c)
    assert (job.waiting_on, job.state, job.state_reason) == (0, S.QUEUED, dependencies.READY_REASON)
    assert c in admissible(db)
    with Session(db) as session:
        edges = session.exec(select(JobDependency).where(JobDependency.job_id == c)).all()
        assert {(e.depends_on, e.outcome, e.checkpoint) for e in edges} == {("a", "met", "/ckpt/a/3"),
                                                                            ("b", "met", None)}  # fmt: skip
        said = session.exec(select(JobEvent.message).where(JobEvent.job_id == c,
                                                           JobEvent.reason == "dependency_met")).all()  # fmt: skip
        assert said == ["job b ended FAILED; waiting for job a to succeed (1 of 2 dependencies left)",
                        f"job a ended SUCCEEDED; {dependencies.READY_REASON}"]  # fmt: skip


def test_jobs_ended_together_in_one_batch_settle_their_dependents(db: Engine) -> None:
    """The dispatcher writes the ends of a pass in one batch (`transition_many`, service/dispatch/finishing.py) when
    two or more jobs end together: their dependents settle in that same transaction, as after one job's end. (The
    batch read which ended jobs are waited on as rows, not ids, and so settled none: mypy found it, issue 36.)"""
    put(db, "a")
    put(db, "b")
    c = submit(db, depends_on=[{"job": "a"}, {"job": "b", "on": "ended"}])
    assert row(db, c).waiting_on == 2
    with Session(db) as session:
        ending = [session.get(Job, "a"), session.get(Job, "b")]
        moves = [Move(job, S.SUCCEEDED, EndReason.SUCCEEDED.value, values={"end_reason": EndReason.SUCCEEDED})
                 for job in ending if job is not None]  # fmt: skip
        assert transition_many(session, moves, actor="test") == []
        session.commit()
    job = row(db, c)
    assert (job.waiting_on, job.state, job.state_reason) == (0, S.QUEUED, dependencies.READY_REASON)
    assert c in admissible(db)


@pytest.mark.parametrize(("policy", "state"), [("fail", S.FAILED), ("cancel", S.CANCELLED)])
def test_a_miss_ends_the_dependent_and_cascades_down_the_chain(db: Engine, policy: str, state: JobState) -> None:
    put(db, "a")
    b = submit(db, depends_on=[{"job": "a"}], on_dependency_failure=policy)
    c = submit(db, depends_on=[{"job": b}])  # fails with b
    d = submit(db, depends_on=[{"job": b, "on": "ended"}])  # met when b ends, however it ends
    end(db, "a", S.FAILED)
    for job_id, expected in ((b, state), (c, S.FAILED)):
        job = row(db, job_id)
        assert (job.state, job.end_reason) == (expected, EndReason.DEPENDENCY_FAILED)
    assert row(db, b).last_error == "dependency a ended FAILED and can no longer succeed"
    assert row(db, c).last_error == f"dependency {b} ended {state.value} and can no longer succeed"
    assert (row(db, d).state, row(db, d).waiting_on) == (S.QUEUED, 0)
    assert not end_reasons.retryable(EndReason.DEPENDENCY_FAILED)


def test_a_retry_of_the_failed_dependency_does_not_revive_its_dependent(db: Engine) -> None:
    put(db, "a")
    b = submit(db, depends_on=[{"job": "a"}])
    end(db, "a", S.FAILED)
    assert row(db, b).state == S.FAILED
    with Session(db) as session:
        jobs.retry(session, "a", caller=Caller())
        session.commit()
    with Session(db) as session:  # it runs again and succeeds
        job = session.get(Job, "a")
        assert job is not None
        transition(session, job, to=S.STARTING, reason="admitted")
        transition(session, job, to=S.RUNNING, reason="first_report")
        session.commit()
    end(db, "a", S.SUCCEEDED)
    assert (row(db, b).state, row(db, b).end_reason) == (S.FAILED, EndReason.DEPENDENCY_FAILED)
    # The user's own retry of the dependent looks again: a now meets its condition, so b is ready at once.
    with Session(db) as session:
        jobs.retry(session, b, caller=Caller())
        session.commit()
    assert (row(db, b).state, row(db, b).waiting_on) == (S.QUEUED, 0)
    assert b in admissible(db)


def test_retrying_a_dependent_whose_dependency_still_misses_is_refused_and_one_that_runs_again_is_waited_for(
    db: Engine,
) -> None:
    put(db, "a")
    b = submit(db, depends_on=[{"job": "a"}])
    end(db, "a", S.CANCELLED)
    with Session(db) as session, pytest.raises(Conflict, match="depends on job a, which ended CANCELLED"):
        jobs.retry(session, b, caller=Caller())
    with Session(db) as session:
        jobs.retry(session, "a", caller=Caller())  # a is queued again: b's retry waits for it
        jobs.retry(session, b, caller=Caller())
        session.commit()
    assert (row(db, b).state, row(db, b).waiting_on) == (S.QUEUED, 1)
    assert row(db, b).state_reason == "waiting for job a to succeed (1 of 1 dependency left)"


def test_a_dependent_cancelled_while_waiting_stays_cancelled(db: Engine) -> None:
    put(db, "a")
    b = submit(db, depends_on=[{"job": "a"}])
    with Session(db) as session:
        jobs.cancel(session, b, caller=Caller())
        session.commit()
    end(db, "a", S.FAILED)
    assert (row(db, b).state, row(db, b).end_reason, row(db, b).waiting_on) == (S.CANCELLED, "cancelled", 0)


def test_submission_against_ended_and_unknown_jobs(db: Engine) -> None:
    put(db, "done", S.SUCCEEDED)
    put(db, "broke", S.FAILED)
    ready = submit(db, depends_on=[{"job": "done"}, {"job": "broke", "on": "ended"}])
    assert (row(db, ready).waiting_on, row(db, ready).state_reason) == (0, dependencies.READY_REASON)
    assert ready in admissible(db)
    with pytest.raises(InvalidSpec, match=r"depends_on\[1\]\.job: job broke already ended FAILED") as err:
        submit(db, depends_on=[{"job": "done"}, {"job": "broke"}])
    assert err.value.field == "depends_on[1].job"
    with pytest.raises(InvalidSpec, match=r"depends_on\[0\]\.job: no job 'nope'"):
        submit(db, depends_on=[{"job": "nope"}])
    with Session(db) as session:  # nothing of the refused jobs was kept
        assert len(session.exec(select(Job)).all()) == 3


def test_another_owners_job_needs_an_admin(db: Engine) -> None:
    """To anyone else, another owner's job is no job at all: the same 422 as an unknown id (issue 35)."""
    put(db, "hers", owner="alice")
    with pytest.raises(InvalidSpec, match=r"depends_on\[0\]\.job: no job 'hers'"):
        submit(db, Caller(owner="bob", admin=False), depends_on=[{"job": "hers"}])
    assert row(db, submit(db, Caller(owner="alice", admin=False), depends_on=[{"job": "hers"}])).waiting_on == 1
    assert row(db, submit(db, Caller(owner="ops", admin=True), depends_on=[{"job": "hers"}])).waiting_on == 1


@pytest.mark.parametrize("fair", [False, True])
def test_a_waiting_job_does_not_block_the_jobs_behind_it(db: Engine, fair: bool) -> None:
    """Admission never sees a waiting job: the lower-priority job behind it starts in the room it would have used,
    with fair share (each owner's heads) or without."""
    from service.core.backend import ClusterView, NodeView
    from service.dispatch import admission

    put(db, "a")
    waiting = submit(db, Caller(owner="alice"), depends_on=[{"job": "a"}], priority=100,
                     resources={"num_workers": 2})  # fmt: skip
    other = submit(db, Caller(owner="bob"), resources={"num_workers": 2})
    settings = Settings(fair_share={"enabled": fair}, reserve_after_seconds=0)
    view = ClusterView([NodeView("n1", "10.0.0.1", True, {"CPU": 2}, {"CPU": 2})])
    spec_of = lambda j: (JobSpec.model_validate(j.spec), None)  # noqa: E731
    resources_of = lambda j: JobSpec.model_validate(j.spec).resources.total(j.world_size)  # noqa: E731
    started, _ = admission.admit(db, settings, view, owner="t", now=NOW + timedelta(hours=1), spec_of=spec_of,
                                 resources_of=resources_of)  # fmt: skip
    assert [j.id for j in started] == [other]
    assert row(db, waiting).state_reason == "waiting for job a to succeed (1 of 1 dependency left)"


def test_the_hand_off_fills_in_the_config_and_refuses_what_has_nothing_to_hand(db: Engine, tmp_path: Path) -> None:
    settings = Settings(storage_uri=str(tmp_path / "store"))
    put(db, "pre")
    put(db, "scr", entrypoint={"script": "train.py"})
    put(db, "bare")
    config = {"init_from": "${deps.pre.checkpoint}", "weights": "${deps.scr.model}/w.pt", "m": "${deps.pre.model}",
              "n": 3}  # fmt: skip
    ft = submit(db, depends_on=[{"job": "pre", "as": "pre"}, {"job": "scr", "as": "scr"}], config=config)
    end(db, "pre", S.SUCCEEDED, checkpoint="/ckpt/pre/9")
    end(db, "scr", S.SUCCEEDED, checkpoint="/ckpt/scr/outputs/checkpoint-2")
    with Session(db) as session:
        job = session.get(Job, ft)
        assert job is not None
        spec = JobSpec.model_validate(job.spec)
        submission.check_hand_off(session, job, spec, settings)
        given = submission.driver_spec(session, job, settings)
    assert given["config"] == {"init_from": "/ckpt/pre/9", "weights": f"{tmp_path / 'store'}/scr/outputs/w.pt",
                               "m": "/ckpt/pre/9", "n": 3}  # fmt: skip
    assert given["depends_on"] == job.spec["depends_on"]  # only the config is filled in
    none = submit(db, depends_on=[{"job": "bare", "as": "b"}], config={"init_from": "${deps.b.checkpoint}"})
    end(db, "bare", S.SUCCEEDED)  # without a checkpoint
    with Session(db) as session:
        job = session.get(Job, none)
        assert job is not None
        with pytest.raises(InvalidSpec, match=r"config\.init_from: \$\{deps\.b\.checkpoint\} has nothing") as err:
            submission.check_hand_off(session, job, JobSpec.model_validate(job.spec), settings)
        assert err.value.field == "config.init_from"


# ---- through the API ---------------------------------------------------------------------------------------------
TOKENS = {"tok-alice": {"owner": "alice"}, "tok-bob": {"owner": "bob"}, "tok-root": {"owner": "ops", "admin": True}}


def test_the_api_refuses_bad_dependencies_and_shows_them(db: Engine, tmp_path: Path) -> None:
    with live_api(db, tmp_path, api_tokens=TOKENS) as api:

        def post(token: str, **spec: Any) -> httpx.Response:
            return httpx.post(f"{api.url}/v1/jobs", json={**BASE, **spec}, timeout=10,
                              headers={"Authorization": f"Bearer {token}"})  # fmt: skip

        first = post("tok-alice")
        assert first.status_code == 201, first.text
        pre = first.json()["id"]
        unknown = post("tok-alice", depends_on=[{"job": "j0000"}])
        assert (unknown.status_code, unknown.json()["detail"]) == (422, "depends_on[0].job: no job 'j0000'")
        theirs = post("tok-bob", depends_on=[{"job": pre}])
        assert (theirs.status_code, theirs.json()["detail"]) == (422, f"depends_on[0].job: no job {pre!r}")
        bad_ref = post("tok-alice", depends_on=[{"job": pre, "as": "pre"}], config={"x": "${deps.post.model}"})
        assert bad_ref.status_code == 422 and "config" in bad_ref.text and "'post'" in bad_ref.text, bad_ref.text
        assert post("tok-root", depends_on=[{"job": pre}]).status_code == 201
        made = post("tok-alice", depends_on=[{"job": pre, "as": "pre"}], config={"init_from": "${deps.pre.checkpoint}"})
        assert made.status_code == 201, made.text
        body = httpx.get(f"{api.url}/v1/jobs/{made.json()['id']}", headers={"Authorization": "Bearer tok-alice"},
                         timeout=10).json()  # fmt: skip
        shown = CliRunner().invoke(cli, ["status", body["id"], "--server", api.url, "--token", "tok-alice"],
                                   env={"COLUMNS": "200"})  # fmt: skip
    assert shown.exit_code == 0, shown.output
    lines = [" ".join(line.split()) for line in shown.stdout.splitlines()]
    assert f"depends on {pre} (on succeeded, as pre): pending, QUEUED" in lines
    assert "estimated_start once its dependencies are met" in lines
    assert body["waiting_on"] == 1
    assert body["state_reason"] == f"waiting for job {pre} to succeed (1 of 1 dependency left)"
    assert body["dependencies"] == [{"job": pre, "on": "succeeded", "as": "pre", "status": "pending",
                                     "state": "QUEUED", "settled_at": None, "checkpoint": None}]  # fmt: skip
    assert body["spec"]["depends_on"] == [{"job": pre, "on": "succeeded", "as": "pre"}]
    assert body["spec"]["config"] == {"init_from": "${deps.pre.checkpoint}"}  # stored as written


def test_a_dependency_ending_while_a_dependent_is_submitted_is_never_missed(db: Engine) -> None:
    """The submission locks the dependency's row: it waits for the transaction ending the dependency, then sees it
    ended (met at once). Without the lock it would store a pending edge the end had already passed: a job waiting
    for ever."""
    import threading

    from sqlalchemy import text

    from service.store.db import session_scope
    from tests.conftest import wait_for

    put(db, "a")
    made: list[str] = []
    with session_scope(db) as ending:
        job = ending.get(Job, "a")
        assert job is not None
        transition(ending, job, to=S.SUCCEEDED, reason="succeeded", values={"end_reason": EndReason.SUCCEEDED})
        ending.flush()

        def submit_dependent() -> None:
            with session_scope(db) as session:
                new, _ = jobs.submit(session, JobSpec.model_validate({**BASE, "depends_on": [{"job": "a"}]}),
                                     caller=Caller())  # fmt: skip
                made.append(new.id)

        thread = threading.Thread(target=submit_dependent)
        thread.start()
        if db.dialect.name == "postgresql":  # it is blocked on the row lock before the end commits
            with db.connect() as conn:
                wait_for(lambda: conn.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar(),
                         timeout=20, what="the submission to wait on the dependency's row")  # fmt: skip
    thread.join(timeout=30)
    assert made, "the submission did not finish"
    assert (row(db, made[0]).waiting_on, row(db, made[0]).state_reason) == (0, dependencies.READY_REASON)


def test_a_long_chain_ends_link_by_link_in_the_one_transaction(db: Engine) -> None:
    """200 jobs, each waiting on the one before: the first one's failure ends them all in its own transition, from
    the settle loop. Recursion (two frames a link at least) would run out of the stack allowed here."""
    import inspect
    import sys

    put(db, "c0")
    links = 200
    with Session(db) as session:
        for i in range(1, links + 1):
            spec = {**BASE, "depends_on": [{"job": f"c{i - 1}", "on": "succeeded", "as": None}]}
            session.add(Job(id=f"c{i}", name="c", spec=spec, waiting_on=1, created_at=NOW))
        session.flush()
        for i in range(1, links + 1):
            session.add(JobDependency(job_id=f"c{i}", depends_on=f"c{i - 1}", condition="succeeded"))
        session.commit()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 250)  # a link's own frames fit, 200 links' worth do not
    try:
        end(db, "c0", S.FAILED)
    finally:
        sys.setrecursionlimit(limit)
    last = row(db, f"c{links}")
    assert (last.state, last.end_reason, last.waiting_on) == (S.FAILED, EndReason.DEPENDENCY_FAILED, 0)
    assert last.last_error == f"dependency c{links - 1} ended FAILED and can no longer succeed"
    with Session(db) as session:
        assert not session.exec(select(Job.id).where(Job.state == S.QUEUED)).all()


def test_ready_since_is_when_the_last_dependency_was_settled(db: Engine) -> None:
    """What admission's starvation guard counts from (scheduler.Candidate.ready_since): a job with dependencies has
    waited for room only since its last one was met; a job without any is not listed (its creation time counts)."""
    put(db, "a")
    put(db, "b")
    two = submit(db, depends_on=[{"job": "a"}, {"job": "b"}])
    plain = submit(db)
    with Session(db) as session:
        assert dependencies.ready_since(session, [two, plain]) == {}
    end(db, "a", S.SUCCEEDED)
    with Session(db) as session:
        first = dependencies.ready_since(session, [two])[two]
    end(db, "b", S.SUCCEEDED)
    with Session(db) as session:
        settled = session.exec(select(JobDependency.settled_at).where(JobDependency.job_id == two)).all()
        last = dependencies.ready_since(session, [two, plain])
    assert set(last) == {two} and last[two] == max(s.timestamp() for s in settled if s) and last[two] >= first
