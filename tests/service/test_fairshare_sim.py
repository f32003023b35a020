"""Issue 15's proof at scale: fair share, quotas, borrowing and start estimates, through the real submission, dispatcher
and admission code, on SQLite and PostgreSQL, with one and with three dispatchers ticking at once.

The cluster is `SimJobs` (a finite cluster whose jobs last, on a virtual clock: bench/fairshare_sim.py), because the
noop backend ends every job at once on unlimited CPUs and could prove none of it. The quick tier runs each property
on a few dozen to a hundred jobs with three dispatchers, and the issue's 2,000 jobs with one; the slow tier returns
borrowed quota six times over. What each number means is in
bench/fairshare_report.py; a failure prints the whole summary.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from bench import fairshare_sim as sim
from bench.fairshare_report import render, summarise
from service.backends.sim import SimJobs
from service.core import clock
from service.core.backend import Backend, RayJobInfo
from service.dispatch.dispatcher import Dispatcher
from service.lifecycle.jobs import submit
from service.spec.job import JobSpec
from service.store.models import ClusterSnapshot, Job, JobState
from service.tenancy.auth import Caller

# With 100 jobs the smaller owners run 17 each, so one job more or less is several percent of their share: the quick
# tier (on 8 CPUs, half the rounds' work) allows +-10% (FIFO would give every owner a quarter: ratios 0.56 to 1.5).
# Measured with three dispatchers, six runs: 0.015 to 0.056 (0.12 to 0.30 before a placed job's projection was
# bounded by its timeout: service/policy/fairshare.py).
QUICK_SHARE_TOLERANCE = 0.10


def run(
    db: Engine, scenario: sim.Scenario, dispatchers: int, tmp_path: Path, *, estimate: bool = False
) -> dict[str, Any]:
    missing = sim.missing_policy(scenario)
    summary = summarise(sim.simulate(db, scenario, dispatchers=dispatchers, workdir=tmp_path, estimate=estimate))
    text = render(summary)
    print(text)
    assert not missing, f"Settings has no {missing} yet: the policy under test is not in admission\n{text}"
    assert not summary["tick_failures"], f"dispatcher ticks failed\n{text}"
    return summary


def explain(summary: dict[str, Any]) -> str:
    return render(summary) + "\n" + json.dumps({k: summary[k] for k in ("shares", "quotas", "borrowing")}, indent=1)


# ---- the simulated cluster itself ------------------------------------------------------------------------------
def add(db: Engine, workers: int, seconds: float, steps: int | None = None) -> str:
    env = {"SIM_SECONDS": str(seconds), **({"SIM_STEPS": str(steps)} if steps else {})}
    spec = JobSpec.model_validate({"entrypoint": {"callable": "examples.mlp:train_loop"},
                                   "resources": {"num_workers": workers},
                                   "runtime_env": {"env_vars": env}})  # fmt: skip
    with Session(db) as session:
        job, _ = submit(session, spec, caller=Caller("alice", team="ml"))
        session.commit()
        return job.id


def info(backend: SimJobs, job_id: str) -> RayJobInfo:
    found = backend.info(f"shunter-{job_id}-1")
    assert found is not None
    return found


def test_sim_cluster_packs_whole_groups_never_overcommits_and_holds_what_does_not_fit(db: Engine) -> None:
    virtual = clock.VirtualClock(sim.START)
    backend = SimJobs({"n0": {"CPU": 4.0}, "n1": {"CPU": 4.0}}, engine=db, now=virtual.now)
    assert isinstance(backend, Backend)
    ids = [add(db, 3, 100), add(db, 3, 200), add(db, 4, 50)]
    for job_id, seconds in zip(ids, (100, 200, 50), strict=True):
        env = {"SHUNTER_JOB_ID": job_id, "SHUNTER_ATTEMPT": "1", "SIM_SECONDS": str(seconds)}
        assert backend.submit(submission_id=f"shunter-{job_id}-1", entrypoint="x", runtime_env={"env_vars": env},
                              metadata={})  # fmt: skip
    # A second submission of one id is refused, as Ray refuses it.
    assert not backend.submit(submission_id=f"shunter-{ids[0]}-1", entrypoint="x", runtime_env={"env_vars": env},
                              metadata={})  # fmt: skip
    assert [info(backend, j).status for j in ids] == ["RUNNING", "RUNNING", "PENDING"]  # no node has 4 CPUs left
    assert sorted(n.available["CPU"] for n in backend.cluster().nodes) == [1.0, 1.0]
    virtual.advance(100)  # the first ends at 100 s, and the 4-worker job takes its node at that moment
    assert info(backend, ids[0]).status == "SUCCEEDED"
    assert info(backend, ids[2]).status == "RUNNING"
    assert info(backend, ids[2]).start_time == int((sim.START.timestamp() + 100) * 1000)
    assert sorted(n.available["CPU"] for n in backend.cluster().nodes) == [0.0, 1.0]
    assert backend.stop(f"shunter-{ids[1]}-1") and info(backend, ids[1]).status == "STOPPED"
    assert sorted(n.available["CPU"] for n in backend.cluster().nodes) == [0.0, 4.0]
    assert backend.next_end() == sim.START.timestamp() + 150


def test_sim_jobs_run_for_their_length_and_report_steps_through_the_progress_path(db: Engine, tmp_path: Path) -> None:
    scenario = sim.Scenario("one", [], {}, cpus=4)
    virtual = clock.VirtualClock(sim.START)
    backend = SimJobs(scenario.nodes(), engine=db, report_every=10)
    disp = Dispatcher(engine=db, settings=sim.settings_for(scenario, tmp_path), ray=backend, owner="d1")
    try:
        with clock.use(virtual):
            job_id = add(db, 2, 100, steps=50)
            disp.tick()  # admitted and submitted: placed at once
            backend.deliver_progress()  # every rank started
            disp.tick()
            virtual.advance(40)
            backend.deliver_progress()
            with Session(db) as session:
                job = session.get(Job, job_id)
                assert job is not None and job.state == JobState.RUNNING
                assert job.step == 20 and job.latest_metrics == {"step": 20.0, "total_steps": 50.0}
                assert job.started_at == sim.START
            virtual.advance(60)
            disp.tick()
            with Session(db) as session:
                job = session.get(Job, job_id)
                assert job is not None and job.state == JobState.SUCCEEDED
                assert job.finished_at == sim.START + timedelta(seconds=100)
    finally:
        disp._pool.shutdown(wait=True)


def test_the_first_cluster_snapshot_stored_by_two_dispatchers_at_once_is_not_lost(
    db: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Seen with three dispatchers on a fresh PostgreSQL database: both read no snapshot row, both insert id 1, and
    the loser's snapshot was dropped with a warning. Now the loser stores it again, as the update it has become.
    (On SQLite a write transaction holds the lock from its first read: the race cannot happen there.)"""
    if db.dialect.name == "sqlite":
        pytest.skip("SQLite's write transactions begin IMMEDIATE: no other writer can come between read and write")
    scenario = sim.Scenario("one", [], {}, cpus=8)
    backend = SimJobs(scenario.nodes(), engine=db)
    disp = Dispatcher(engine=db, settings=sim.settings_for(scenario, tmp_path), ray=backend, owner="d1")
    real_get, raced = Session.get, []

    def get(self: Session, entity: Any, ident: Any, **kw: Any) -> Any:
        found = real_get(self, entity, ident, **kw)
        if entity is ClusterSnapshot and not raced:  # the other dispatcher inserts right after our read
            raced.append(True)
            with Session(db) as other:
                other.add(ClusterSnapshot(id=1, total={"CPU": 1.0}, dashboard_url="other"))
                other.commit()
        return found

    monkeypatch.setattr(Session, "get", get)
    try:
        with caplog.at_level("WARNING", logger="service.dispatch.dispatcher"):
            assert disp.read_cluster() is not None
    finally:
        disp._pool.shutdown(wait=True)
    assert raced and "cannot store the cluster snapshot" not in caplog.text
    with Session(db) as session:
        snap = real_get(session, ClusterSnapshot, 1)
        assert snap is not None and snap.total["CPU"] == 8.0 and snap.dashboard_url == "sim://"


