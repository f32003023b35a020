"""The start estimate's forward replay of admission (`service.policy.forecast`), pure and table-driven; what it reads
from the database (run ratios, projected submissions) on real SQLite and PostgreSQL; `position` / `estimated_start`
over the app: tests/api/test_position.py; against what then happens, at scale: tests/service/test_fairshare_sim.py."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sqlalchemy.engine import Engine
from sqlmodel import Session

from service import estimate
from service.config.settings import Settings
from service.estimate import expected_end
from service.policy.fairshare import FairShare, Usage
from service.policy.forecast import Arrivals, Policy, Runner, Waiter, forecast
from service.policy.quotas import QueueLimit, Quota, Quotas
from service.policy.scheduler import Candidate
from service.store.models import Attempt, EndReason, Job, JobState

CPU = "CPU"
FIFO = Policy(fair=FairShare(enabled=False))


def waiter(name: str, need: float, duration: float | None, *, owner: str = "alice", seq: float = 0.0,
           queue: str = "default", workers: int = 1, placement: str = "pack", not_before: float = 0.0,
           prio: int = 0) -> Waiter:  # fmt: skip
    cand = Candidate(name, prio, seq, workers, {CPU: need / workers}, placement, queue, owner, None)
    return Waiter(cand, duration, not_before)


def runner(name: str, need: float, end: float | None, *, owner: str = "zed", queue: str = "default",
           prio: int = 0, seq: float = -1.0, yielding: bool = False) -> Runner:  # fmt: skip
    return Runner(name, owner, None, queue, prio, seq, {CPU: need}, end, yielding=yielding)


def one_node(cpus: float) -> dict[str, dict[str, float]]:
    return {"n0": {CPU: cpus}}


@pytest.mark.parametrize(
    ("pending", "running", "capacity", "expected"),
    [
        pytest.param([("a", 1, 50)], [], 2, {"a": 0}, id="room-now"),
        pytest.param([("a", 2, 50)], [(2, 100)], 2, {"a": 100}, id="after-a-running-job-ends"),
        pytest.param([("a", 2, 50), ("b", 1, 30)], [(2, 100)], 2, {"a": 100, "b": 150}, id="in-order"),
        pytest.param(
            [("a", 2, 50), ("b", 1, 30), ("c", 2, None), ("d", 1, 10)],
            [(2, 100)],
            2,
            {"a": 100, "b": 150, "c": 180, "d": 150},
            id="backfill-beside-an-earlier-job",
        ),  # fmt: skip
        pytest.param([("a", 1, None), ("b", 2, 10)], [], 2, {"a": 0, "b": None}, id="no-end-known-no-estimate"),
        pytest.param([("a", 1, 10)], [(2, None)], 2, {"a": None}, id="running-without-an-end"),
        pytest.param([("a", 3, 10)], [], 2, {"a": None}, id="never-fits"),
        pytest.param([("a", 1, 100), ("b", 1, 5)], [(1, 50)], 2, {"a": 0, "b": 50}, id="short-job-after-the-end"),
        pytest.param([("a", 1, 10)], [(2, -5)], 2, {"a": 0}, id="a-job-past-its-expected-end-ends-now"),
    ],
)
def test_forecast_in_fifo_order(pending: list, running: list, capacity: float, expected: dict) -> None:
    order = [waiter(name, need, duration, seq=i) for i, (name, need, duration) in enumerate(pending)]
    held = [runner(f"r{i}", need, end) for i, (need, end) in enumerate(running)]
    assert forecast(order, held, one_node(capacity), 0.0, policy=FIFO) == expected


def test_forecast_waits_out_a_retry_backoff() -> None:
    assert forecast([waiter("a", 1, 10, not_before=40.0)], [], one_node(2), 0.0, policy=FIFO) == {"a": 40.0}


def test_forecast_places_per_node() -> None:
    """Two nodes of 2 CPUs with one free on each: a 2-worker group packs across them now, a strict_pack one waits for
    a whole node."""
    nodes = {"n0": {CPU: 2.0}, "n1": {CPU: 2.0}}
    running = [runner("r0", 1, 100), runner("r1", 1, 200)]
    spread = waiter("a", 2, 10, workers=2)
    strict = waiter("b", 2, 10, workers=2, placement="strict_pack", seq=1)
    assert forecast([spread], running, nodes, 0.0, policy=FIFO) == {"a": 0}
    assert forecast([strict], running, nodes, 0.0, policy=FIFO) == {"b": 100}


def test_projected_submissions_of_an_owner_who_used_less_go_ahead() -> None:
    """alice (no usage) keeps submitting 2-CPU jobs of 100 s; bob's job (his usage 500 CPU-seconds) waits behind her
    two queued ones and then behind each of hers that arrives while her usage is still below his: one more (her usage
    is 400 at 200 s, 600 at 300 s). Without her projected jobs he would start at 200."""
    fair = Policy(fair=FairShare(projection_seconds=1.0))
    queued = [waiter("a1", 2, 100, seq=0), waiter("a2", 2, 100, seq=1), waiter("b1", 2, 100, owner="bob", seq=2)]
    usage = Usage(teams={"~bob": 500.0}, owners={"bob": 500.0})
    alone = forecast(queued, [], one_node(2), 0.0, usage=usage, policy=fair)
    assert alone == {"a1": 0, "a2": 100, "b1": 200}
    template = (waiter("t", 2, 100),)
    keeps = [Arrivals("alice", 150.0, 100.0, template)]
    projected = forecast(queued, [], one_node(2), 0.0, usage=usage, policy=fair, arrivals=keeps)
    assert projected["a1"] == 0 and projected["a2"] == 100
    assert projected["b1"] == 300
    # Projected jobs are competitors only: never reported.
    assert set(projected) == {"a1", "a2", "b1"}


def test_projected_submissions_come_behind_the_owners_queued_jobs() -> None:
    """An owner's own projected jobs never delay its queued ones (FIFO within an owner)."""
    queued = [waiter("a1", 2, 100, seq=0), waiter("a2", 2, 100, seq=1)]
    keeps = [Arrivals("alice", 1.0, 1.0, (waiter("t", 2, 100),))]
    assert forecast(queued, [], one_node(2), 0.0, policy=Policy(), arrivals=keeps) == {"a1": 0, "a2": 100}


