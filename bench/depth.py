"""Part 4: claim latency (one admission pass that admits one job) and list latency with 100, 10k, 100k queued jobs.

The admission pass is `Dispatcher.admit` in this process against a cluster view with room for exactly one job (the
noop backend takes the submission); the admitted job is then ended outside the timing so every pass admits one.
List latency is measured against a real `shunter api` process on the same database.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.common import log


def _admit_latency(engine: Any, url: str, work: Path, passes: int) -> list[float]:
    from sqlalchemy import update

    from service.backends.noop import NoopJobs
    from service.backends.ray_jobs import ClusterView, NodeView
    from service.config.settings import Settings
    from service.dispatch.dispatcher import Dispatcher
    from service.store.models import Job, JobState

    settings = Settings(database_url=url, backend="noop:x", data_dir=work)
    room = {"CPU": 1.0, "GPU": 0.0, "memory": 1e15}
    cluster = ClusterView(nodes=[NodeView("n1", "127.0.0.1", True, dict(room), dict(room))])
    disp = Dispatcher(engine=engine, settings=settings, ray=NoopJobs(work / f"noop-{uuid.uuid4().hex[:6]}"),
                      owner="bench-depth")  # fmt: skip
    times = []
    try:
        for i in range(passes + 2):
            t0 = time.perf_counter()
            admitted = disp.admit(cluster)
            elapsed = time.perf_counter() - t0
            if len(admitted) != 1:
                raise AssertionError(f"an admission pass admitted {len(admitted)} jobs, expected 1")
            with engine.begin() as conn:
                conn.execute(update(Job).where(Job.id.in_(admitted)).values(state=JobState.SUCCEEDED))
            if i >= 2:  # the first passes write every waiting job's reason once
                times.append(elapsed)
    finally:
        disp._pool.shutdown(wait=False)
    return times


def _list_latency(base: str, params: dict[str, Any], n: int) -> list[float]:
    times = []
    with httpx.Client(base_url=base, timeout=60) as client:
        for i in range(n + 3):
            t0 = time.perf_counter()
            r = client.get("/v1/jobs", params=params)
            elapsed = time.perf_counter() - t0
            r.raise_for_status()
            if i >= 3:
                times.append(elapsed)
    return times


# The indexes this suite once proposed, which migration 075fa942e034 made: the last row measures the queue without
# them, to show what they buy (creating them again failed on a fresh clone: they exist already).
QUEUE_INDEXES = (
    "ix_jobs_admission_order",  # admission order is priority DESC, created_at, id: no sort of every queued job
    "ix_jobs_owner_admission_order",  # fair share's per-owner heads, in the same order
    "ix_jobs_state_queue_created",  # GET /v1/jobs?state=&queue= pages newest first
    "ix_jobs_name_created",  # GET /v1/jobs?name=
)


def _analyze(engine: Any, kind: str) -> None:
    from sqlalchemy import text

    if kind == "postgres":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))  # as autovacuum would soon after a bulk load


def _measure(
    engine: Any, url: str, work: Path, base: str, kind: str, depth: int, fill: float, passes: int, lists: int,
    variant: str = "as is",
) -> dict[str, Any]:  # fmt: skip
    admit = _admit_latency(engine, url, work, passes)
    plain = _list_latency(base, {"limit": 50}, lists)
    filtered = _list_latency(base, {"limit": 50, "state": "QUEUED", "queue": "default"}, lists)
    by_name = _list_latency(base, {"limit": 50, "name": f"noop-{depth // 2}"}, lists)
    row = {
        "db": kind, "queued": depth, "variant": variant, "fill_s": fill,
        "admit_pass_ms_p50": common.median(admit) * 1e3, "admit_pass_ms_p90": common.pct(admit, 90) * 1e3,
        "list_ms_p50": common.median(plain) * 1e3,
        "list_filtered_ms_p50": common.median(filtered) * 1e3,
        "list_by_name_ms_p50": common.median(by_name) * 1e3,
    }  # fmt: skip
    log(f"part 4: {kind} {depth:>6} queued ({variant}): admit pass {row['admit_pass_ms_p50']:.1f} ms, list "
        f"{row['list_ms_p50']:.1f} ms, state+queue {row['list_filtered_ms_p50']:.1f} ms, "
        f"name {row['list_by_name_ms_p50']:.1f} ms (fill {fill:.1f}s)")  # fmt: skip
    return row


def measure_db(kind: str, depths: list[int], work: Path, quick: bool) -> list[dict[str, Any]]:
    from sqlalchemy import text

    from service.backends.ray_local import free_port
    from service.store.db import make_engine

    rows = []
    passes, lists = (8, 10) if quick else (20, 20)
    with common.fresh_db(kind, work) as url:
        engine = make_engine(url)
        port = free_port()
        env = common.base_env(SHUNTER_DATABASE_URL=url, SHUNTER_BACKEND=f"noop:{work / uuid.uuid4().hex[:6]}",
                              SHUNTER_DATA_DIR=str(work), SHUNTER_PORT=str(port))  # fmt: skip
        proc = common.spawn(common.shunter_cmd("api"), env=env, log_path=work / f"api-{kind}.log")
        try:
            common.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60, proc=proc)
            have = 0
            base = f"http://127.0.0.1:{port}"
            for depth in depths:
                t0 = time.monotonic()
                common.enqueue(engine, depth - have, offset=have)
                have = depth
                _analyze(engine, kind)
                rows.append(_measure(engine, url, work, base, kind, depth, time.monotonic() - t0, passes, lists))
            # What the queue's indexes buy: the deepest queue again without them.
            with engine.begin() as conn:
                for name in QUEUE_INDEXES:
                    conn.execute(text(f"DROP INDEX IF EXISTS {name}"))
            _analyze(engine, kind)
            rows.append(_measure(engine, url, work, base, kind, have, 0.0, passes, lists, variant="without indexes"))
        finally:
            common.stop(proc)
            engine.dispose()
    return rows


def run(quick: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="shunter-bench-depth-"))
    depths = [100, 10_000, 30_000] if quick else [100, 10_000, 100_000]
    kinds = ["sqlite"] + (["postgres"] if common.postgres_available() else [])
    rows = [r for kind in kinds for r in measure_db(kind, depths, work, quick)]
    ratios, targets = {}, {}
    top = depths[-1]
    for kind in kinds:
        lo = next(r for r in rows if r["db"] == kind and r["queued"] == depths[0])
        hi = next(r for r in rows if r["db"] == kind and r["queued"] == top and r["variant"] == "as is")
        bare = next(r for r in rows if r["db"] == kind and r["variant"] == "without indexes")
        for key in ("admit_pass_ms_p50", "list_ms_p50", "list_filtered_ms_p50", "list_by_name_ms_p50"):
            ratios[f"{kind} {key} {top}/{depths[0]}"] = hi[key] / lo[key]
            ratios[f"{kind} {key} {top} without the queue's indexes/{depths[0]}"] = bare[key] / lo[key]
            targets[f"{kind} {key}: {top} <= 1.5x {depths[0]}"] = hi[key] / lo[key] <= 1.5
    return {"depths": depths, "rows": rows, "ratios": ratios, "targets": targets}