# ---- the properties, on a few dozen jobs: quick tier, both databases, 3 dispatchers (and 1 for borrowing) --------
@pytest.mark.parametrize("dispatchers", [3])
def test_no_owner_or_team_quota_is_exceeded_at_any_instant(db: Engine, tmp_path: Path, dispatchers: int) -> None:
    summary = run(db, sim.quota(36), dispatchers, tmp_path)
    quotas = summary["quotas"]
    assert quotas["exceeded"] == [] and summary["quotas_admitted"]["exceeded"] == [], explain(summary)
    # The quotas bound (else nothing was proven): every owner and team capped at some instant.
    reached = {r.split()[0] for r in quotas["reached"]}
    assert {"owner:alice", "owner:bob", "team:ml", "team:cv"} <= reached, explain(summary)


@pytest.mark.parametrize("dispatchers", [1, 3])
def test_borrowed_quota_is_returned_within_one_preemption_cycle(db: Engine, tmp_path: Path, dispatchers: int) -> None:
    summary = run(db, sim.borrow(1), dispatchers, tmp_path)
    assert summary["quotas"]["exceeded"] == [], explain(summary)
    assert summary["quotas"]["peaks"]["queue:b"]["max_cpus"] > 8, "queue b never borrowed: nothing was proven"
    borrowing = summary["borrowing"]
    assert borrowing["episodes"] >= 1 and borrowing["within_one_cycle"], explain(summary)