def test_an_owner_quota_holds_a_job_while_there_is_room() -> None:
    rules = Quotas(owners={"alice": Quota(max_cpus=2)})
    running = [runner("r", 2, 50, owner="alice")]
    queued = [waiter("a", 1, 10), waiter("b", 1, 10, owner="bob", seq=1)]
    policy = Policy(fair=FIFO.fair, rules=rules)
    assert forecast(queued, running, one_node(8), 0.0, policy=policy) == {"a": 50, "b": 0}


def test_a_lender_gets_its_quota_back_after_one_grace() -> None:
    """Queue b borrows all 4 CPUs of a cohort; a job of queue a (nominal 2) takes them back by reclaim: it starts
    when the borrower's grace runs out, not when the borrower would have ended."""
    limits = {q: QueueLimit(max_cpus=2, cohort="c") for q in ("a", "b")}
    running = [runner("b1", 2, 1000, queue="b", seq=0), runner("b2", 2, 1000, queue="b", seq=1)]
    policy = Policy(fair=FIFO.fair, limits=limits, grace_seconds=60)
    assert forecast([waiter("a1", 2, 100, queue="a")], running, one_node(4), 0.0, policy=policy) == {"a1": 60}


def test_a_yielding_job_stops_at_its_grace_and_queues_again() -> None:
    """A running job already asked to yield frees its room at its stop; the rest of its run queues again, ahead of
    later jobs of the same priority (its FIFO place is its creation)."""
    rest = waiter("r", 2, 500, seq=-1, not_before=30)
    yielding = Runner("r", "zed", None, "default", 0, -1, {CPU: 2}, 30.0, yielding=True, rest=rest)
    queued = [waiter("a", 2, 100, seq=0)]
    assert forecast(queued, [yielding], one_node(2), 0.0, policy=FIFO) == {"a": 530}


