"""The start estimate's replay, pure and table-driven (`position` / `estimated_start` over the app: tests/api)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from service.estimate import Held, Pending, expected_end, replay

CPU = "CPU"


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
    ],
)
def test_replay(pending: list, running: list, capacity: float, expected: dict) -> None:
    order = [Pending(name, {CPU: need}, duration, 0.0) for name, need, duration in pending]
    held = [Held({CPU: need}, end) for need, end in running]
    assert replay(order, held, {CPU: capacity}, 0.0) == expected


def test_replay_waits_out_a_retry_backoff() -> None:
    assert replay([Pending("a", {CPU: 1}, 10, not_before=40.0)], [], {CPU: 2}, 0.0) == {"a": 40.0}


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
    jobs=st.lists(st.tuples(st.integers(1, 4), st.one_of(st.none(), st.integers(1, 100))), min_size=1, max_size=12),
    running=st.lists(st.tuples(st.integers(1, 4), st.one_of(st.none(), st.integers(1, 200))), max_size=3),
)
def test_replayed_starts_never_overcommit(jobs: list, running: list) -> None:
    """At every instant the replayed jobs and the running ones together fit the capacity."""
    capacity = 8
    assume(sum(need for need, _ in running) <= capacity)  # what runs fits the cluster
    order = [Pending(f"j{i}", {CPU: need}, duration, 0.0) for i, (need, duration) in enumerate(jobs)]
    held = [Held({CPU: need}, end) for need, end in running]
    starts = replay(order, held, {CPU: capacity}, 0.0)
    intervals = [(0.0, end if end is not None else float("inf"), need) for need, end in running]
    for job in order:
        start = starts[job.job_id]
        if start is not None:
            intervals.append((start, start + job.duration if job.duration else float("inf"), job.total[CPU]))
    for t in {s for s, _, _ in intervals}:
        assert sum(need for s, e, need in intervals if s <= t < e) <= capacity
