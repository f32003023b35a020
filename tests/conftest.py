"""Shared fixtures: one real local Ray head per test session, real SQLite files, the real PostgreSQL server."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import settings

from service.backends.ray_local import LocalHead, ensure_local_head, stop_local_head
from workers.warmup import use_interpreter_bin_first

T = TypeVar("T")


def in_a_loop_of_its_own(run: Callable[[], Coroutine[Any, Any, T]], timeout: float = 120) -> T:
    """`asyncio.run(run())` on a thread of its own. The test's own thread may have an event loop left running on it
    by an earlier test in the same xdist worker (Playwright's sync API, which tests/ui drive, runs one there), and
    asyncio.run refuses to start under one: a test passed alone and failed after those."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(run())).result(timeout=timeout)


# Property tests assert behaviour, never time: no per-example deadline (Hypothesis' 200 ms default is a wall-clock
# bound that a loaded CI core breaks; issue 34). A test's own @settings still sets its examples.
settings.register_profile("shunter", deadline=None)
settings.load_profile("shunter")

# Tests never join a stranger's cluster, and never start one per test (Ray costs ~5 s to start here).
os.environ.pop("RAY_ADDRESS", None)
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray Train's controller polls its workers this often, and each report waits for a poll: the product's default
# (SHUNTER_TRAIN_POLL_SECONDS, 0.25 s). The tests' former 0.1 s cost every 2-worker attempt ~0.06 CPU-s for each second
# it ran (12.6 against 11.4 CPU-s over 20 s, measured side by side), in a tier that is CPU-bound (issue 34).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray's background work on every test node, which the tests never read (issue 34: the slow tier is CPU-bound): the
# dashboard agent's node stats every 30 s instead of 5 (psutil over every Ray process of the node each time), and the
# log monitor's search for new log files at most every 0.5 s instead of at each 0.1 s poll (Ray's own pace once a
# node has 1,000 log files; a session head passes that mid-run). Worker output still reaches each job's log.
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "30000")
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
use_interpreter_bin_first()  # every process a test starts builds DeepSpeed's ops with the ninja Ray's processes use

RAY_TEST_CPUS = 4  # logical CPUs: 2-worker jobs use 2; the slack lets a test overlap a finishing job


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalHead]:
    """A real local Ray head (with dashboard and Jobs API), shared by the whole test session."""
    data_dir = tmp_path_factory.mktemp("ray-head")
    head = ensure_local_head(data_dir, num_cpus=RAY_TEST_CPUS, num_gpus=0)
    yield head
    import ray

    if ray.is_initialized():
        ray.shutdown()
    stop_local_head(data_dir)


@pytest.fixture(scope="session")
def session_multinode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One 3-node Ray cluster (`tests.service.conftest.multinode_cluster`) for every multi-node test of the session;
    tests take it through `multinode`, which puts removed or swapped nodes back. The tests that use it run one after
    another (in one lane of the slow tier: `lane_group`; last without xdist: `pytest_collection_modifyitems`), and the
    cluster is stopped after the last of them (`pytest_runtest_teardown`), so it is up only while they run."""
    from tests.service.conftest import multinode_cluster

    with multinode_cluster(tmp_path_factory.mktemp("multinode")) as mn:
        yield mn


MULTINODE_FIXTURES = {"session_multinode", "multinode", "three_nodes"}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last multi-node test of a run of them, stop the 3-node cluster rather than at the session's end: the
    multi-node group is the slow tier's longest and is handed out first (`LONG_SLOW`), and its lane goes on with other
    groups for minutes, where the idle cluster's daemons cost ~0.1 CPU-s a second. A later multi-node test would
    start it again. (pytest's own fixture teardown; where its internals differ, the cluster lives to the session's
    end, as before.)"""
    result = yield
    if uses_multinode(item) and (nextitem is None or not uses_multinode(nextitem)):
        try:
            fixturedefs = item.session._fixturemanager.getfixturedefs("session_multinode", item) or ()
        except AttributeError:
            fixturedefs = ()
        for fixturedef in fixturedefs:
            if getattr(fixturedef, "cached_result", None) is not None:
                fixturedef.finish(item._request)  # type: ignore[attr-defined]
    return result


