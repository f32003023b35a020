"""Part 3: no-op jobs drained by 1, 2 and 4 dispatcher processes (SHUNTER_BACKEND=noop) on SQLite and PostgreSQL.

claims/s: QUEUED->STARTING events per second, from the first claim to the last (dispatchers are started and idle
before the jobs are enqueued, so their start-up is not counted). jobs/s: first claim to last SUCCEEDED. Every job
must be claimed exactly once (checked from the event log). statements_per_job / commits_per_job: every SQL statement
(one execute or executemany) and commit the dispatcher processes made from the enqueue to the last SUCCEEDED seen
(their idle ticks included), counted in each process by bench.statements, over the jobs drained.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import common, statements
from bench.common import log


def _ts(at: Any) -> float:
    from datetime import UTC

    return (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


def drain(kind: str, n_jobs: int, n_dispatchers: int, work: Path) -> dict[str, Any]:
    from sqlalchemy import func
    from sqlmodel import Session, select

    from service.store.db import make_engine
    from service.store.models import Job, JobEvent, JobState

    with common.fresh_db(kind, work) as url:
        engine = make_engine(url)
        noop = work / f"noop-{kind}-{n_dispatchers}"
        procs = []
        counts: list[Path] = []
        try:
            for i in range(n_dispatchers):
                env = common.base_env(
                    SHUNTER_DATABASE_URL=url, SHUNTER_BACKEND=f"noop:{noop}", SHUNTER_DISPATCHER_TICK_SECONDS="0.05",
                    SHUNTER_DATA_DIR=str(work), SHUNTER_DISPATCHER_ID=f"bench-d{i}",
                )  # fmt: skip
                logp = work / f"d-{kind}-{n_dispatchers}-{i}.log"
                counts.append(work / f"count-{kind}-{n_dispatchers}-{i}")
                cmd = [sys.executable, "-m", "bench.statements", str(counts[-1]), "dispatcher"]
                procs.append((common.spawn(cmd, env=env, log_path=logp), logp))
            # Idle dispatchers first: each writes the cluster snapshot every tick once its loop runs.
            time.sleep(1.0)
            common.wait_for(lambda: all(p.poll() is None for p, _ in procs)
                            and _ticking(engine), timeout=60, interval=0.2, what="dispatchers idle")  # fmt: skip
            time.sleep(1.0)
            before = _totals(counts)
            common.enqueue(engine, n_jobs)

            def done() -> bool:
                for p, lp in procs:
                    if p.poll() is not None:
                        raise RuntimeError(f"dispatcher exited {p.returncode}: {lp.read_text()[-2000:]}")
                with Session(engine) as s:
                    count = s.exec(select(func.count()).select_from(Job).where(Job.state == JobState.SUCCEEDED)).one()
                return count == n_jobs

            common.wait_for(done, timeout=300, interval=0.25, what=f"{n_jobs} jobs SUCCEEDED")
            time.sleep(0.15)  # the count files are written every 0.1 s
            after = _totals(counts)
        finally:
            for p, _ in procs:
                common.stop(p)
        with Session(engine) as s:
            events = s.exec(select(JobEvent.job_id, JobEvent.to_state, JobEvent.at, JobEvent.actor)
                            .where(JobEvent.kind == "state")).all()  # fmt: skip
        engine.dispose()
    starts = [e for e in events if e[1] == JobState.STARTING]
    ends = [e for e in events if e[1] == JobState.SUCCEEDED]
    claims = Counter(e[0] for e in starts)
    double = sum(1 for c in claims.values() if c > 1)
    if double or len(claims) != n_jobs:
        raise AssertionError(f"{kind}/{n_dispatchers}: {double} double claims, {len(claims)}/{n_jobs} claimed")
    first, last = min(_ts(e[2]) for e in starts), max(_ts(e[2]) for e in starts)
    last_end = max(_ts(e[2]) for e in ends)
    per_actor = Counter(e[3] for e in starts)
    row = {
        "db": kind, "dispatchers": n_dispatchers, "variant": "as is", "jobs": n_jobs,
        "claims_per_s": n_jobs / max(last - first, 1e-6),
        "jobs_per_s": n_jobs / max(last_end - first, 1e-6),
        "statements_per_job": (after[0] - before[0]) / n_jobs, "commits_per_job": (after[1] - before[1]) / n_jobs,
        "double_claims": double, "claims_by_dispatcher": dict(per_actor),
    }  # fmt: skip
    log(f"part 3: {kind} x{n_dispatchers} {row['variant']}: {row['claims_per_s']:.0f} claims/s, "
        f"{row['jobs_per_s']:.0f} jobs/s, {row['statements_per_job']:.2f} statements and "
        f"{row['commits_per_job']:.2f} commits per job, 0 double claims, "
        f"split {sorted(per_actor.values())}")  # fmt: skip
    return row


def _totals(counts: list[Path]) -> tuple[int, int]:
    """Statements and commits of every dispatcher so far."""
    each = [statements.read(p) for p in counts]
    return sum(s for s, _ in each), sum(c for _, c in each)


def _ticking(engine: Any) -> bool:
    from sqlmodel import Session

    from service.store.models import ClusterSnapshot

    with Session(engine) as s:
        return s.get(ClusterSnapshot, 1) is not None


def run(quick: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="shunter-bench-claims-"))
    n_jobs = 500 if quick else 1200
    kinds = ["sqlite"] + (["postgres"] if common.postgres_available() else [])
    rows = [drain(kind, n_jobs, k, work) for kind in kinds for k in (1, 2, 4)]
    pg4 = next((r for r in rows if r["db"] == "postgres" and r["dispatchers"] == 4 and r["variant"] == "as is"), None)
    ratios = {}
    for kind in kinds:
        one = next(r for r in rows if r["db"] == kind and r["dispatchers"] == 1)
        for r in rows:
            if r["db"] == kind and r["dispatchers"] > 1 and r["variant"] == "as is":
                ratios[f"{kind} claims/s x{r['dispatchers']}/x1"] = r["claims_per_s"] / one["claims_per_s"]
    return {
        "rows": rows,
        "ratios": ratios,
        "targets": {">= 500 claims/s on PostgreSQL with 4 dispatchers": bool(pg4 and pg4["claims_per_s"] >= 500),
                    "0 double claims": all(r["double_claims"] == 0 for r in rows)},
    }  # fmt: skip
