"""Issue 35, item 11: a running attempt's Ray log read by byte range, never whole, by the API and the dispatcher.

Quick tier, no Ray: `RayJobs` over real HTTP against Ray's log surfaces (tests/ray_log_http.py: the agent's file
route is aiohttp's static route, the handler Ray's agent uses), on real log files of tens of MB written by each test.
The same reads against a real Ray head: tests/api/test_live_service.py (slow tier). The API's end of it, and what
today's main did: tests/security/test_audit2.py::test_11_...
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, select

from service.backends.ray_jobs import RayJobs
from service.core.errors import InfraError
from service.dispatch.host_files import HostFiles
from service.dispatch.late_logs import LateLogs
from service.lifecycle.log_reads import RayLogReader, RayLogs, byte_range
from service.store.db import make_engine
from service.store.migrate import upgrade
from service.store.models import Attempt, EndReason, Job, JobState, utcnow
from tests.live_api import add_attempt, live_api
from tests.ray_log_http import RayLogHttp, ray_log_http

SID = "shunter-jtest-1"


def write_log(path: Path, size: int) -> bytes:
    """Numbered lines, about `size` bytes, written a MiB at a time; returns the log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        n = written = 0
        while written < size:
            chunk = b"".join(b"step %09d: loss 0.%06d\n" % (n + i, i) for i in range(40_000))
            n += 40_000
            out.write(chunk)
            written += len(chunk)
    return path.read_bytes()


@pytest.fixture
def ray_http(tmp_path: Path) -> Iterator[RayLogHttp]:
    with ray_log_http(tmp_path / "ray-logs") as served:
        served.jobs[SID] = "RUNNING"
        yield served


def test_ranges_and_tails_of_a_large_log_are_its_bytes_in_bounded_memory(ray_http: RayLogHttp) -> None:
    """Offsets, limits and tails (one scanning back over several blocks) against a 30 MB log, through what the API
    does (`RayLogs`, `RayLogReader`, `byte_range`): each answer is the file's slice, Ray sends only blocks near what is
    read, and Python memory peaks at a few blocks."""
    data = write_log(ray_http.log_path(SID), 30 << 20)
    size = len(data)
    lines = data.splitlines(keepends=True)
    block = 64 * 1024
    ray = RayJobs(ray_http.dashboard_url)
    cache = RayLogs()
    rng = random.Random(35)
    tracemalloc.start()
    try:
        view = cache.view(ray, SID, max_age=60, block=block)
        assert view is not None and view.size == size and view.block_start == (size - 1) // block * block
        for _ in range(40):
            offset, limit = rng.randrange(size + 100), rng.randrange(1, 300_000)
            reader = RayLogReader(ray, view, block)
            start, end = byte_range(reader.read, size, offset=offset, tail=None, limit=limit)
            assert (start, end) == (min(offset, size), min(size, offset + limit))
            assert b"".join(reader.chunks(start, end)) == data[start:end]
        for tail in (1, 3, 5000, 20_000):  # 20,000 lines: back over ~10 blocks
            reader = RayLogReader(ray, view, block)
            start, end = byte_range(reader.read, size, offset=None, tail=tail, limit=None)
            assert end == size and data[start:end] == b"".join(lines[-tail:])
            assert b"".join(reader.chunks(start, end)) == data[start:end]
        reader = RayLogReader(ray, view, block)  # the last 50 lines at or after an offset, cut by a limit
        assert byte_range(reader.read, size, offset=size - 100, tail=50, limit=30) == (size - 100, size - 70)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        ray.close()
    assert ray_http.sent["jobs_api"] == 0 and ray_http.sent["state_api"] == 0
    assert ray_http.sent["agent"] < 40 * (300_000 + 2 * block) + 20 * block, dict(ray_http.sent)
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB"


def test_a_growing_log_is_seen_grow_one_block_kept(ray_http: RayLogHttp) -> None:
    """The cached view follows the log's end as it grows past blocks, keeping only its last block."""
    path = ray_http.log_path(SID)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"a\n" * 10)
    ray = RayJobs(ray_http.dashboard_url)
    cache = RayLogs()
    try:
        first = cache.view(ray, SID, max_age=0, block=4096)
        assert first is not None and (first.size, first.block_start, first.block) == (20, 0, b"a\n" * 10)
        with open(path, "ab") as out:
            out.write(b"b" * 10_000 + b"\n")
        grown = cache.view(ray, SID, max_age=0, block=4096)
        assert grown is not None and grown.size == 10_021 and grown.block_start == 8192
        assert grown.block == path.read_bytes()[8192:]
        assert cache.view(ray, "shunter-unknown-1", max_age=0, block=4096) is None  # Ray has no such job
        past_the_end = ray.log_range(SID, 50_000, 10)  # Ray's agent answers 416, with the size
        assert past_the_end is not None and (past_the_end.data, past_the_end.size) == (b"", 10_021)
    finally:
        ray.close()