@pytest.mark.parametrize("dispatchers", [3])
def test_owners_share_the_cluster_by_weight(db: Engine, tmp_path: Path, dispatchers: int) -> None:
    summary = run(db, sim.fair(100, cpus=8), dispatchers, tmp_path)
    shares = summary["shares"]
    assert shares["window_fraction"] > 0.3, explain(summary)
    assert shares["max_deviation"] <= QUICK_SHARE_TOLERANCE, explain(summary)
    assert summary["quotas"]["exceeded"] == [], explain(summary)


# ---- at length: the 2,000 jobs -----------------------------------------------------------------------------
SHARE_TOLERANCE = 0.10  # each owner's share of resource-seconds within +-10% of its weight share
ESTIMATES_WITHIN = 0.80  # of the jobs that waited, the part whose estimated start was within 25% of the real one


FAIR_JOBS = 600  # the CI size of the 2,000-job run (python -m bench.fairshare_sim --jobs 2000 --dispatchers 1)


def at_size(db: Engine, tmp_path: Path, jobs: int) -> None:
    """`jobs` jobs of four owners in two teams (weights 2:1; within the first, alice weighs twice bob), one dispatcher
    (the multi-dispatcher runs above prove the same policy under contention). Every waiting job's estimate is taken
    when it is first seen waiting, with the whole queue and every running job as they stand then, and compared with
    when it really started. The same invariants as the full 2,000-job run, which is `bench.fairshare_sim`'s."""
    summary = run(db, sim.fair(jobs), 1, tmp_path, estimate=True)
    assert summary["jobs"] == jobs and summary["shares"]["window_fraction"] > 0.9, explain(summary)
    assert summary["shares"]["max_deviation"] <= SHARE_TOLERANCE, explain(summary)
    assert summary["quotas"]["exceeded"] == [] and summary["quotas_admitted"]["exceeded"] == [], explain(summary)
    estimates = summary["estimates"]
    assert estimates["jobs"] >= 0.95 * jobs and estimates["no_estimate"] == 0, explain(summary)
    assert estimates["share_within"] >= ESTIMATES_WITHIN, explain(summary)