def test_a_higher_priority_job_preempts_in_its_queue() -> None:
    limits = {"default": QueueLimit(preemption=True)}
    running = [runner("low", 2, 1000, prio=0)]
    policy = Policy(fair=FIFO.fair, limits=limits, grace_seconds=45)
    assert forecast([waiter("hi", 2, 100, prio=5)], running, one_node(2), 0.0, policy=policy) == {"hi": 45}


@pytest.mark.parametrize(("grow", "expected"), [(False, 100), (True, 1060)], ids=["growth-off", "growth-on"])
def test_the_replay_grows_an_elastic_job_as_the_dispatcher_would(grow: bool, expected: float) -> None:
    """The replay runs the dispatcher's whole pass (service.policy.admission_pass), growth included: an elastic job
    at 2 of 2..4 workers that has run past `grow_after_seconds`, with a job of lower priority waiting, is asked to grow
    into the 2 free CPUs. It checkpoints at the notice and stops after its grace (60 s), comes back at 4 workers ahead
    of the waiting job (its priority is higher) for the 1000 s it had left, and holds the room that job would have had
    once the other running job ends at 100."""
    elastic = Candidate("e", 5, -2, 4, {CPU: 1.0}, "pack", "default", "zed", None, min_workers=2)
    running = [Runner("e", "zed", None, "default", 5, -2, {CPU: 2}, 1000.0, cand=elastic, size=2, started=-900.0),
               runner("r", 2, 100)]  # fmt: skip
    policy = Policy(fair=FIFO.fair, grace_seconds=60, grow=grow, grow_after_seconds=600)
    assert forecast([waiter("q", 3, 50)], running, one_node(6), 0.0, policy=policy) == {"q": expected}


def test_a_replay_that_cannot_end_gives_no_estimate_instead_of_spinning() -> None:
    """Projected submissions never free room: with nothing that ends, the replay stops at once."""
    keeps = [Arrivals("bob", 0.0, 0.001, (waiter("t", 1, 10, owner="bob"),))]
    assert forecast([waiter("a", 3, 10)], [runner("r", 2, None)], one_node(4), 0.0, arrivals=keeps) == {"a": None}


@pytest.mark.parametrize(
    ("timeout", "step", "total", "progress_at", "expected"),
    [
        (None, None, None, None, None),
        (100.0, None, None, None, 100.0),  # started at 0
        (None, 10, 40, 20.0, 80.0),  # 10 steps in 20 s: 30 steps left take 60 s more
        (50.0, 10, 40, 20.0, 50.0),  # the timeout comes first
        (None, 50, 40, 20.0, None),  # past its announced total: not a projection to trust
    ],
)
def test_expected_end(timeout, step, total, progress_at, expected) -> None:
    assert expected_end(0.0, timeout, step, total, progress_at) == expected


@settings(max_examples=200, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(st.integers(1, 4), st.one_of(st.none(), st.integers(1, 100)), st.sampled_from(["a", "b", "c"])),
        min_size=1, max_size=12,
    ),
    running=st.lists(st.tuples(st.integers(1, 4), st.one_of(st.none(), st.integers(1, 200))), max_size=3),
    fair=st.booleans(),
    arrive=st.booleans(),
)  # fmt: skip
def test_forecast_never_overcommits_nor_starts_before_now(jobs: list, running: list, fair: bool, arrive: bool) -> None:
    """At every instant the replayed jobs and the running ones together fit the capacity; no start is in the past."""
    capacity = 8
    assume(sum(need for need, _ in running) <= capacity)  # what runs fits the cluster
    order = [waiter(f"j{i}", need, duration, owner=owner, seq=i) for i, (need, duration, owner) in enumerate(jobs)]
    held = [runner(f"r{i}", need, end) for i, (need, end) in enumerate(running)]
    keeps = [Arrivals("d", 5.0, 7.0, (waiter("t", 3, 20, owner="d"),))] if arrive else []
    policy = Policy() if fair else FIFO
    starts = forecast(order, held, one_node(capacity), 0.0, policy=policy, arrivals=keeps)
    assert set(starts) == {w.cand.job_id for w in order}
    intervals = [(0.0, end if end is not None else float("inf"), need) for need, end in running]
    for job in order:
        start = starts[job.cand.job_id]
        if start is not None:
            assert start >= 0.0
            intervals.append((start, start + job.duration if job.duration else float("inf"), job.cand.total()[CPU]))
    for t in {s for s, _, _ in intervals}:
        assert sum(need for s, e, need in intervals if s <= t < e) <= capacity