def test_a_ray_that_does_not_answer_is_told_apart_from_one_that_has_no_such_job(tmp_path: Path) -> None:
    """None is Ray's word that it has no such submission (an attempt not submitted yet: its log is empty); Ray away
    raises, and that answer is kept for `max_age` as a view is: requests meanwhile do not ask a Ray that is away."""
    from service.backends.ray_local import free_port

    closed = RayJobs(f"http://127.0.0.1:{free_port()}")
    cache = RayLogs()
    asked = 0
    real = closed.log_range

    def counted(submission_id: str, start: int, length: int):  # type: ignore[no-untyped-def]
        nonlocal asked
        asked += 1
        return real(submission_id, start, length)

    closed.log_range = counted  # type: ignore[method-assign]
    try:
        for _ in range(3):
            with pytest.raises(InfraError):
                cache.view(closed, SID, max_age=60, block=4096)
        assert asked == 1
        with pytest.raises(InfraError):
            cache.view(closed, SID, max_age=0, block=4096)
        assert asked == 2
    finally:
        closed.close()
    with ray_log_http(tmp_path / "ray-logs") as served:
        ray = RayJobs(served.dashboard_url)
        try:
            assert cache.view(ray, "shunter-unknown-1", max_age=0, block=4096) is None
        finally:
            ray.close()


def test_an_agent_out_of_reach_falls_back_to_the_heads_state_api(tmp_path: Path) -> None:
    """With the agent's port closed to this host, reads go through the head's state API (a pass from the log's start,
    in bounded memory), and the agent is not tried again for a while."""
    with ray_log_http(tmp_path / "ray-logs", agent_listening=False) as ray_http:
        ray_http.jobs[SID] = "RUNNING"
        data = write_log(ray_http.log_path(SID), 20 << 20)
        ray = RayJobs(ray_http.dashboard_url)
        tracemalloc.start()
        try:
            piece = ray.log_range(SID, 5_000_000, 100_000)
            assert piece is not None and piece.data == data[5_000_000:5_100_000] and piece.size == len(data)
            stream = ray.log_stream(SID, len(data) - 300_000, None)
            assert stream is not None and b"".join(stream) == data[-300_000:]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            ray.close()
        assert ray_http.agent_url in ray.driver_logs._down_until  # not tried again for AGENT_RETRY_SECONDS
        assert ray_http.sent["state_api"] >= len(data) and ray_http.sent["jobs_api"] == 0
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB"


def test_the_dispatcher_keeps_a_large_log_a_chunk_at_a_time(ray_http: RayLogHttp, tmp_path: Path) -> None:
    """An attempt ended on its driver's word has its log kept once its Ray Job has ended (`LateLogs`): copied out by
    range into the stored copy, byte for byte, holding a chunk at a time, not the 40 MB log."""
    engine = make_engine(f"sqlite:///{tmp_path / 'd.db'}")
    upgrade(engine)
    job = Job(name="j", owner="alice", spec={}, state=JobState.SUCCEEDED, attempt=1)
    add_attempt(engine, job)
    with Session(engine) as session:
        attempt = session.exec(select(Attempt).where(Attempt.job_id == job.id)).one()
        attempt.ended_at, attempt.driver_ended_at, attempt.end_reason = utcnow(), utcnow(), EndReason.SUCCEEDED
        session.add(attempt)
        session.commit()
        session.refresh(attempt)
    sid = attempt.submission_id
    ray_http.jobs[sid] = "SUCCEEDED"
    data = write_log(ray_http.log_path(sid), 40 << 20)
    ray = RayJobs(ray_http.dashboard_url)
    files = HostFiles(tmp_path / "data")
    late = LateLogs(engine=engine, ray=ray, files=files, owner="d1", linger_seconds=60)
    late.add(attempt, utcnow() - timedelta(seconds=1))
    tracemalloc.start()
    try:
        late.step()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        ray.close()
    assert late.pending == {}
    assert files.log_path(job.id, 1).read_bytes() == data
    with Session(engine) as session:
        kept = session.get(Attempt, attempt.id)
        assert kept is not None and kept.ray_status == "SUCCEEDED" and kept.log_uri == str(files.log_path(job.id, 1))
    engine.dispose()
    assert ray_http.sent["jobs_api"] == 0
    assert peak < 4 << 20, f"keeping a 40 MB log peaked at {peak / 2**20:.1f} MiB"


def test_a_follower_far_behind_reads_on_by_range(ray_http: RayLogHttp, tmp_path: Path) -> None:
    """A follow stream from an offset far back in a running attempt's log gets every byte from there, read from Ray
    by range (blocks of 64 KiB here), until its timeout."""
    engine = make_engine(f"sqlite:///{tmp_path / 'api.db'}")
    upgrade(engine)
    job = Job(name="j", owner="alice", spec={}, state=JobState.RUNNING, attempt=1)
    add_attempt(engine, job)
    sid = f"shunter-{job.id}-1"
    ray_http.jobs[sid] = "RUNNING"
    data = write_log(ray_http.log_path(sid), 4 << 20)
    ray = RayJobs(ray_http.dashboard_url)
    try:
        with live_api(engine, tmp_path, ray=ray, ray_log_block_bytes=64 * 1024) as api:
            offset = len(data) - 3_000_000
            got = b""
            params = {"follow": "true", "offset": offset, "timeout_seconds": 3}
            with httpx.stream("GET", f"{api.url}/v1/jobs/{job.id}/logs", params=params, timeout=30) as r:
                assert r.status_code == 200
                for chunk in r.iter_bytes():
                    got += chunk
            assert got == data[offset:]
            tail = httpx.get(f"{api.url}/v1/jobs/{job.id}/logs", params={"follow": "true", "tail": 2,
                                                                        "timeout_seconds": 1}, timeout=30)  # fmt: skip
            assert tail.content == b"".join(data.splitlines(keepends=True)[-2:])
    finally:
        ray.close()
        engine.dispose()
    assert ray_http.sent["jobs_api"] == 0 and ray_http.sent["agent"] < len(data)