def uses_multinode(item: pytest.Item) -> bool:
    return bool(MULTINODE_FIXTURES & set(getattr(item, "fixturenames", ())))


# The quick tier's longest cases (tens of seconds each, where most take milliseconds): run first, so that no xdist
# worker is left with one of them at the end while the others are idle (the tier ended ~1 minute after its other
# cases, on the fair-share simulation alone).
LONG_QUICK = ("tests/service/test_fairshare_sim.py", "tests/api/test_fuzz.py::test_openapi_all_checks",
              "tests/deploy/test_local_head.py",
              "tests/service/test_layering.py::test_the_tree_type_checks")  # fmt: skip
# Then the quick tier's modules whose cases add up to 10 s or more (the seconds of a run here with -n 3, 2026-12-06),
# heaviest first, and the thousands of millisecond cases last: in collection order the tier ended on
# tests/workers/ (hf_callback, preflight: torchrun and subprocess cases of 5-10 s each), with the other workers idle
# for its last ~2 minutes. A module not named here keeps its place after these.
HEAVY_QUICK = ("tests/service/test_tenancy.py", "tests/service/test_spec_roundtrip.py",
               "tests/workers/test_hf_callback.py", "tests/service/test_notify.py", "tests/security/test_audit2.py",
               "tests/service/test_progress_delivery.py", "tests/service/test_progress_credential.py",
               "tests/workers/test_preflight.py", "tests/service/test_state.py", "tests/api/test_stream_bounds.py",
               "tests/api/test_ray_log_ranges.py",
               "tests/service/test_signals.py", "tests/service/test_poison.py", "tests/ui/test_pages.py",
               "tests/service/test_sweeps.py", "tests/service/test_dependencies.py", "tests/api/test_usage.py",
               "tests/service/test_restored_checkpoint.py")  # fmt: skip


def quick_rank(nodeid: str) -> int:
    """Where a case goes in the run: the longest first (0), then the heavy modules in their order, then the rest."""
    if nodeid.startswith(LONG_QUICK):
        return 0
    module = nodeid.split("::", 1)[0]
    return 1 + HEAVY_QUICK.index(module) if module in HEAVY_QUICK else 1 + len(HEAVY_QUICK)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Multi-node tests after all others (in their order), so the session's 3-node cluster starts once, late, and
    stays up only while they run; in the quick tier, the longest cases and heaviest modules first."""
    items.sort(key=lambda item: (uses_multinode(item), quick_rank(item.nodeid)))  # stable


MULTINODE_PARAMETER = re.compile(r"\b(?:" + "|".join(sorted(MULTINODE_FIXTURES)) + r")\s*:")


def lane_group(nodeid: str, root: Path = Path(__file__).resolve().parents[1]) -> str:
    """What one lane of the slow tier runs whole: a test's module (its `shunter serve` and its scenarios start once),
    or one group of every module with a multi-node test (a test parameter named after one of MULTINODE_FIXTURES), so
    the 3-node cluster starts once, in one lane."""
    module = nodeid.split("::", 1)[0]
    if module not in _LANES:
        try:
            text = (root / module).read_text()
        except OSError:
            text = ""
        _LANES[module] = "multinode" if MULTINODE_PARAMETER.search(text) else module
    return _LANES[module]


_LANES: dict[str, str] = {}


# The slow tier's groups that take a lane longest (45 s or more of a loaded lane in a run of 2026-12-07: the
# multi-node group 779, test_faults 211, ..., test_driver_contract 49), handed out first: the longest-first rule, so
# that no lane is left with a long group while the other has run out of work. xdist's own order (most tests first)
# put groups of one long test last, and the tier's last ~4 minutes ran on one lane, the machine ~50 % busy. A group
# not named here comes after these, in xdist's order.
LONG_SLOW = ("multinode", "tests/service/test_faults.py", "tests/service/test_script_jobs.py",
             "tests/service/test_chaos.py", "tests/service/test_gcs_fault_tolerance.py",
             "tests/service/test_strategies_e2e.py", "tests/service/test_growth_ray.py",
             "tests/workers/test_storage.py", "tests/deploy/test_cluster_processes.py",
             "tests/service/test_e2e_serve.py", "tests/security/test_separate_user.py",
             "tests/ui/test_live_service.py", "tests/service/test_fair_share_ray.py",
             "tests/service/test_stall_e2e.py", "tests/gpu/test_tier.py", "tests/service/test_notify_e2e.py",
             "tests/workers/test_driver_contract.py", "tests/service/test_autoscaling.py")  # fmt: skip


def lane_rank(group: str) -> int:
    return LONG_SLOW.index(group) if group in LONG_SLOW else len(LONG_SLOW)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """The slow tier's two lanes (`pytest -m slow -n 2 --dist loadscope`, see the Makefile): xdist's scope scheduling
    with `lane_group` for a scope, the longest groups first (LONG_SLOW). pytest-xdist's own `loadgroup` does not group
    under this pytest (9.2): its `@group` suffix on node ids is not seen."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_group(nodeid)

        def _assign_work_unit(self, node: object) -> None:
            # The queue's first group is the one handed out: the longest left (LONG_SLOW), else xdist's own order.
            first = min(self.workqueue, key=lambda group: lane_rank(group))  # the first of equal ranks
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return Lanes(config, log)