# SQLite in the suite, at its CI size (40 s of an idle core; it was 2,000 jobs and 3.6 minutes of the quick tier).
# `python -m bench.fairshare_sim --jobs 2000 --dispatchers 1 --db sqlite|postgres` is the full run; the policy runs
# on PostgreSQL in the three-dispatcher tests above.
@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_jobs_share_by_weight_within_quotas_and_start_when_estimated(db: Engine, tmp_path: Path) -> None:
    """A virtual clock: nothing here is timed, so it may share the machine with other tests."""
    at_size(db, tmp_path, FAIR_JOBS)


@pytest.mark.slow
def test_borrowed_quota_is_returned_every_time(db: Engine, tmp_path: Path) -> None:
    summary = run(db, sim.borrow(6), 3, tmp_path)
    assert summary["borrowing"]["episodes"] >= 6 and summary["borrowing"]["within_one_cycle"], explain(summary)
    assert summary["quotas"]["exceeded"] == [], explain(summary)


def test_a_quota_on_one_accelerator_types_gpus_holds_only_that_types_jobs(db: Engine, tmp_path: Path) -> None:
    """Issue 37: `max_gpus_by_type` through the real submission, dispatcher and admission code, on a cluster of an
    H100 node and an A100 node. Alice may hold 4 H100 GPUs: her second H100 job waits, naming the cap, while her A100
    job of the same size runs beside the first; once the first ends, the second is admitted."""
    scenario = sim.Scenario("typed", [], {}, cpus=8)
    backend = SimJobs({"h": {"CPU": 8.0, "GPU": 8.0, "accelerator_type:H100": 1.0},
                       "a": {"CPU": 8.0, "GPU": 8.0, "accelerator_type:A100": 1.0}}, engine=db)  # fmt: skip
    settings = sim.settings_for(scenario, tmp_path).model_copy(
        update={"quotas": {"owner": {"alice": {"max_gpus_by_type": {"H100": 4}}}}}
    )
    disp = Dispatcher(engine=db, settings=settings, ray=backend, owner="d1")
    virtual = clock.VirtualClock(sim.START)

    def gpu_job(kind: str, seconds: float) -> str:
        spec = JobSpec.model_validate({
            "name": kind.lower(), "entrypoint": {"callable": "examples.mlp:train_loop"},
            "resources": {"num_workers": 4, "use_gpu": True, "accelerator_type": kind},
            "runtime_env": {"env_vars": {"SIM_SECONDS": str(seconds)}},
        })  # fmt: skip
        with Session(db) as session:
            job, _ = submit(session, spec, caller=Caller("alice", team="ml"), settings=settings)
            session.commit()
            return job.id

    def state(job_id: str) -> tuple[str, str | None]:
        with Session(db) as session:
            job = session.get(Job, job_id)
            assert job is not None
            return job.state.value, job.state_reason

    try:
        with clock.use(virtual):
            ids = []
            for kind in ("H100", "H100", "A100"):  # one a second: FIFO within alice's jobs is by submission time
                ids.append(gpu_job(kind, 100))
                virtual.advance(1)
            first, second, other = ids
            disp.tick()
            assert state(first)[0] == "STARTING" and state(other)[0] == "STARTING", (state(first), state(other))
            waiting, why = state(second)
            assert waiting == "QUEUED" and "owner 'alice' would exceed its 4 H100 GPUs (4 in use)" in (why or ""), why
            virtual.advance(100)
            disp.tick()  # the first ends
            disp.tick()
            assert state(first)[0] == "SUCCEEDED" and state(second)[0] in ("STARTING", "RUNNING"), state(second)
    finally:
        disp._pool.shutdown(wait=True)