# ---- what the estimate reads from the database --------------------------------------------------------------------
NOW = datetime(2030, 6, 1, 12, 0, tzinfo=timezone.utc)


def _job(session: Session, job_id: str, owner: str, *, created: datetime, timeout: float | None = 100.0,
         ran: float | None = None, state: JobState = JobState.SUCCEEDED) -> None:  # fmt: skip
    spec = {"entrypoint": {"callable": "examples.mlp:train_loop"}, "resources": {"num_workers": 1}}
    if timeout is not None:
        spec["timeout_seconds"] = timeout
    session.add(
        Job(id=job_id, name=job_id, owner=owner, spec=spec, state=state, created_at=created, attempt=1 if ran else 0)
    )
    session.flush()
    if ran is not None:
        start = created + timedelta(seconds=5)
        end = start + timedelta(seconds=ran)
        session.add(Attempt(job_id=job_id, number=1, submission_id=f"s-{job_id}", started_at=start, ended_at=end,
                            end_reason=EndReason.SUCCEEDED, cpus=1.0))  # fmt: skip


def test_run_ratios_and_projected_submissions_from_history(db: Engine) -> None:
    """alice's last jobs ran 40-60% of their timeouts; bob has too little history and takes everyone's median; an
    owner who submitted 6 jobs in the last hour is projected to submit one every 10 minutes after her latest, and one
    who submitted a batch of 3 at once, one every 20 minutes (a batch is not a rate)."""
    with Session(db) as session:
        for i, ran in enumerate([40.0, 50.0, 60.0, 55.0, 45.0, 50.0]):
            _job(session, f"a{i}", "alice", created=NOW - timedelta(minutes=50 - 5 * i), ran=ran)
        _job(session, "b0", "bob", created=NOW - timedelta(hours=3), ran=90.0)  # before the window: not counted
        for i, timeout in enumerate([None, 100.0, 100.0]):
            _job(session, f"b{i + 1}", "bob", created=NOW - timedelta(minutes=2, seconds=i), state=JobState.QUEUED,
                 timeout=timeout)  # fmt: skip
        session.commit()
        ratios = estimate.run_ratios(session, NOW, cached=False)
        assert ratios("alice") == pytest.approx(0.5)
        assert ratios("bob") == pytest.approx(0.5)  # the median of all seven
        assert ratios("nobody") == pytest.approx(0.5)
        projected = {a.owner: a for a in estimate.arrivals(session, NOW, ratios)}
    alice, bob = projected["alice"], projected["bob"]
    assert alice.every == pytest.approx(600.0)
    assert alice.first == pytest.approx((NOW - timedelta(minutes=25)).timestamp() + 600.0)
    assert [t.duration for t in alice.templates] == [pytest.approx(50.0)] * 6  # timeout 100 x her ratio
    assert all(t.projected for t in alice.templates)
    assert bob.every == pytest.approx(1200.0)
    assert [t.duration for t in bob.templates] == [pytest.approx(50.0), pytest.approx(50.0), None]  # oldest first


def test_a_job_without_a_timeout_is_never_projected() -> None:
    """bob's jobs have no timeout: projecting one would hold the cluster for ever and leave alice no estimate."""
    keeps = [Arrivals("bob", 0.0, 10.0, (waiter("t", 2, None, owner="bob"),))]
    running = [runner("r", 2, 100)]
    assert forecast([waiter("a", 2, 50)], running, one_node(2), 0.0, policy=FIFO, arrivals=keeps) == {"a": 100}