TIMELINE = os.environ.get("SHUNTER_TEST_TIMELINE")  # a file: one line per test start and end, for the lanes' picture


def _timeline(event: str, nodeid: str) -> None:
    if TIMELINE:
        with open(TIMELINE, "a") as out:
            out.write(f"{time.time():.1f} {os.environ.get('PYTEST_XDIST_WORKER', 'main')} {event} {nodeid}\n")


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _timeline("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    _timeline("end", nodeid)


@pytest.fixture(scope="session")
def ray_connected(ray_head: LocalHead) -> LocalHead:
    """This pytest process as a Ray driver of the session's head (for tests that run Ray Train in-process)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_head.gcs_address, log_to_driver=False)
    return ray_head


@pytest.fixture(scope="session")
def pg_schema_template() -> Iterator[str]:
    """A PostgreSQL database with shunter's schema, migrated once per test process: each `db` test gets a copy
    (`CREATE DATABASE ... TEMPLATE`), not a run of every migration (~0.5-1 s each on a loaded machine, ~240 tests).
    Here, not beside `db` (tests/service/conftest.py), so that every module that imports `db` finds it too."""
    from service.store.db import make_engine
    from service.store.migrate import upgrade
    from tests.service.conftest import fresh_pg_database

    with fresh_pg_database("shunter_template") as url:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()  # a template must have no one connected while it is copied
        yield url.rsplit("/", 1)[1]


def wait_for(
    predicate: Callable[[], object],
    *,
    timeout: float = 60.0,
    interval: float = 0.2,
    what: str = "",
    explain: Callable[[], str] | None = None,
) -> object:
    """Poll until `predicate()` is truthy; fail the test with `what` after `timeout` seconds, and with what
    `explain()` says then (a job's timeline: `timeline`), since CI keeps nothing but the test's output."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    said = ""
    if explain is not None:
        try:
            said = "\n" + explain()
        except Exception as e:  # the explanation must not hide the timeout
            said = f"\n(explain failed: {e!r})"
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what or predicate}; last value: {last!r}{said}")


def timeline(client: object, job_id: str) -> str:
    """A job's events and attempts, one line each, seconds from its first event: what a timeout leaves to read."""
    events = client.events(job_id)  # type: ignore[attr-defined]
    if not events:
        return f"{job_id}: no events"
    t0 = events[0].at
    lines = [f"{job_id} timeline:"]
    for e in events:
        move = f"{e.from_state or ''}->{e.to_state}" if e.to_state else e.kind
        lines.append(f"  +{(e.at - t0).total_seconds():7.1f}s a{e.attempt or '-'} {move} {e.reason}: {e.message or ''}")
    for a in client.attempts(job_id):  # type: ignore[attr-defined]
        end = f"+{(a.ended_at - t0).total_seconds():.1f}s {a.end_reason}" if a.ended_at else "not ended"
        lines.append(f"  attempt {a.number}: started +{(a.started_at - t0).total_seconds():.1f}s, ended {end}, "
                     f"ray {a.ray_status}")  # fmt: skip
    return "\n".join(lines)


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
