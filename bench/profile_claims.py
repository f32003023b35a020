"""Profile one dispatcher draining no-op jobs (the worst ratio of the suite: claims/s on PostgreSQL).

`python -m bench.profile_claims [--db postgres|sqlite] [--jobs 600]`: runs `Dispatcher.tick` in this process under
cProfile until every job SUCCEEDED, then prints the SQL statements and commits per job (by kind of statement:
bench.statements) and the top of the profile. `--no-profile`: the same drain without cProfile (its rate).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

from bench import common


class _Inline:
    """A pool whose map runs each call on the calling thread."""

    def map(self, fn, *iterables):  # noqa: ANN001, ANN201
        return map(fn, *iterables)

    def shutdown(self, wait: bool = True) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", default="postgres", choices=("postgres", "sqlite"))
    parser.add_argument("--jobs", type=int, default=600)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--no-profile", action="store_true", help="count statements and time the drain only")
    args = parser.parse_args()

    from sqlalchemy import func
    from sqlmodel import Session, select

    from bench.statements import Counter
    from service.backends.noop import NoopJobs
    from service.config.settings import Settings
    from service.dispatch.dispatcher import Dispatcher
    from service.store.db import make_engine
    from service.store.models import Job, JobState

    work = Path(tempfile.mkdtemp(prefix="shunter-bench-profile-"))
    with common.fresh_db(args.db, work) as url:
        engine = make_engine(url)
        common.enqueue(engine, args.jobs)
        settings = Settings(database_url=url, backend=f"noop:{work / 'noop'}", data_dir=work)
        disp = Dispatcher(engine=engine, settings=settings, ray=NoopJobs(work / "noop"), owner="bench-profile")

        watcher = make_engine(url)

        def left() -> int:
            with Session(watcher) as s:
                return s.exec(select(func.count()).select_from(Job).where(Job.state != JobState.SUCCEEDED)).one()

        profiler = cProfile.Profile()
        started = time.perf_counter()
        cpu_started = time.process_time()
        ticks = 0
        counter = Counter().install(engine)  # the dispatcher's statements only: left() has an engine of its own
        if not args.no_profile:
            # cProfile sees only the thread it runs in: reconcile on this thread too, in order, so the profile
            # holds the whole tick (its rate is then that of one thread).
            disp._pool.shutdown(wait=True)
            disp._pool = _Inline()  # type: ignore[assignment]
            profiler.enable()
        while left():
            disp.tick()
            ticks += 1
        profiler.disable()
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        disp._pool.shutdown(wait=True)
        engine.dispose()
        watcher.dispose()
    statements, commits = counter.totals()
    under = "without the profiler" if args.no_profile else "under the profiler"
    print(f"{args.db}: {args.jobs} jobs in {elapsed:.2f}s over {ticks} ticks (no sleep between ticks): "
          f"{args.jobs / elapsed:.0f} jobs/s {under}; this process's CPU time {cpu:.2f}s")  # fmt: skip
    print(f"statements per job: {statements / args.jobs:.2f}, commits per job: {commits / args.jobs:.2f}; by kind:")
    for shape, n in counter.shapes.most_common(20):
        print(f"  {n / args.jobs:6.2f}  {shape}")
    if args.no_profile:
        return
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(r"service/|api/", args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