def test_an_owner_who_floods_submissions_costs_no_more_events_than_any_other() -> None:
    """Projected at one job every 10 ms, an owner would take 5,000 events to reach t=50, past the replay's budget,
    and leave alice without an estimate; but it already waits with two projected jobs, so it takes none until one
    starts."""
    flood = [Arrivals("flood", 0.0, 0.01, (waiter("t", 1, 100, owner="flood"),))]
    usage = Usage(teams={"~flood": 1e6}, owners={"flood": 1e6})
    starts = forecast([waiter("a", 2, 10)], [runner("r", 2, 50)], one_node(2), 0.0, usage=usage, arrivals=flood)
    assert starts == {"a": 50}


def test_a_listing_never_waits_for_a_deep_queues_estimate(db: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """`estimates_nowait` (GET /v1/jobs?positions=true): with no answer yet and a queue deeper than INLINE_QUEUED it
    answers at once with no places and computes in a thread of its own; the next listing has them. Once an answer
    was cheap (under INLINE_SECONDS), a listing computes its own, fresh one."""
    from tests.conftest import wait_for

    with Session(db) as session:
        _one_cpu_cluster(session)
        for i in range(3):
            _job(session, f"q{i}", "alice", created=NOW + timedelta(seconds=i), state=JobState.QUEUED)
        session.commit()
    settings = _uncached_settings(db, "nowait")
    monkeypatch.setattr(estimate, "INLINE_QUEUED", 2)  # three queued: "deep"
    monkeypatch.setattr(estimate, "INLINE_SECONDS", 0.0)  # no answer is cheap enough to compute inline
    with Session(db) as session:
        assert estimate.estimates_nowait(session, settings) == {}
    placed = wait_for(lambda: estimate._cache.get(str(settings.database_url)), timeout=30, what="the thread's answer")
    with Session(db) as session:
        got = estimate.estimates_nowait(session, settings)
    assert got is placed.result and sorted(got) == ["q0", "q1", "q2"]  # type: ignore[attr-defined]
    assert [got[f"q{i}"].position for i in range(3)] == [1, 2, 3]
    monkeypatch.setattr(estimate, "INLINE_SECONDS", 1e9)  # every answer is cheap now: computed inline, if stale
    with Session(db) as session:
        session.add(Job(id="q3", name="q3", owner="alice", spec={"entrypoint": {"callable": "examples.mlp:train_loop"}},
                        state=JobState.QUEUED, created_at=NOW + timedelta(seconds=9)))  # fmt: skip
        session.commit()
        estimate._cache[str(settings.database_url)].at -= 3600  # stale
        assert sorted(estimate.estimates_nowait(session, settings)) == ["q0", "q1", "q2", "q3"]


def test_a_job_read_right_after_its_submit_has_its_place_while_answers_are_cheap(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /v1/jobs/{id} of a job queued after the last answer (fresh, so reused for a listing) computes a new answer
    when answers cost under INLINE_SECONDS; of a costly answer (a deep queue) it waits COST_FACTOR times its cost."""
    with Session(db) as session:
        _one_cpu_cluster(session)
        _job(session, "q0", "alice", created=NOW, state=JobState.QUEUED)
        session.commit()
    settings = _uncached_settings(db, "read-back")
    key = str(settings.database_url)
    # Every answer cheap, then (below) every answer costly: the policy is asserted, not this machine's speed. With
    # Ray training beside it, a 2-job answer took over the real 0.25 s once, and the read waited as for a costly one.
    monkeypatch.setattr(estimate, "INLINE_SECONDS", 3600.0)
    with Session(db) as session:
        assert sorted(estimate.estimates(session, settings, job_id="q0")) == ["q0"]
        _job(session, "q1", "bob", created=NOW + timedelta(seconds=1), state=JobState.QUEUED)
        session.commit()
        assert sorted(estimate.estimates(session, settings)) == ["q0"]  # a listing reuses the fresh answer
        got = estimate.estimates(session, settings, job_id="q1")
        assert sorted(got) == ["q0", "q1"] and got["q1"].position == 2
        _job(session, "q2", "carol", created=NOW + timedelta(seconds=2), state=JobState.QUEUED)
        session.commit()
        monkeypatch.setattr(estimate, "INLINE_SECONDS", 0.0)  # every answer costly: too soon for a new one ...
        monkeypatch.setattr(estimate, "INLINE_SHORT_QUEUE", 1)  # ... and the queue not short
        estimate._cache[key] = estimate._Cached(time.monotonic(), 3600.0, got)
        assert "q2" not in estimate.estimates(session, settings, job_id="q2")
        # A short queue's answer is cheap whatever its last one took (a loaded machine's clock): the read has its
        # place at once (a slow-tier run under load saw a just-submitted job with none).
        monkeypatch.setattr(estimate, "INLINE_SHORT_QUEUE", 100)
        assert estimate.estimates(session, settings, job_id="q2")["q2"].position == 3


def test_reads_of_a_job_in_no_answer_that_waited_together_share_one_compute(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job waiting on its dependencies is in no answer: eight reads of it at once, behind one compute in flight,
    take that compute's answer instead of each computing again (a user hammering it would hold up everyone's reads)."""
    import threading

    from tests.conftest import wait_for

    with Session(db) as session:
        _one_cpu_cluster(session)
        _job(session, "q0", "alice", created=NOW, state=JobState.QUEUED)
        session.commit()
    settings = _uncached_settings(db, "shared")
    real, computes, gate = estimate._compute, [], threading.Event()

    def counted(*args: object) -> object:
        computes.append(1)
        gate.wait(10)  # every reader is waiting by the time this answer lands
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(estimate, "_compute", counted)
    with Session(db) as session:
        gate.set()
        estimate.estimates(session, settings)  # a first, cheap answer: reads of a job not in it wait for a new one
    gate.clear()
    computes.clear()

    class CountedLock:
        """The estimate's lock, counting the reads that came to it: all eight have asked (and wait) before the one
        compute among them may end, with no sleep to guess when."""

        def __init__(self) -> None:
            self._lock, self._count, self.arrived = threading.Lock(), threading.Lock(), 0

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            with self._count:
                self.arrived += 1
            return self._lock.acquire(blocking, timeout)

        def release(self) -> None:
            self._lock.release()

        def locked(self) -> bool:
            return self._lock.locked()

    lock = CountedLock()
    monkeypatch.setitem(estimate._locks, str(settings.database_url), lock)

    def read() -> None:
        with Session(db) as session:
            estimate.estimates(session, settings, job_id="waiting-on-a-dependency")

    readers = [threading.Thread(target=read) for _ in range(8)]
    for reader in readers:
        reader.start()
    wait_for(lambda: lock.arrived == 8 and len(computes) == 1, timeout=30, what="all eight reads waiting")
    gate.set()
    for reader in readers:
        reader.join(30)
    assert len(computes) == 1, f"{len(computes)} computes for 8 reads that waited together"


def _one_cpu_cluster(session: Session) -> None:
    """The cluster snapshot the estimate reads: one live node of 1 CPU."""
    from service.store.models import ClusterSnapshot

    session.merge(ClusterSnapshot(id=1, total={"CPU": 1.0}, available={"CPU": 1.0},
                                  nodes=[{"node_id": "n", "alive": True, "total": {"CPU": 1.0}}]))  # fmt: skip


def _uncached_settings(db: Engine, tag: str) -> Settings:
    """Settings for `db` under a URL of this test's own (`#tag`), with no answer of this process kept for it."""
    settings = Settings(database_url=f"{db.url.render_as_string(hide_password=False)}#{tag}")
    estimate._cache.pop(str(settings.database_url), None)
    return settings
