"""Profile one dispatcher draining no-op jobs (the worst ratio of the suite: claims/s on PostgreSQL).

`python -m bench.profile_claims [--db postgres|sqlite] [--jobs 600]`: runs `Dispatcher.tick` in this process under
cProfile until every job SUCCEEDED, then prints the top of the profile.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

from bench import common


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", default="postgres", choices=("postgres", "sqlite"))
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()

    from sqlalchemy import func
    from sqlmodel import Session, select

    from service.db import make_engine
    from service.dispatcher import Dispatcher
    from service.models import Job, JobState
    from service.noop_backend import NoopJobs
    from service.settings import Settings

    work = Path(tempfile.mkdtemp(prefix="shunter-bench-profile-"))
    with common.fresh_db(args.db, work) as url:
        engine = make_engine(url)
        common.enqueue(engine, args.jobs)
        settings = Settings(database_url=url, backend=f"noop:{work / 'noop'}", data_dir=work)
        disp = Dispatcher(engine=engine, settings=settings, ray=NoopJobs(work / "noop"), owner="bench-profile")

        def left() -> int:
            with Session(engine) as s:
                return s.exec(select(func.count()).select_from(Job).where(Job.state != JobState.SUCCEEDED)).one()

        profiler = cProfile.Profile()
        started = time.perf_counter()
        cpu_started = time.process_time()
        ticks = 0
        profiler.enable()
        while left():
            disp.tick()
            ticks += 1
        profiler.disable()
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        disp._pool.shutdown(wait=True)
        engine.dispose()
    print(f"{args.db}: {args.jobs} jobs in {elapsed:.2f}s over {ticks} ticks (no sleep between ticks): "
          f"{args.jobs / elapsed:.0f} jobs/s under the profiler; this process's CPU time {cpu:.2f}s")  # fmt: skip
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(r"service/|api/", args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
