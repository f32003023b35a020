"""Issue 15, part 6: fair share, quotas, borrowing and start estimates proven at scale on a simulated cluster.

The noop backend ends every job at once on unlimited CPUs, so it cannot show who gets a finite cluster. Here thousands
of jobs from several owners and teams run through the real code: `service.lifecycle.jobs.submit`, N real `Dispatcher`s
ticking at once in threads (real contention on the database and the admission lock), on `SimJobs` (a finite cluster, job
durations, progress through `service.lifecycle.reports`) and a virtual clock (`service.core.clock`), which jumps from
one event (an arrival, a job's end, a preemption grace running out) to the next and steps a tick at a time while the
dispatchers still change something. After every round it records what is admitted per owner, team and queue, which
owners wait, each job's first start and, when first seen waiting, its `estimated_start` (`service.estimate`), then
`summarise` turns that into the numbers the issue asks for. tests/service/test_fairshare_sim.py asserts them.

    python -m bench.fairshare_sim --jobs 2000 --db sqlite --dispatchers 3 [--scenario fair|quota|borrow]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import random
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from bench.common import PG_ADMIN_URL, fresh_db, postgres_available
from bench.fairshare_model import START, Arrival, Record, Scenario, weight_shares
from service.backends.sim import SimJobs
from service.config.settings import Settings
from service.core import clock
from service.dispatch.dispatcher import Dispatcher
from service.estimate import estimates
from service.lifecycle import jobs
from service.spec.job import JobSpec
from service.store.db import make_engine
from service.store.models import ACTIVE_STATES, Job, JobEvent, JobState
from service.tenancy.auth import Caller

RESULTS = Path(__file__).resolve().parent / "results"
TEAMS = {"alice": "ml", "bob": "ml", "carol": "cv", "dave": "cv"}
FAIR_SHARE = {"half_life_hours": 24, "resource_weights": {"CPU": 1, "GPU": 10}, "owner_weights": {"alice": 2},
              "team_weights": {"ml": 2, "cv": 1}}  # fmt: skip
LIVE = (JobState.QUEUED, *ACTIVE_STATES)
log = logging.getLogger("fairshare_sim")


def _jobs(n: int | dict[str, int], owners: list[str] | None = None, *, rng: random.Random, workers: tuple[int, int],
          seconds: tuple[float, float], at: float | None = None, queue: str = "default",
          timeout_factor: float = 1.1) -> list[Arrival]:  # fmt: skip
    """`n` jobs, `owners` taking turns, or `n[owner]` jobs of each owner in turn while it has some left. Each has a
    timeout `timeout_factor` x its real length, as users who know their jobs set them."""
    counts = dict(n) if isinstance(n, dict) else {o: n // len(owners or []) + (i < n % len(owners or [])) for i, o in
                                                   enumerate(owners or [])}  # fmt: skip
    out = []
    while any(counts.values()):
        for owner in [o for o, left in counts.items() if left]:
            counts[owner] -= 1
            length = round(rng.uniform(*seconds))
            out.append(Arrival(owner, TEAMS.get(owner), rng.randint(*workers), length, at, queue, 2 * length,
                               math.ceil(length * timeout_factor)))  # fmt: skip
    return out


def fair(jobs_n: int, *, seed: int = 1, cpus: int = 16, timeout_factor: float = 1.1) -> Scenario:
    """Four owners in two teams with different weights, each keeping 4 jobs waiting until its jobs are all submitted.
    Each has jobs in proportion to its weight, so that all keep jobs waiting for most of the run (the stretch the
    shares are measured over); under FIFO each would still get a quarter. Quotas are loose here (they bind in
    `quota`), so that they do not set the shares."""
    rng = random.Random(seed)
    shares = weight_shares(TEAMS, FAIR_SHARE)
    counts = {o: int(jobs_n * w) for o, w in shares.items()}
    remainders = sorted(shares, key=lambda o: jobs_n * shares[o] - counts[o], reverse=True)
    for o in remainders[: jobs_n - sum(counts.values())]:
        counts[o] += 1  # largest remainders: exactly jobs_n in all
    arrivals = _jobs(counts, rng=rng, workers=(1, 4), seconds=(30, 600), timeout_factor=timeout_factor)
    quotas = {"owner": {"*": {"max_running": 8, "max_cpus": 12}}, "team": {"cv": {"max_cpus": 12}}}
    return Scenario("fair", arrivals, {"fair_share": FAIR_SHARE, "quotas": quotas}, cpus=cpus)


def quota(jobs_n: int, *, seed: int = 2, cpus: int = 16, timeout_factor: float = 1.1) -> Scenario:
    """Quotas that bind all the time (8 CPUs may run of 16): none may be exceeded at any instant."""
    rng = random.Random(seed)
    arrivals = _jobs(jobs_n, ["alice", "bob", "carol"], rng=rng, workers=(1, 2), seconds=(30, 300),
                     timeout_factor=timeout_factor)  # fmt: skip
    quotas = {"owner": {"*": {"max_running": 3, "max_cpus": 4}, "bob": {"max_running": 2, "max_cpus": 2}},
              "team": {"ml": {"max_cpus": 5}, "cv": {"max_cpus": 3}}}  # fmt: skip
    return Scenario("quota", arrivals, {"fair_share": FAIR_SHARE, "quotas": quotas}, cpus=cpus, keep_waiting=3)


def borrow(cycles: int = 3, *, seed: int = 3, cpus: int = 16, timeout_factor: float = 1.1) -> Scenario:
    """Queues a and b (half the cluster each) in one cohort: b fills the idle cluster (borrowing all of a's quota),
    then a's jobs come and must get a's quota back within one preemption cycle; `cycles` times over."""
    rng = random.Random(seed)
    arrivals: list[Arrival] = []
    for c in range(cycles):
        t0 = c * 4000.0
        arrivals += _jobs(cpus // 2, ["bob"], rng=rng, workers=(2, 2), seconds=(1500, 2500), at=t0, queue="b",
                          timeout_factor=timeout_factor)  # fmt: skip
        arrivals += _jobs(cpus // 4, ["carol"], rng=rng, workers=(2, 2), seconds=(300, 600), at=t0 + 600, queue="a",
                          timeout_factor=timeout_factor)  # fmt: skip
    half = cpus // 2
    queues = {q: {"max_cpus": half, "cohort": "c", "borrowing_limit": {"cpus": half}} for q in ("a", "b")}
    return Scenario("borrow", arrivals, {"fair_share": FAIR_SHARE, "queues": queues}, cpus=cpus)


SCENARIOS = {"fair": fair, "quota": quota, "borrow": lambda n, **kw: borrow(max(1, n // 12), **kw)}


def missing_policy(scenario: Scenario) -> list[str]:
    """Policy settings this checkout's `Settings` does not have yet (they would be silently ignored)."""
    return [key for key in scenario.policy if key not in Settings.model_fields]


def settings_for(scenario: Scenario, workdir: Path) -> Settings:
    return Settings(
        database_url="sqlite://", data_dir=workdir / "data", storage_uri=str(workdir / "ckpt"),
        dispatcher_tick_seconds=scenario.tick, preemption_grace_seconds=scenario.grace, dispatcher_threads=4,
        # Dispatchers never die here; a lease must outlive the longest jump of the clock between two heartbeats.
        lease_seconds=10 * scenario.max_jump, progress_secret="sim-progress-secret-" + "x" * 24,
        **{k: v for k, v in scenario.policy.items() if k in Settings.model_fields},
    )  # fmt: skip


def simulate(
    engine: Engine, scenario: Scenario, *, dispatchers: int = 1, workdir: Path | None = None, estimate: bool = True
) -> Record:
    """Run `scenario` to its last job's end on `engine` (a fresh database with the schema); `estimate=False` takes no
    start estimates (they cost a replay of the queue each time a job is first seen waiting)."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="shunter-sim-"))
    settings = settings_for(scenario, workdir)
    virtual = clock.VirtualClock(START)
    backend = SimJobs(scenario.nodes(), engine=engine, report_every=scenario.report_every)
    fleet = [Dispatcher(engine=engine, settings=settings, ray=backend, owner=f"sim-{i}") for i in range(dispatchers)]
    rec = Record(scenario, dispatchers)
    estimate_fn, rec.estimator = (estimates, None) if estimate else (None, "not asked for")
    timed = sorted((a for a in scenario.arrivals if a.at is not None), key=lambda a: a.at or 0.0)
    backlog: dict[str, deque[Arrival]] = {}
    for a in scenario.arrivals:
        if a.at is None:
            backlog.setdefault(a.owner, deque()).append(a)
    waiting: dict[str, int] = {}
    nxt, now, started = 0, 0.0, time.monotonic()
    with clock.use(virtual), ThreadPoolExecutor(dispatchers, thread_name_prefix="sim-tick") as pool:
        try:
            while True:
                due = []
                while nxt < len(timed) and (timed[nxt].at or 0.0) <= now + 1e-9:
                    due.append(timed[nxt])
                    nxt += 1
                for owner, queue in backlog.items():
                    while queue and waiting.get(owner, 0) < scenario.keep_waiting:
                        due.append(queue.popleft())
                        waiting[owner] = waiting.get(owner, 0) + 1
                _submit(engine, settings, due, rec, now)
                before = _after_round(engine, settings, now)[0], backend.changes
                for fut in [pool.submit(_tick, d) for d in fleet]:
                    failure = fut.result()
                    if failure is not None:
                        rec.tick_failures[failure] = rec.tick_failures.get(failure, 0) + 1
                backend.deliver_progress()
                last, deadlines = _after_round(engine, settings, now)
                live, waiting = _observe(engine, settings, rec, now, estimate_fn)
                rec.rounds += 1
                if rec.rounds % 500 == 0:
                    log.info("%s: round %d, %.1f h simulated, %d of %d jobs submitted, %d not ended, %.0f s",
                             scenario.name, rec.rounds, now / 3600, len(rec.jobs), len(scenario.arrivals), live,
                             time.monotonic() - started)  # fmt: skip
                topping_up = any(q and waiting.get(o, 0) < scenario.keep_waiting for o, q in backlog.items())
                if nxt == len(timed) and not any(backlog.values()) and live == 0:
                    break
                upcoming = [now + scenario.max_jump, *(a.at or 0.0 for a in timed[nxt : nxt + 1]), *deadlines]
                end = backend.next_end()
                if end is not None:
                    upcoming.append(end - START.timestamp() + 1e-6)  # float round-off must not land just before
                if (last, backend.changes) != before or topping_up:
                    upcoming.append(now + scenario.tick)
                now = min(t for t in upcoming if t > now + 1e-9)
                virtual.set(START + timedelta(seconds=now))
                if rec.rounds > 50 * len(scenario.arrivals) + 10_000:
                    raise RuntimeError(f"{scenario.name}: no end after {rec.rounds} rounds (t={now:.0f}s)")
        finally:
            for disp in fleet:
                disp._pool.shutdown(wait=True)  # the dispatcher's reconcile pool (Dispatcher.run shuts it the same way)
    rec.runs, rec.end, rec.wall_seconds = backend.runs(), now, time.monotonic() - started
    return rec


_logged: set[str] = set()


def _tick(disp: Dispatcher) -> str | None:
    """One tick; as in `Dispatcher.run` a failed one is logged (each distinct failure once) and the next tries again."""
    try:
        disp.tick()
        return None
    except Exception as exc:  # noqa: BLE001
        failure = f"{type(exc).__name__}: {exc}"[:300]
        if failure not in _logged:
            _logged.add(failure)
            log.exception("dispatcher %s: tick failed", disp.owner)
        return failure


def _submit(engine: Engine, settings: Settings, due: list[Arrival], rec: Record, now: float) -> None:
    if not due:
        return
    with Session(engine) as session:
        for a in due:
            spec = JobSpec.model_validate({
                "name": f"sim-{a.owner}", "queue": a.queue, "entrypoint": {"callable": "examples.mlp:train_loop"},
                "resources": {"num_workers": a.workers}, "timeout_seconds": a.timeout,
                "runtime_env": {"env_vars": {"SIM_SECONDS": str(a.seconds), "SIM_STEPS": str(a.steps or "")}},
            })  # fmt: skip
            job, _ = jobs.submit(session, spec, caller=Caller(owner=a.owner, team=a.team), settings=settings)
            rec.jobs[job.id], rec.submitted[job.id] = a, now
        session.commit()


def _after_round(engine: Engine, settings: Settings, now: float) -> tuple[int, list[float]]:
    """The last event's id, and the times no backend call reveals: a preemption's grace running out, a retry's
    backoff ending."""
    asked = select(func.min(Job.preempt_requested_at)).where(col(Job.state).in_(ACTIVE_STATES))
    backoff = select(func.min(Job.not_before)).where(Job.state == JobState.QUEUED, col(Job.not_before) > START)
    query = select(select(func.max(JobEvent.id)).scalar_subquery(), asked.scalar_subquery(), backoff.scalar_subquery())
    with engine.connect() as conn:
        last, asked_at, backoff_at = conn.execute(query).one()
    out = []
    if asked_at is not None:
        out.append(_seconds(asked_at) + settings.preemption_grace_seconds)
    if backoff_at is not None and _seconds(backoff_at) > now:
        out.append(_seconds(backoff_at))
    return last or 0, out


def _seconds(at: datetime) -> float:
    return (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp() - START.timestamp()


def _observe(
    engine: Engine, settings: Settings, rec: Record, now: float, estimate_fn: Any
) -> tuple[int, dict[str, int]]:
    """Record what is admitted (by owner, team, queue) and what waits (CPUs by owner and queue); returns the number of
    jobs not ended, and how many wait per owner."""
    use: dict[str, list[float]] = {}
    waiting: dict[str, list[float]] = {}
    fresh = []
    with Session(engine) as session:
        query = select(Job.id, Job.state, Job.owner, Job.team, Job.queue).where(col(Job.state).in_(LIVE))
        rows = session.exec(query).all()
        for job_id, state, owner, team, queue in rows:
            cpus = float(rec.jobs[job_id].workers)
            if state == JobState.QUEUED:
                waiting.setdefault(f"owner:{owner}", []).append(cpus)
                waiting.setdefault(f"queue:{queue}", []).append(cpus)
                if job_id not in rec.seen:
                    fresh.append(job_id)
                continue
            rec.admitted.setdefault(job_id, now)
            if job_id in rec.seen:  # a preempted job waits again: its estimate is of its start after that
                rec.starts.setdefault(job_id, now)
            for key in (f"owner:{owner}", f"team:{team}", f"queue:{queue}"):
                held = use.setdefault(key, [0.0, 0.0, 0.0])
                held[0], held[1] = held[0] + 1, held[1] + cpus
        if fresh and estimate_fn is not None:
            found = estimate_fn(session, settings, now=START + timedelta(seconds=now))
            for job_id in fresh:
                start = getattr(found.get(job_id), "start", None)
                rec.estimates[job_id] = None if start is None else _seconds(start)
    for job_id in fresh:
        rec.seen[job_id] = now
    rec.samples.append((now, use, waiting))
    return len(rows), {k[6:]: len(v) for k, v in waiting.items() if k.startswith("owner:")}


@contextlib.contextmanager
def database(kind: str, workdir: Path) -> Iterator[Engine]:
    """A fresh database with shunter's schema (`bench.common.fresh_db`: PostgreSQL's is dropped afterwards)."""
    if kind == "postgres" and not postgres_available():
        raise SystemExit(f"PostgreSQL at {PG_ADMIN_URL} is not reachable")
    with fresh_db(kind, workdir) as url:
        engine = make_engine(url)
        try:
            yield engine
        finally:
            engine.dispose()


def main(argv: list[str] | None = None) -> int:
    from bench.fairshare_report import render, summarise

    parser = argparse.ArgumentParser(prog="python -m bench.fairshare_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--dispatchers", type=int, default=3)
    parser.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="default: bench/results/fairshare_sim-<db>-<n>.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    results = []
    for name in SCENARIOS if args.scenario == "all" else (args.scenario,):
        scenario = SCENARIOS[name](args.jobs if name == "fair" else max(60, args.jobs // 10), seed=args.seed)
        if missing_policy(scenario):
            print(f"note: Settings has no {missing_policy(scenario)} yet: {name} runs without them")
        with tempfile.TemporaryDirectory(prefix="shunter-sim-") as tmp, database(args.db, Path(tmp)) as engine:
            summary = summarise(simulate(engine, scenario, dispatchers=args.dispatchers, workdir=Path(tmp)))
        summary["db"] = args.db
        print(render(summary), flush=True)
        results.append(summary)
        out = args.out or RESULTS / f"fairshare_sim-{args.db}-{args.dispatchers}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")  # after each scenario: a long run stopped keeps these
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
